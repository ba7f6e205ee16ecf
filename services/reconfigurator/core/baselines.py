"""What DiLaServe's division of GPUs between models is compared with: per-model planners sharing one
GPU budget, the pattern of Dynamo's planner, llm-d, AIBrix and KServe (one autoscaler per model's
deployment, each scaling by its own load, under a global GPU cap).

``SharedBudgetPlanners`` is driven like ``ModelsReconfigurator`` (``observe``, ``step(cluster,
running_models)``, ``acknowledge``). Every period each model asks for the GPUs its own load needs
(``_gpus_needed``: every class at its most GPU-efficient SLO-feasible option, at the utilisation
target), as instances of its deployment's degree (its smallest allowed); the cluster's slots are
handed out in proportion to what each asks (a model's minimum first), so no GPU idles. It knows
nothing of the other models' thresholds or of what a move costs: a division that differs from the
running one is applied.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import ClassVar

from .monitor import ArrivalEvent, MonitorSettings
from .plan import CapacityPlan, DivisionPlan
from .planner import ModelsOutcome, PlannerOptions
from .reconfigurator import ModelsReconfigurator, ModelsRound
from .spec import Cluster, Instance, ModelDemand
from .stage1 import _gpus_needed, precompute_model
from .stage2 import place_models
from .trigger import TriggerDecision


def share_slots(asks: Mapping[str, float], minimum: Mapping[str, int], slots: int) -> dict[str, int]:
    """``slots`` instances handed out: each model its ``minimum``, the rest in proportion to ``asks``
    (largest remainder; ties to the earlier name). A model that asks nothing gets its minimum."""
    counts = {name: minimum.get(name, 0) for name in asks}
    left = slots - sum(counts.values())
    total = sum(a for a in asks.values() if a > 0)
    if left <= 0 or total <= 0:
        return counts
    exact = {name: left * a / total for name, a in asks.items() if a > 0}
    for name, x in exact.items():
        counts[name] += math.floor(x)
    rest = left - sum(math.floor(x) for x in exact.values())
    for name in sorted(exact, key=lambda n: (math.floor(exact[n]) - exact[n], list(asks).index(n)))[:rest]:
        counts[name] += 1
    return counts


class SharedBudgetPlanners:
    """Per-model planners under one GPU budget (see the module's docstring)."""

    divides_models: ClassVar[bool] = True  # step() takes the model of every running instance

    def __init__(
        self,
        models: Sequence[ModelDemand],
        clock: Callable[[], float],
        monitor_settings: Mapping[str, MonitorSettings] | MonitorSettings | None = None,
        planner_options: PlannerOptions | None = None,
        ack_timeout_s: float = 300.0,
        plan_ids: Iterator[str] | None = None,
    ) -> None:
        # the monitors, the in-flight rule and plan ids are the joint reconfigurator's
        self._inner = ModelsReconfigurator(models, clock, monitor_settings, planner_options,
                                           ack_timeout_s=ack_timeout_s, plan_ids=plan_ids or
                                           (f"plan-{n}" for n in itertools.count(1)))
        self.models = self._inner.models
        self._options = self._inner.planner_options

    def observe(self, event: ArrivalEvent, model: str = "") -> None:
        self._inner.observe(event, model)

    def asks(self, cluster: Cluster) -> dict[str, float]:
        """GPUs each model's own planner asks for, from its own load alone."""
        out = {}
        for demand in self._inner.demands():
            if not demand.has_load:
                out[demand.name] = 0.0
                continue
            inputs = precompute_model(demand, cluster, self._options.stage1)
            out[demand.name] = _gpus_needed(inputs, self._options.stage1.max_utilization)
        return out

    def division(self, cluster: Cluster) -> dict[str, dict[int, int]]:
        """Model -> tp degree -> instances: each at its deployment's degree, slots shared by ask."""
        degree = {name: min(d for d in cluster.tp_degrees if m.tp_degrees is None or d in m.tp_degrees)
                  for name, m in self.models.items()}
        if len(set(degree.values())) != 1:
            raise ValueError(f"SharedBudgetPlanners shares slots of one degree; the models' are {degree}")
        d = next(iter(degree.values()))
        asks = {name: gpus / d for name, gpus in self.asks(cluster).items()}
        minimum = {name: m.min_instances for name, m in self.models.items()}
        counts = share_slots(asks, minimum, cluster.num_slots(d))
        return {name: {d: n} for name, n in counts.items()}

    def step(self, cluster: Cluster, running_models: Mapping[Instance, str]) -> ModelsRound:
        trigger = self._inner.trigger
        pending = trigger.in_flight()
        if pending is not None:
            return ModelsRound(
                TriggerDecision(False, f"plan {pending.plan_id} is still waiting for acknowledgement"), None)
        wanted = self.division(cluster)
        running: dict[str, dict[int, int]] = {name: {} for name in wanted}
        for inst in cluster.placement:
            by_tp = running.setdefault(running_models.get(inst, ""), {})
            by_tp[inst.tp] = by_tp.get(inst.tp, 0) + 1
        plan_id = next(self._inner.plan_ids)
        placement = place_models(wanted, cluster, running_models, self._options.stage2)
        plans = {name: CapacityPlan(dict(by_tp), {}, (), None, {}) for name, by_tp in wanted.items()}
        outcome = ModelsOutcome(plan_id, DivisionPlan(plans, None, {}), placement, None, {})
        same = all({t: n for t, n in wanted[name].items() if n} == {t: n for t, n in running.get(name, {}).items() if n}
                   for name in wanted)
        if same:
            return ModelsRound(TriggerDecision(False, "each model already has what its load asks"), outcome)
        trigger.issue(plan_id)
        shares = ", ".join(f"{name} {sum(by_tp.values())}" for name, by_tp in wanted.items())
        return ModelsRound(TriggerDecision(True, f"each model scaled by its own load: {shares}"), outcome)

    def acknowledge(self, plan_id: str) -> bool:
        return self._inner.acknowledge(plan_id)
