"""The margin rule and the lifecycle of an issued plan, on an injected clock."""

from __future__ import annotations

from services.reconfigurator.core.plan import CapacityPlan, DivisionPlan, Objective
from services.reconfigurator.core.trigger import PlanState, ReconfigTrigger, improvement_decision


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def capacity(instances_by_tp: dict[int, int], threshold: float | None, slack: float = 0.5) -> CapacityPlan:
    objective = Objective(threshold, slack) if threshold is not None else None
    reason = None if threshold is not None else "too much load"
    return CapacityPlan(instances_by_tp, {}, (), objective, {}, fallback_reason=reason)


def test_quality_gain_above_margin_applies():
    decision = improvement_decision(capacity({1: 16}, 0.9), capacity({4: 4}, 0.7), margin=0.10)
    assert decision.apply and "average threshold" in decision.reason


def test_quality_gain_below_margin_does_not_apply():
    decision = improvement_decision(capacity({1: 16}, 0.75), capacity({4: 4}, 0.7), margin=0.10)
    assert not decision.apply and "below 10%" in decision.reason


def test_slack_gain_counts_only_at_equal_quality():
    better_slack = improvement_decision(capacity({4: 4}, 0.9, 0.9), capacity({1: 16}, 0.9, 0.5), margin=0.10)
    assert better_slack.apply and "SLO slack" in better_slack.reason
    small = improvement_decision(capacity({4: 4}, 0.9, 0.52), capacity({1: 16}, 0.9, 0.5), margin=0.10)
    assert not small.apply


def test_margin_is_configurable():
    candidate, current = capacity({1: 16}, 0.75), capacity({4: 4}, 0.7)
    assert improvement_decision(candidate, current, margin=0.05).apply
    assert not improvement_decision(candidate, current, margin=0.10).apply


def test_unservable_current_shape_or_empty_cluster_applies():
    assert improvement_decision(capacity({1: 16}, None), capacity({4: 4}, None), margin=0.1).apply
    assert improvement_decision(capacity({4: 4}, 0.9), None, margin=0.1).apply


def test_same_shape_never_applies():
    assert not improvement_decision(capacity({1: 16}, 0.9), capacity({1: 16, 4: 0}, 0.5), margin=0.1).apply


def test_plan_in_flight_is_not_superseded_until_acknowledged():
    clock = FakeClock()
    trigger = ReconfigTrigger(clock, margin=0.1, ack_timeout_s=60.0)
    good, current = capacity({1: 16}, 0.9), capacity({4: 4}, 0.5)
    assert trigger.consider("plan-1", good, current).apply
    clock.now = 30.0
    blocked = trigger.consider("plan-2", good, current)
    assert not blocked.apply and "plan-1" in blocked.reason
    assert not trigger.acknowledge("plan-2")
    assert trigger.acknowledge("plan-1")
    assert trigger.last_issued.state == PlanState.ACKNOWLEDGED
    assert trigger.consider("plan-3", good, current).apply
    assert trigger.in_flight().plan_id == "plan-3"


def test_plan_in_flight_times_out():
    clock = FakeClock()
    trigger = ReconfigTrigger(clock, ack_timeout_s=60.0)
    good, current = capacity({1: 16}, 0.9), capacity({4: 4}, 0.5)
    trigger.consider("plan-1", good, current)
    clock.now = 59.9
    assert trigger.in_flight() is not None
    clock.now = 60.0
    assert trigger.in_flight() is None
    assert trigger.last_issued.state == PlanState.TIMED_OUT
    assert not trigger.acknowledge("plan-1")
    assert trigger.consider("plan-2", good, current).apply


def test_rejected_candidate_does_not_block():
    clock = FakeClock()
    trigger = ReconfigTrigger(clock)
    assert not trigger.consider("plan-1", capacity({1: 16}, 0.71), capacity({4: 4}, 0.7)).apply
    assert trigger.in_flight() is None


def division(gpus_a: int, gpus_b: int, feasible: bool) -> DivisionPlan:
    plans = {"a": capacity({1: gpus_a}, 0.9 if feasible else None), "b": capacity({1: gpus_b}, 0.9 if feasible else None)}
    return DivisionPlan(plans, Objective(0.9, 0.5) if feasible else None, {}, fallback_reason=None if feasible else "x")


def test_between_two_overloaded_divisions_only_a_material_move_applies():
    # an instance or two from round to round: not worth their switch time
    small = improvement_decision(division(27, 5, False), division(26, 6, False), margin=0.10)
    assert not small.apply and "moves 3% of the GPUs" in small.reason
    # the mix flipped: most of the GPUs move
    flipped = improvement_decision(division(7, 25, False), division(26, 6, False), margin=0.10)
    assert flipped.apply
    # a division that serves the workload replaces one that does not, however little it moves
    served = improvement_decision(division(26, 6, True), division(27, 5, False), margin=0.10)
    assert served.apply
