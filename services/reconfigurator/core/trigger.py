"""When to apply a new plan, and the lifecycle of an issued plan.

Rule (the paper's practical consideration): apply a Stage 1 proposal only when it beats the current
shape by ``margin`` (relative, default 10%) on the primary objective (average threshold), or ties it
and beats it by ``margin`` on the secondary one (SLO slack); always apply when the current shape
cannot serve the workload at all. A plan for a gain alone waits until the workload monitor has
watched its whole peak memory (``WorkloadMonitor.has_full_memory``): the first minutes of a bursty
workload read as a quiet one. An issued plan stays in flight, and no other plan is issued,
until the node agents acknowledge it or ``ack_timeout_s`` passes on the injected clock.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from .plan import CapacityPlan, DivisionPlan

Plan = CapacityPlan | DivisionPlan  # one model's Stage 1, or the division between several

_TIE_TOLERANCE = 1e-6  # average thresholds this close count as equal (solver tolerance)


class PlanState(enum.IntEnum):
    PENDING = 0  # issued, waiting for acknowledgement
    ACKNOWLEDGED = 1
    TIMED_OUT = 2


@dataclass(frozen=True)
class TriggerDecision:
    apply: bool
    reason: str

    def to_dict(self) -> dict:
        return {"apply": self.apply, "reason": self.reason}


@dataclass
class IssuedPlan:
    plan_id: str
    issued_at: float
    state: PlanState = PlanState.PENDING


def improvement_decision(
    candidate: Plan, current: Plan | None, margin: float, gains_wait: str | None = None
) -> TriggerDecision:
    """The margin rule alone: should ``candidate`` replace ``current`` (None: nothing running)? The
    same rule for one model's plan and for a division between models (its joint objective).

    ``gains_wait``: why a plan for a gain alone must wait (the monitor has not watched long enough to
    know the workload's bursts); a shape that cannot serve the workload is still replaced.
    """
    if current is None:
        return TriggerDecision(True, "nothing is running")
    if candidate.shape() == current.shape():
        return TriggerDecision(False, "the cluster already has this shape")
    if current.objective is None:
        if candidate.objective is None and isinstance(candidate, DivisionPlan):
            moved = _moved_share(candidate, current)
            if moved < margin:
                # in overload every round's fallback division differs by an instance or two: moving
                # them buys nothing and costs each one its switch time
                return TriggerDecision(False, f"neither division serves the workload, and the new one moves "
                                              f"{moved:.0%} of the GPUs (< {margin:.0%})")
        return TriggerDecision(True, current.fallback_reason or "the current shape cannot serve the workload")
    if candidate.objective is None:
        return TriggerDecision(False, "Stage 1 found no plan, but the current shape serves the workload")
    if gains_wait is not None:
        return TriggerDecision(False, f"the current shape serves the workload and {gains_wait}")
    new, old = candidate.objective, current.objective
    quality_gain = _relative_gain(new.avg_threshold, old.avg_threshold)
    if quality_gain >= margin:
        return TriggerDecision(
            True,
            f"average threshold {old.avg_threshold:.4f} -> {new.avg_threshold:.4f} "
            f"(+{quality_gain:.1%} >= {margin:.0%})",
        )
    slack_gain = _relative_gain(new.slo_slack, old.slo_slack)
    quality_kept = new.avg_threshold >= old.avg_threshold - _TIE_TOLERANCE
    if quality_kept and slack_gain >= margin:
        return TriggerDecision(
            True,
            f"SLO slack {old.slo_slack:.4f} -> {new.slo_slack:.4f} "
            f"(+{slack_gain:.1%} >= {margin:.0%}) at the same average threshold",
        )
    return TriggerDecision(
        False, f"gain below {margin:.0%}: average threshold {quality_gain:+.1%}, SLO slack {slack_gain:+.1%}"
    )


def _moved_share(candidate: DivisionPlan, current: DivisionPlan) -> float:
    """The share of the GPUs in use that a division moves from one model to another."""
    new, old = candidate.gpus_by_model, current.gpus_by_model
    moved = sum(abs(new.get(m, 0) - old.get(m, 0)) for m in set(new) | set(old)) / 2
    return moved / max(1, max(candidate.num_gpus_used, current.num_gpus_used))


def _relative_gain(new: float, old: float) -> float:
    if abs(new - old) <= _TIE_TOLERANCE:
        return 0.0
    return (new - old) / max(abs(old), _TIE_TOLERANCE)


class ReconfigTrigger:
    """Applies the margin rule and keeps at most one issued plan in flight."""

    def __init__(
        self, clock: Callable[[], float], margin: float = 0.10, ack_timeout_s: float = 300.0
    ) -> None:
        self._clock = clock
        self.margin = margin
        self.ack_timeout_s = ack_timeout_s
        self._last: IssuedPlan | None = None

    def in_flight(self) -> IssuedPlan | None:
        """The issued plan still waiting for its acknowledgement, if any (times it out when due)."""
        last = self._last
        if last is None or last.state != PlanState.PENDING:
            return None
        if self._clock() - last.issued_at >= self.ack_timeout_s:
            last.state = PlanState.TIMED_OUT
            return None
        return last

    def consider(
        self, plan_id: str, candidate: Plan, current: Plan | None, gains_wait: str | None = None
    ) -> TriggerDecision:
        """Decide on ``candidate``; when it is to be applied, it becomes the plan in flight."""
        pending = self.in_flight()
        if pending is not None:
            return TriggerDecision(False, f"plan {pending.plan_id} is still waiting for acknowledgement")
        decision = improvement_decision(candidate, current, self.margin, gains_wait)
        if decision.apply:
            self.issue(plan_id)
        return decision

    def issue(self, plan_id: str) -> None:
        """``plan_id`` is applied (by this rule or a policy's own): it is the plan in flight."""
        self._last = IssuedPlan(plan_id, issued_at=self._clock())

    def acknowledge(self, plan_id: str) -> bool:
        """Record the node agents' acknowledgement; False when ``plan_id`` is not the plan in flight."""
        pending = self.in_flight()
        if pending is None or pending.plan_id != plan_id:
            return False
        pending.state = PlanState.ACKNOWLEDGED
        return True

    @property
    def last_issued(self) -> IssuedPlan | None:
        return self._last
