"""The reconfigurator policy that a service loop (or the simulator) drives.

Two calls, like the scheduler's: ``observe(event)`` for every arrival, ``step(cluster)`` every
period (the paper: every few minutes) which returns the decision and, when applied, the plan to
publish; ``acknowledge(plan_id)`` when the node agents confirm. No I/O; the clock is injected.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from shared.profiles import LatencyProfile

from .monitor import ArrivalEvent, MonitorSettings, WorkloadMonitor
from .plan import ReconfigPlan
from .planner import PlannerOptions, PlanOutcome, plan_reconfiguration
from .spec import Cluster
from .trigger import ReconfigTrigger, TriggerDecision


@dataclass(frozen=True)
class PlanningRound:
    """What one planning round (``Reconfigurator.step``) decided: whether to apply, and the plan."""

    decision: TriggerDecision
    outcome: PlanOutcome | None  # None: nothing was solved (a plan is still in flight)

    @property
    def plan_to_apply(self) -> ReconfigPlan | None:
        return self.outcome.plan if self.decision.apply and self.outcome else None


class Reconfigurator:
    def __init__(
        self,
        profile: LatencyProfile,
        clock: Callable[[], float],
        monitor_settings: MonitorSettings | None = None,
        planner_options: PlannerOptions | None = None,
        margin: float = 0.10,
        ack_timeout_s: float = 300.0,
        plan_ids: Iterator[str] | None = None,
    ) -> None:
        self._profile = profile
        self._monitor = WorkloadMonitor(clock, monitor_settings)
        self._trigger = ReconfigTrigger(clock, margin=margin, ack_timeout_s=ack_timeout_s)
        self._planner_options = planner_options or PlannerOptions()
        self._plan_ids = plan_ids or (f"plan-{n}" for n in itertools.count(1))

    def observe(self, event: ArrivalEvent) -> None:
        self._monitor.observe(event)

    def step(self, cluster: Cluster) -> PlanningRound:
        """Plan for the current workload on ``cluster`` (running placement included) and decide."""
        pending = self._trigger.in_flight()
        if pending is not None:
            return PlanningRound(
                TriggerDecision(False, f"plan {pending.plan_id} is still waiting for acknowledgement"), None
            )
        workload = self._monitor.snapshot()
        outcome = plan_reconfiguration(
            workload, cluster, self._profile, next(self._plan_ids), self._planner_options
        )
        monitor = self._monitor
        gains_wait = None if monitor.has_full_memory() else (
            f"arrivals have been watched for {monitor.observed_s():.0f} s, less than the "
            f"{monitor.memory_s:.0f} s whose peak rates plans are made for")
        decision = self._trigger.consider(outcome.plan.plan_id, outcome.plan.capacity, outcome.current, gains_wait)
        return PlanningRound(decision, outcome)

    def acknowledge(self, plan_id: str) -> bool:
        return self._trigger.acknowledge(plan_id)
