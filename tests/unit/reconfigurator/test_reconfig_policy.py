"""The Reconfigurator policy: arrivals in, plans out, one plan in flight at a time."""

from __future__ import annotations

from services.reconfigurator.core.monitor import ArrivalEvent, MonitorSettings
from services.reconfigurator.core.reconfigurator import Reconfigurator


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def feed(policy: Reconfigurator, clock: FakeClock, rps: float, seconds: float) -> None:
    """Evenly spaced arrivals of 256-token prompts and 192-token answers."""
    count = int(rps * seconds)
    start = clock.now
    for i in range(count):
        policy.observe(ArrivalEvent(start + i / rps, prompt_tokens=256, output_tokens=192))
    clock.now = start + seconds


def shape(plan) -> dict[int, int]:
    return {tp: n for tp, n in plan.capacity.instances_by_tp.items() if n}


def test_low_then_high_load_reshapes_the_cluster(profile, cluster16):
    clock = FakeClock()
    policy = Reconfigurator(profile, clock, MonitorSettings(window_s=60.0, slo_s=4.0), ack_timeout_s=120.0)
    feed(policy, clock, rps=0.5, seconds=60)
    first = policy.step(cluster16)
    assert first.decision.apply and first.plan_to_apply.plan_id == "plan-1"
    assert shape(first.plan_to_apply) == {4: 4}
    running = cluster16.with_placement(tuple(first.plan_to_apply.placement.target_instances()))

    feed(policy, clock, rps=80.0, seconds=60)
    blocked = policy.step(running)
    assert not blocked.decision.apply and blocked.outcome is None and "plan-1" in blocked.decision.reason
    assert policy.acknowledge("plan-1")

    second = policy.step(running)
    assert second.decision.apply
    assert shape(second.plan_to_apply).get(1, 0) > 0
    assert second.plan_to_apply.plan_id == "plan-2"
    assert second.outcome.current.instances_by_tp[4] == 4


def test_gain_plans_wait_for_the_peak_memory_and_bursts_are_remembered(profile, cluster16):
    """After a burst brought 16 TP-1 instances, a light load that 4 TP-4 ones would serve with lower
    latency does not reshape the cluster until the burst is older than the monitor's memory (8
    windows); and a monitor that has not yet watched that long makes no plan for a gain alone."""
    clock = FakeClock()
    settings = MonitorSettings(window_s=60.0, slo_s=4.0, peak_windows=8)
    policy = Reconfigurator(profile, clock, settings, margin=0.05, ack_timeout_s=120.0)
    feed(policy, clock, rps=80.0, seconds=60)
    first = policy.step(cluster16)
    assert first.decision.apply and shape(first.plan_to_apply).get(1, 0) > 0
    tp1 = cluster16.with_placement(tuple(first.plan_to_apply.placement.target_instances()))
    assert policy.acknowledge("plan-1")

    feed(policy, clock, rps=0.5, seconds=300)  # quiet for less than the memory: the burst is the plan
    assert not policy.step(tp1).decision.apply
    feed(policy, clock, rps=0.5, seconds=240)  # the burst is 540 s old, past 8 x 60 s
    quiet = policy.step(tp1)
    assert quiet.decision.apply and shape(quiet.plan_to_apply) == {4: 4}, quiet.decision.reason

    fresh_clock = FakeClock()
    fresh = Reconfigurator(profile, fresh_clock, settings, margin=0.05, ack_timeout_s=120.0)
    feed(fresh, fresh_clock, rps=0.5, seconds=120)
    early = fresh.step(tp1)
    assert not early.decision.apply and "watched for 120 s" in early.decision.reason
    feed(fresh, fresh_clock, rps=0.5, seconds=360)
    assert shape(fresh.step(tp1).plan_to_apply) == {4: 4}
