"""What the reconfigurator service plans with and when it plans at all: the planning profile at
``DLS_RECONFIGURATOR_PROFILE_SCALE`` (one model and several), the workload monitor's block length and
cache mode (settings, else the served model's default block), and no plan on a cluster with no READY
instance unless a plan would serve arrivals (several models: only a model with arrivals and no instance,
the scale-from-zero path), nor once the service is stopping. The service runs in process, its NATS
connection a recorder of what it publishes."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.reconfigurator.service import ReconfiguratorService, loaded_profiles, monitor_settings
from shared.messages import encode
from shared.messages.control import Arrival, WorkerHeartbeat, WorkerStatus, WorkloadStats
from shared.profiles import LatencyProfile
from shared.settings import ReconfiguratorSettings

REPO = Path(__file__).resolve().parents[3]
BUNDLED = REPO / "models" / "dls-tiny"  # its training_info.json: blocks of 8
PROFILE = REPO / "profiles" / "llada-8b-h100.json"
TWO = "/m/alpha,/m/beta"  # no such directories: the fallback generation limits (blocks of 32)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """Stands in for the NATS connection: keeps what is published."""

    def __init__(self) -> None:
        self.published: list[str] = []  # subjects, in order

    async def publish(self, subject: str, data: bytes, headers=None) -> None:
        self.published.append(subject)


# --- the planning profile's scale ---------------------------------------------------------------------


def test_the_profile_scale_applies_to_one_model_and_to_every_model():
    raw = LatencyProfile.load(PROFILE)
    one = loaded_profiles(ReconfiguratorSettings(profile=str(PROFILE), profile_scale=20.0))
    assert one.full(1, 1) == pytest.approx(20 * raw.full(1, 1)) and "x20" in one.notes
    several = loaded_profiles(ReconfiguratorSettings(model_dirs=TWO, profile=str(PROFILE), profile_scale=4.0))
    assert {name: p.full(1, 8) for name, p in several.items()} == pytest.approx(
        {"alpha": 4 * raw.full(1, 8), "beta": 4 * raw.full(1, 8)})
    assert loaded_profiles(ReconfiguratorSettings(profile=str(PROFILE))).full(1, 1) == raw.full(1, 1)


def test_the_profile_scale_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("DLS_RECONFIGURATOR_PROFILE_SCALE", "10.8")
    assert ReconfiguratorSettings().profile_scale == 10.8
    monkeypatch.setenv("DLS_RECONFIGURATOR_PROFILE_SCALE", "0")
    with pytest.raises(ValueError, match="greater than 0"):
        ReconfiguratorSettings()


# --- the monitor's block length and cache -------------------------------------------------------------


def test_the_monitor_counts_steps_in_the_served_models_blocks_with_the_dual_cache_by_default(tmp_path):
    twin = tmp_path / "twin"  # a copy of the bundled model's lengths under another name
    twin.mkdir()
    shutil.copy(BUNDLED / "training_info.json", twin / "training_info.json")
    by_model = monitor_settings(ReconfiguratorSettings(model_dirs=f"{BUNDLED},/m/other", window_s=30.0,
                                                       peak_windows=1))
    assert {m: (s.block_length, s.kv_cache) for m, s in by_model.items()} == {"dls-tiny": (8, True),
                                                                              "other": (32, True)}
    assert by_model["dls-tiny"].window_s == 30.0 and by_model["dls-tiny"].peak_windows == 1
    [(name, one)] = monitor_settings(ReconfiguratorSettings(model_dir=str(twin))).items()
    assert (name, one.block_length) == ("twin", 8)


def test_the_settings_set_the_block_length_and_cache_for_every_model(monkeypatch):
    monkeypatch.setenv("DLS_RECONFIGURATOR_BLOCK_LENGTH", "16")
    monkeypatch.setenv("DLS_RECONFIGURATOR_CACHE", "none")
    by_model = monitor_settings(ReconfiguratorSettings(model_dirs=f"{BUNDLED},/m/other"))
    assert {m: (s.block_length, s.kv_cache) for m, s in by_model.items()} == {"dls-tiny": (16, False),
                                                                              "other": (16, False)}
    assert monitor_settings(ReconfiguratorSettings(cache="prefix"))["dls-tiny"].kv_cache  # planned as dual
    for bad in ({"cache": "full"}, {"block_length": 0}):
        with pytest.raises(ValueError):
            ReconfiguratorSettings(**bad)


def test_the_service_plans_with_them():
    settings = ReconfiguratorSettings(model_dir=str(BUNDLED), profile=str(PROFILE), cache="none",
                                      cluster='{"nodes": {"n1": 4}}')
    service = ReconfiguratorService(settings, Recorder(), LatencyProfile.load(PROFILE), Clock())
    workload = service.core._monitor.snapshot()  # noqa: SLF001 (what the core's planner is handed)
    assert (workload.block_length, workload.kv_cache) == (8, False)


# --- when no plan is made -----------------------------------------------------------------------------


def beat(service: ReconfiguratorService, instance_id: str, gpu: int, status=WorkerStatus.READY, model: str = "x"):
    now = service.clock()  # a later beat of an instance is newer by its sent_at (one process: one started_at)
    service.leases.observe(WorkerHeartbeat(instance_id=instance_id, node="n1", tp=1, gpu_ids=[gpu], max_batch=16,
                                           model=model, status=status, ttl_s=600.0, sent_at=now, started_at=0.0),
                           now)


def arrive(service: ReconfiguratorService, model: str = "", count: int = 20) -> None:
    now = service.clock()
    arrivals = [Arrival(time_s=now - i * 0.5, prompt_tokens=120, output_tokens=64, model=model) for i in range(count)]
    msg = SimpleNamespace(data=encode(WorkloadStats(window_start=now - 10.0, window_end=now, arrivals=arrivals)))
    asyncio.run(service._on_stats(msg))  # noqa: SLF001 (the stats handler, without NATS)


def one_model() -> ReconfiguratorService:
    """Observe only: a plan is acknowledged at once, so no step waits for one in flight."""
    settings = ReconfiguratorSettings(profile=str(PROFILE), cluster='{"nodes": {"n1": 4}, "tp_degrees": [1]}',
                                      window_s=10.0, peak_windows=1, solver_time_limit_s=10.0, enabled=False)
    return ReconfiguratorService(settings, Recorder(), LatencyProfile.load(PROFILE), Clock())


def two_models() -> ReconfiguratorService:
    settings = ReconfiguratorSettings(model_dirs=TWO, profile=str(PROFILE), window_s=10.0, peak_windows=1,
                                      cluster='{"nodes": {"n1": 4}, "tp_degrees": [1]}', solver_time_limit_s=10.0,
                                      switch_s="alpha=1,beta=1", min_instances="alpha=0,beta=0")
    profile = LatencyProfile.load(PROFILE)
    return ReconfiguratorService(settings, Recorder(), {"alpha": profile, "beta": profile}, Clock())


def test_one_model_no_plan_with_nothing_ready_and_no_arrivals():
    service = one_model()
    assert asyncio.run(service.step()) is None  # an empty cluster, nothing arrived
    beat(service, "a", 0, WorkerStatus.STARTING)
    assert asyncio.run(service.step()) is None
    arrive(service)
    assert asyncio.run(service.step()) is not None  # arrivals: starting instances are planned around
    service.clock.now += 60.0  # the arrivals leave the monitor's memory (one window of 10 s)
    assert asyncio.run(service.step()) is None
    beat(service, "a", 0, WorkerStatus.READY)
    assert asyncio.run(service.step()) is not None  # a READY instance: the core decides


def test_a_draining_cluster_gets_no_plan_even_with_arrivals_in_the_window(caplog):
    service = one_model()
    for gpu in range(4):
        beat(service, f"g{gpu}", gpu)
    arrive(service)
    service.clock.now += 1.0
    for gpu in range(4):  # shutdown: every worker drains
        beat(service, f"g{gpu}", gpu, WorkerStatus.DRAINING)
    with caplog.at_level(logging.INFO, "dls.reconfigurator"):
        assert asyncio.run(service.step()) is None
    assert "no reconfiguration this period: no instance is READY and 4 are draining" in caplog.text


def test_several_models_an_empty_cluster_is_planned_only_for_a_model_with_arrivals_and_no_instance():
    service = two_models()
    assert asyncio.run(service.step()) is None  # no instance, no arrivals
    beat(service, "alpha-0", 0, WorkerStatus.STARTING, model="alpha")
    arrive(service, "alpha")  # alpha has an instance on its way: no out-of-period step
    assert service.num_out_of_period_steps == 0
    assert asyncio.run(service.step()) is None  # alpha has arrivals and an instance on its way
    service.leases.drop("alpha-0")  # its start failed: alpha has arrivals and no instance
    round_ = asyncio.run(service.step())
    assert round_ is not None and round_.plan_to_apply is not None  # scale from zero, on an empty cluster
    assert sum(round_.plan_to_apply.division.instances_by_model_tp["alpha"].values()) >= 1
    assert service.nc.published  # published


def test_no_plan_once_the_service_is_stopping():
    service = one_model()
    beat(service, "a", 0)
    arrive(service)
    asyncio.run(service.stop())
    assert asyncio.run(service.step()) is None and not service.nc.published
