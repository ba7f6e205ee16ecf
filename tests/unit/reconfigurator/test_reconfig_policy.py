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
