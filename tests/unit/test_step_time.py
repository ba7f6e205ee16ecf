"""One step-time model (``LatencyProfile.batch_step_s``) for the simulator's timer and the paced worker."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from services.worker.engine.fake import ZeroComputeEngine
from services.worker.service.service import WorkerService
from shared.messages.base import CacheMode, StepKind
from shared.profiles import LatencyProfile
from shared.settings import WorkerSettings
from sim.timing import StepTimer

# TP-1: a full step without a cache (no KV written) is cheaper than a recompute step
PROFILE = {"model": "toy", "device": "toy", "context_tokens": 100, "block_length": 8, "tp": {"1": {
    "recompute_ms": {"1": 100, "2": 120}, "cache_ms": {"1": 10, "2": 12}, "full_ms": {"1": 80, "2": 96}}}}


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    return path


def test_no_cache_steps_cost_the_full_curve_recompute_steps_the_recompute_one():
    profile = LatencyProfile.from_dict(PROFILE)
    assert profile.batch_step_s(1, [100, 100], 0, no_cache=True) == pytest.approx(0.096)
    assert profile.batch_step_s(1, [100, 100], 0, no_cache=False) == pytest.approx(0.120)
    assert profile.batch_step_s(1, [50, 150], 2) == pytest.approx(0.120 + 0.012)  # mean context 100
    assert profile.batch_step_s(1, [200], 0, scale_context=True) == pytest.approx(0.200)
    assert profile.batch_step_s(1, [200], 0, scale_context=False) == pytest.approx(0.100)


def _paced_wait(monkeypatch, profile_path, kinds: list[StepKind], modes: list[CacheMode],
                context_tokens: int | None) -> float:
    """What the paced worker sleeps for a step that took no time (``asyncio.sleep`` captured)."""
    settings = WorkerSettings(pace_profile=str(profile_path), pace_context_tokens=context_tokens,
                              profile=str(profile_path))
    worker = WorkerService(settings, ZeroComputeEngine(), nc=None, store=None, instance_id="i0")
    states = [SimpleNamespace(prompt_ids=[0] * 40, gen_length=60, cache_mode=m) for m in modes]
    outcomes = [SimpleNamespace(kind=k) for k in kinds]
    waits = []

    async def record(seconds):
        waits.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", record)
    # the clock stands still and the step "starts" 10 s after it, so the wait is the target plus 10 s
    # however long this machine takes to get there (a loaded machine took 4 ms with the clock running)
    monkeypatch.setattr(time, "perf_counter", lambda: 1000.0)
    asyncio.run(worker._pace(1010.0, outcomes, states))
    return waits[0] - 10.0


@pytest.mark.parametrize(("kinds", "modes", "no_cache"), [
    ([StepKind.RECOMPUTE, StepKind.RECOMPUTE], [CacheMode.NONE, CacheMode.NONE], True),
    ([StepKind.RECOMPUTE, StepKind.CACHE], [CacheMode.DUAL, CacheMode.DUAL], False),
])
@pytest.mark.parametrize("anchor", [None, 100])
def test_the_paced_worker_and_the_simulator_time_a_step_alike(monkeypatch, profile_path, kinds, modes, no_cache, anchor):
    timer = StepTimer(LatencyProfile.from_dict(PROFILE), scale_context=anchor is not None)
    recompute = [100 for k in kinds if k == StepKind.RECOMPUTE]
    expected = timer.duration(1, recompute, len(kinds) - len(recompute), no_cache)
    assert _paced_wait(monkeypatch, profile_path, kinds, modes, anchor) == pytest.approx(expected, abs=1e-3)
