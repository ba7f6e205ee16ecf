"""Measured profiles: the H200 measurement as committed, curves that are not monotone in batch size
smoothed by the rule the file names or refused, TP > 1 made from TP-1 through the modelled profile's
tensor-parallel model (and said so), and the simulator, the reconfigurator and the paced worker take it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.reconfigurator.core.spec import uniform_cluster
from services.reconfigurator.core.stage1 import solve_stage1
from services.worker.engine.fake import ZeroComputeEngine
from services.worker.service.service import WorkerService
from shared.profiles import LatencyProfile, ProfileError
from shared.settings import WorkerSettings
from sim import experiments
from sim.presets import PRESETS
from tests.unit.reconfigurator.reconfig_builders import make_workload
from tests.unit.sim.sim_builders import make_trace

REPO = Path(__file__).resolve().parents[2]
MEASURED = REPO / "profiles" / "llada-8b-h200-measured.json"
MODELLED = REPO / "profiles" / "llada-8b-h100.json"
KINDS = ("recompute_ms", "cache_ms", "full_ms")


@pytest.fixture(scope="module")
def measured() -> LatencyProfile:
    return LatencyProfile.load(MEASURED)


def raw_points(kind: str) -> dict[int, float]:
    """The measurement as the file holds it (TP 1)."""
    return {int(b): ms for b, ms in json.loads(MEASURED.read_text())["tp"]["1"][kind].items()}


def curve(profile: LatencyProfile, tp: int, kind: str) -> dict[int, float]:
    c = profile.curves[tp][kind]
    return dict(zip(c.batch_sizes, c.latencies_ms, strict=True))


def toy(cache_ms: dict[str, float], **extra) -> dict:
    return {"model": "m", "device": "d", "tp": {"1": {"recompute_ms": {"1": 10, "2": 12, "4": 20},
                                                      "cache_ms": cache_ms}}, **extra}


def test_the_committed_profile_is_the_measurement_and_says_where_it_was_taken(measured):
    data = json.loads(MEASURED.read_text())
    assert data["measured"] is True and "H200" in data["device"] and "H200" in data["measured_on"]
    assert list(data["tp"]) == ["1"]  # only TP 1 was measured (one GPU)
    assert measured.measured and measured.tp_degrees == (1, 2, 4, 8) and measured.derived_tp == (2, 4, 8)
    assert curve(measured, 1, "recompute_ms") == raw_points("recompute_ms")
    assert curve(measured, 1, "full_ms") == raw_points("full_ms")
    cache = raw_points("cache_ms")
    assert cache[2] > cache[4]  # the measurement's own dip, which the file's rule smooths
    assert curve(measured, 1, "cache_ms") == {**cache, 2: cache[4]}
    assert any(s.startswith("TP-1 cache_ms b2") for s in measured.smoothed)
    assert "derived from TP-1" in measured.notes and "smoothed (min-over-larger)" in measured.notes


def test_derived_degrees_scale_the_measurement_by_the_modelled_tp_ratio(measured):
    modelled = LatencyProfile.load(MODELLED)
    for tp in (2, 4, 8):
        for kind, of in (("recompute_ms", modelled.alpha), ("full_ms", modelled.full), ("cache_ms", modelled.beta)):
            tp1 = curve(measured, 1, kind)
            for batch, ms in curve(measured, tp, kind).items():
                expected = tp1[batch] * of(tp, batch) / of(1, batch)
                # the smoothing rule may lower a point (never raise it) to the next larger batch's
                assert ms <= expected + 1e-3
                if kind != "cache_ms" or batch != 2:
                    assert ms == pytest.approx(expected, abs=1e-3)
        values = [measured.beta(tp, b) for b in (1, 2, 4, 8, 16, 32)]
        assert values == sorted(values)
    assert measured.alpha(4, 1) < measured.alpha(2, 1) < measured.alpha(1, 1)
    per_gpu = {tp: measured.token_steps_per_s(tp, 32) / tp for tp in measured.tp_degrees}
    assert per_gpu[1] > per_gpu[2] > per_gpu[4] > per_gpu[8]


def test_a_curve_slower_at_a_smaller_batch_is_refused_naming_where():
    with pytest.raises(ProfileError, match=r"tp\.1\.cache_ms is not monotone .*batch 2: 9 ms, batch 4: 6 ms.*"
                                           r"batch_monotone"):
        LatencyProfile.from_dict(toy({"1": 5, "2": 9, "4": 6}), source="toy")
    with pytest.raises(ProfileError, match="batch_monotone 'mean' is not a known rule"):
        LatencyProfile.from_dict(toy({"1": 5, "2": 6, "4": 7}, batch_monotone="mean"))


def test_the_named_rule_times_a_batch_as_the_fastest_larger_one_and_says_so():
    profile = LatencyProfile.from_dict(toy({"1": 5, "2": 9, "4": 6}, batch_monotone="min-over-larger"))
    assert curve(profile, 1, "cache_ms") == {1: 5, 2: 6, 4: 6}
    assert profile.smoothed == ("TP-1 cache_ms b2 9 -> 6 ms",) and "TP-1 cache_ms b2 9 -> 6 ms" in profile.notes
    monotone = LatencyProfile.from_dict(toy({"1": 5, "2": 6, "4": 7}, batch_monotone="min-over-larger"))
    assert monotone.smoothed == () and curve(monotone, 1, "cache_ms") == {1: 5, 2: 6, 4: 7}


def test_tp_scaling_reads_its_model_beside_the_file_and_refuses_what_it_cannot_use(tmp_path):
    like = {"model": "m", "device": "model", "tp": {
        "1": {"recompute_ms": {"1": 10, "4": 40}, "cache_ms": {"1": 4, "4": 8}},
        "2": {"recompute_ms": {"1": 6, "4": 20}, "cache_ms": {"1": 3, "4": 5}}}}
    (tmp_path / "like.json").write_text(json.dumps(like))
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({**toy({"1": 8, "2": 10, "4": 16}), "tp_scaling": {"from_tp": 1, "like": "like.json"}}))
    profile = LatencyProfile.load(path)
    assert profile.derived_tp == (2,) and "TP-2 derived from TP-1 times like.json" in profile.notes
    assert curve(profile, 2, "cache_ms") == {1: 6.0, 2: pytest.approx(10 * (3 + 2 / 3) / (4 + 4 / 3), abs=1e-3), 4: 10.0}
    assert curve(profile, 2, "recompute_ms")[1] == 6.0 and curve(profile, 1, "cache_ms")[1] == 8
    with pytest.raises(ProfileError, match="from_tp 2 is not a measured degree"):
        LatencyProfile.from_dict({**toy({"1": 1}), "tp_scaling": {"from_tp": 2, "like": "like.json"}}, base_dir=tmp_path)
    with pytest.raises(ProfileError, match="profile file not found"):
        LatencyProfile.from_dict({**toy({"1": 1}), "tp_scaling": {"from_tp": 1, "like": "nope.json"}}, base_dir=tmp_path)
    with pytest.raises(ProfileError, match="needs 'from_tp' and 'like'"):
        LatencyProfile.from_dict({**toy({"1": 1}), "tp_scaling": {"like": "like.json"}})


def test_the_simulator_runs_on_it_and_says_which_profile_timed_the_run():
    setup = experiments.setup(PRESETS.get("tiny").quick(), profile_path=str(MEASURED), trace=make_trace(),
                              prediction="fallback")
    described = setup.describe()["profile"]
    assert described["path"] == str(MEASURED) and described["measured"] and described["derived_tp"] == [2, 4, 8]
    assert described["smoothed"] and setup.profile.derived_tp == (2, 4, 8)
    result = experiments.compare(setup, ["dilaserve"])
    assert all(p["num_finished"] == p["num_requests"] for p in result["policies"]["dilaserve"]["points"])
    modelled = experiments.setup(PRESETS.get("tiny").quick(), trace=make_trace(), prediction="fallback")
    assert not modelled.describe()["profile"]["measured"]
    assert setup.slo_s > modelled.slo_s  # the H200 as measured is slower than the H100 as modelled


def test_the_reconfigurator_plans_every_degree_from_it(measured):
    cluster = uniform_cluster(4, 4, (1, 2, 4))
    light, heavy = (solve_stage1(make_workload(rps, slo_s=30.0), cluster, measured) for rps in (0.5, 12))
    assert light.feasible and heavy.feasible
    assert any(tp > 1 and n for tp, n in light.instances_by_tp.items())  # a derived degree is used
    assert heavy.instances_by_tp.get(1, 0) >= light.instances_by_tp.get(1, 0)


def test_a_worker_paced_to_it_times_tp2_steps_from_the_derived_curves(measured):
    settings = WorkerSettings(pace_profile=str(MEASURED), tp=2)
    worker = WorkerService(settings, ZeroComputeEngine(), nc=None, store=None, instance_id="i0")
    assert worker.pace.batch_step_s(2, [], 4) == pytest.approx(measured.beta(2, 4))
    assert worker.pace.beta(2, 4) < worker.pace.beta(1, 4)
