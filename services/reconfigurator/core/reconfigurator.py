"""The reconfigurator policies that a service loop (or the simulator) drives.

Two calls, like the scheduler's: ``observe(event, model)`` for every arrival, ``step(cluster)``
every period (the paper: every few minutes) which returns the decision and, when applied, the plan
to publish; ``acknowledge(plan_id)`` when the node agents confirm. No I/O; the clock is injected.

- ``Reconfigurator``: one model, the paper's two stages (``plan_reconfiguration``).
- ``ModelsReconfigurator``: several models sharing the cluster, one workload monitor each, the
  GPUs divided between them in one ILP that weighs each move's switch time (``plan_models``);
  ``step(cluster, running_models)`` also takes the model of every running instance.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from shared.profiles import LatencyProfile

from .hedge import DEFAULT_MAX_SHARE, Hedge, hedge_demands
from .monitor import ArrivalEvent, MonitorSettings, WorkloadMonitor
from .plan import ReconfigPlan
from .planner import ModelsOutcome, PlannerOptions, PlanOutcome, plan_models, plan_reconfiguration
from .spec import Cluster, Instance, ModelDemand
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

    def observe(self, event: ArrivalEvent, model: str = "") -> None:
        """One arrival (``model`` is ignored: every request is of the one model)."""
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
        gains_wait = gains_wait_reason([self._monitor])
        decision = self._trigger.consider(outcome.plan.plan_id, outcome.plan.capacity, outcome.current, gains_wait)
        return PlanningRound(decision, outcome)

    def acknowledge(self, plan_id: str) -> bool:
        return self._trigger.acknowledge(plan_id)


@dataclass(frozen=True)
class ModelsRound:
    """What one planning round of several models decided: whether to apply, and the division."""

    decision: TriggerDecision
    outcome: ModelsOutcome | None  # None: nothing was solved (a plan is still in flight)

    @property
    def plan_to_apply(self) -> ModelsOutcome | None:
        return self.outcome if self.decision.apply and self.outcome else None


def gains_wait_reason(monitors: Sequence[WorkloadMonitor]) -> str | None:
    """Why a plan for a gain alone must wait: a monitor that has not watched its whole peak memory."""
    young = [m for m in monitors if not m.has_full_memory()]
    if not young:
        return None
    m = young[0]
    return (f"arrivals have been watched for {m.observed_s():.0f} s, less than the {m.memory_s:.0f} s whose "
            "peak rates plans are made for")


class ModelsReconfigurator:
    """Divides the cluster's GPUs between ``models`` every period (``plan_models``) and applies a
    division under the single-model trigger rule on the joint objective.

    ``models``: one ``ModelDemand`` per served model, its workload left empty (each round fills it
    from that model's monitor); ``monitor_settings``: per model name (each model's block length and
    SLO), or one for all; ``hedge_share``: each loaded model is planned for at least this share of all
    the arrivals while the GPUs allow (``hedge.hedge_demands``; 0: its own load alone)."""

    divides_models: ClassVar[bool] = True  # step() takes the model of every running instance

    def __init__(
        self,
        models: Sequence[ModelDemand],
        clock: Callable[[], float],
        monitor_settings: Mapping[str, MonitorSettings] | MonitorSettings | None = None,
        planner_options: PlannerOptions | None = None,
        margin: float = 0.10,
        ack_timeout_s: float = 300.0,
        plan_ids: Iterator[str] | None = None,
        hedge_share: float = DEFAULT_MAX_SHARE,
    ) -> None:
        if not models:
            raise ValueError("ModelsReconfigurator needs at least one model")
        self.models = {m.name: m for m in models}
        if len(self.models) != len(models):
            raise ValueError(f"two models share a name: {[m.name for m in models]}")

        def settings_of(name: str) -> MonitorSettings | None:
            if isinstance(monitor_settings, Mapping):
                return monitor_settings[name]
            return monitor_settings

        self._monitors = {name: WorkloadMonitor(clock, settings_of(name)) for name in self.models}
        self.trigger = ReconfigTrigger(clock, margin=margin, ack_timeout_s=ack_timeout_s)
        self.planner_options = planner_options or PlannerOptions()
        self.plan_ids = plan_ids or (f"plan-{n}" for n in itertools.count(1))
        self.hedge_share = hedge_share  # the most of the cluster's arrivals each model is planned for (0: none)
        self.last_hedge: Hedge | None = None  # the last round's

    def observe(self, event: ArrivalEvent, model: str = "") -> None:
        """One arrival of ``model`` ("" or a model not served: the first model's)."""
        monitor = self._monitors.get(model) or next(iter(self._monitors.values()))
        monitor.observe(event)

    def demands(self) -> list[ModelDemand]:
        """Every model with its monitor's workload now."""
        return [dataclasses.replace(m, workload=self._monitors[name].snapshot()) for name, m in self.models.items()]

    def step(self, cluster: Cluster, running_models: Mapping[Instance, str]) -> ModelsRound:
        """Plan the division for the current workloads on ``cluster`` (``running_models``: the model
        of each running instance) and decide."""
        pending = self.trigger.in_flight()
        if pending is not None:
            return ModelsRound(
                TriggerDecision(False, f"plan {pending.plan_id} is still waiting for acknowledgement"), None)
        demands = self.demands()
        if cluster.placement and not any(d.has_load for d in demands):
            # arrivals paused (or ended) while requests may still be queued: no plan shrinks what serves them
            return ModelsRound(TriggerDecision(False, "no model has arrivals in the window: the cluster keeps its "
                                                      "shape"), None)
        hedged, self.last_hedge = hedge_demands(demands, cluster, self.planner_options.stage1, self.hedge_share)
        outcome = plan_models(hedged, cluster, running_models, next(self.plan_ids), self.planner_options)
        decision = self.trigger.consider(outcome.plan_id, outcome.division, outcome.current,
                                          gains_wait_reason(list(self._monitors.values())))
        return ModelsRound(self._cold_start(decision, outcome, self._unserved(demands, running_models)), outcome)

    def models_to_start(self, running_models: Mapping[Instance, str]) -> list[str]:
        """Models with arrivals in the window and no running instance (``running_models``: the model of
        each): scaled to zero (or their instances lost), their requests wait for a division that starts
        one, so a service plans at once rather than at its next period."""
        return self._unserved(self.demands(), running_models)

    @staticmethod
    def _unserved(demands: Sequence[ModelDemand], running_models: Mapping[Instance, str]) -> list[str]:
        running = set(running_models.values())
        return [d.name for d in demands if d.has_load and d.name not in running]

    def _cold_start(self, decision: TriggerDecision, outcome: ModelsOutcome, unserved: list[str]) -> TriggerDecision:
        """``decision``, unless it keeps the shape while the division starts a model that has arrivals and
        no instance: that one is applied whatever the margin rule says (in overload, a division differing
        by an instance or two is otherwise kept out), since the model's requests wait for it."""
        by_model = outcome.division.instances_by_model_tp
        started = [m for m in unserved if sum(by_model.get(m, {}).values()) > 0]
        if decision.apply or not started:
            return decision
        self.trigger.issue(outcome.plan_id)
        return TriggerDecision(True, f"{', '.join(started)}: arrivals and no instance, and the division starts one "
                                     f"(a cold start, applied although {decision.reason})")

    def acknowledge(self, plan_id: str) -> bool:
        return self.trigger.acknowledge(plan_id)
