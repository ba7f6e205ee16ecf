"""The soak's fault schedule (tests/soak/faults.py): recovery windows from the cluster's timeouts, the
quiet tail where no fault starts, and the injector's recovery verdicts (no real stack: a fake load)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tests.soak.__main__ import SOAK_ENV
from tests.soak.faults import (
    KIND_GROUPS,
    RECOVERY_TIMEOUT_S,
    Injected,
    Injector,
    Schedule,
    quiet_tail_s,
    recovery_windows,
)

GAP_S = (2.0, 5.0)


def soak_schedule(duration_s: float) -> Schedule:
    return Schedule(duration_s, storm_s=70.0, calm_s=50.0, quiet_tail_s=quiet_tail_s(recovery_windows(SOAK_ENV)))


def test_every_kind_has_a_recovery_window_from_the_clusters_timeouts():
    windows = recovery_windows(SOAK_ENV)
    assert windows.keys() == KIND_GROUPS.keys()
    start = float(SOAK_ENV["DLS_NODE_AGENT_START_TIMEOUT_S"])
    assert all(start <= w < RECOVERY_TIMEOUT_S for w in windows.values())
    # the slowest: a hung worker is noticed after the hang timeout, then restarted (backoff) and started
    assert windows["worker_hang"] == float(SOAK_ENV["DLS_NODE_AGENT_HANG_TIMEOUT_S"]) + 1.0 + start
    assert quiet_tail_s(windows) == max(windows.values()) == windows["worker_hang"]
    slower = recovery_windows({**SOAK_ENV, "DLS_NODE_AGENT_START_TIMEOUT_S": "90"})
    assert quiet_tail_s(slower) == quiet_tail_s(windows) + 30.0  # it follows the settings


@pytest.mark.parametrize("duration_s", [80.0, 120.0, 150.0, 180.0, 300.0, 600.0, 601.3])
def test_no_fault_is_tried_in_the_quiet_tail_nor_in_a_calm_for_any_seed(duration_s):
    schedule = soak_schedule(duration_s)
    assert schedule.last_start_s == duration_s - schedule.quiet_tail_s > 0
    for seed in range(200):
        attempts = list(schedule.attempts(random.Random(seed), GAP_S))
        assert attempts and attempts[0] == 0.0
        last_cycle_s = (schedule.last_start_s // 120.0) * 120.0  # its calm would reach into the tail: none
        assert all(at < schedule.last_start_s and (at % 120.0 < 70.0 or at >= last_cycle_s) for at in attempts)
        assert all(schedule.may_start(at) for at in attempts)
        assert all(GAP_S[0] <= b - a for a, b in zip(attempts, attempts[1:], strict=False))


def test_short_soaks_still_have_a_storm_before_their_tail():
    schedule = soak_schedule(120.0)  # CI's
    assert 50.0 < schedule.last_start_s < 60.0  # 120 s less the slowest window (67 s with SOAK_ENV's backoff)
    counts = [len(list(schedule.attempts(random.Random(seed), GAP_S))) for seed in range(50)]
    assert min(counts) >= 8  # the 2-minute bar asks for 8 faults
    schedule = soak_schedule(180.0)  # its second storm would begin in the tail: the first goes on to it
    counts = [len(list(schedule.attempts(random.Random(seed), GAP_S))) for seed in range(50)]
    assert min(counts) >= 2 * 12  # the 3-minute bar asks for 12 faults; not every attempt finds a kind free


def test_may_start_is_a_storm_before_the_tail():
    schedule = Schedule(320.0, storm_s=70.0, calm_s=50.0, quiet_tail_s=66.5)
    assert schedule.may_start(0.0) and schedule.may_start(69.9) and not schedule.may_start(70.0)
    assert not schedule.may_start(119.9) and schedule.may_start(120.0)
    assert schedule.may_start(253.4) and not schedule.may_start(253.5)  # a storm, cut where the tail starts
    assert not schedule.may_start(260.0) and not schedule.may_start(-1.0) and not schedule.may_start(320.0)
    # the last cycle before the tail has no calm of its own: the tail is one
    three_minutes = Schedule(180.0, storm_s=70.0, calm_s=50.0, quiet_tail_s=66.5)
    assert three_minutes.may_start(70.0) and three_minutes.may_start(113.4) and not three_minutes.may_start(113.5)
    longer = Schedule(400.0, storm_s=70.0, calm_s=50.0, quiet_tail_s=66.5)  # the tail from 333.5: calm 310-360 too
    assert not longer.may_start(75.0) and not longer.may_start(200.0) and longer.may_start(250.0)
    assert longer.may_start(320.0) and not longer.may_start(333.5)
    assert list(Schedule(60.0, 70.0, 50.0, 66.5).attempts(random.Random(0), GAP_S)) == []  # too short: none


class FakeLoad:
    """The load's side the injector reads: when a request last completed, and whether any is left."""

    def __init__(self, idle: bool = False) -> None:
        self.last_completion_at = 0.0
        self.idle = idle


def judge(injected: Injected, load: FakeLoad, complete_after_s: float | None = None) -> float | None | bool:
    injector = Injector.__new__(Injector)  # its verdict needs only the load
    injector.load = load

    async def scenario():
        if complete_after_s is not None:
            async def complete() -> None:
                await asyncio.sleep(complete_after_s)
                load.last_completion_at = time.monotonic()
            asyncio.get_running_loop().create_task(complete())
        return await asyncio.wait_for(injector._recovery(injected), 5.0)

    return asyncio.run(scenario())


def test_a_fault_is_recovered_once_a_request_completes_after_its_part_came_back():
    assert isinstance(judge(Injected("w", lambda: True), FakeLoad(), complete_after_s=0.2), float)


def test_a_fault_with_no_load_left_to_show_it_is_not_judged():
    assert judge(Injected("gateway-0", lambda: True), FakeLoad(idle=True)) is False
    # a skewed worker comes back only by serving a step: with no load left it never can
    assert judge(Injected("skew-1", lambda: False, needs_load=True), FakeLoad(idle=True)) is False


def test_a_fault_whose_part_is_not_back_while_the_load_runs_is_not_recovered(monkeypatch):
    import tests.soak.faults as faults

    monkeypatch.setattr(faults, "RECOVERY_TIMEOUT_S", 0.3)
    assert judge(Injected("w", lambda: False), FakeLoad()) is None
    assert judge(Injected("skew-1", lambda: False, needs_load=True), FakeLoad()) is None  # load there: it failed
    assert judge(Injected("w", lambda: True), FakeLoad()) is None  # back, yet nothing completes under load
