"""Stage 1 then Stage 2, and Stage 1 again on the running shape for the trigger rule: for one model
(``plan_reconfiguration``) or several sharing the cluster (``plan_models``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from shared.profiles import LatencyProfile

from .plan import CapacityPlan, DivisionPlan, ModelPlacement, ReconfigPlan
from .spec import Cluster, Instance, ModelDemand, Workload
from .stage1 import Stage1Options, divide_gpus, solve_stage1
from .stage2 import Stage2Options, place_models, solve_stage2


@dataclass(frozen=True)
class PlannerOptions:
    stage1: Stage1Options = field(default_factory=Stage1Options)
    stage2: Stage2Options = field(default_factory=Stage2Options)
    evaluate_current: bool = True  # also score the running shape (what the trigger compares with)


@dataclass(frozen=True)
class PlanOutcome:
    plan: ReconfigPlan
    current: CapacityPlan | None  # the running shape scored by Stage 1; None: nothing running
    solve_s: dict[str, float]  # "stage1", "stage2", "current" -> seconds

    def to_dict(self) -> dict:
        return {
            "plan": self.plan.to_dict(),
            "current": self.current.to_dict() if self.current else None,
            "solve_s": {k: round(v, 4) for k, v in self.solve_s.items()},
        }


def plan_reconfiguration(
    workload: Workload,
    cluster: Cluster,
    profile: LatencyProfile,
    plan_id: str,
    options: PlannerOptions | None = None,
    timer: Callable[[], float] = time.perf_counter,
) -> PlanOutcome:
    """Solve both stages for ``workload`` on ``cluster``. ``timer`` only measures solve times."""
    options = options or PlannerOptions()
    started = timer()
    capacity = solve_stage1(workload, cluster, profile, options.stage1)
    stage1_done = timer()
    placement = solve_stage2(capacity.instances_by_tp, cluster, options.stage2)
    stage2_done = timer()
    current = None
    if options.evaluate_current and cluster.placement:
        current = solve_stage1(
            workload,
            cluster,
            profile,
            options.stage1,
            fixed_instances_by_tp=cluster.current_instances_by_tp(),
        )
    current_done = timer()
    solve_s = {
        "stage1": stage1_done - started,
        "stage2": stage2_done - stage1_done,
        "current": current_done - stage2_done,
    }
    return PlanOutcome(ReconfigPlan(plan_id, capacity, placement), current, solve_s)


@dataclass(frozen=True)
class ModelsOutcome:
    """``plan_models``' result: the division of GPUs, its placement, and the running division scored."""

    plan_id: str
    division: DivisionPlan
    placement: ModelPlacement
    current: DivisionPlan | None  # the running instances per model scored by Stage 1; None: nothing running
    solve_s: dict[str, float]  # "stage1", "stage2", "current" -> seconds

    def to_dict(self) -> dict:
        return {
            "plan_id": self.plan_id,
            "division": self.division.to_dict(),
            "placement": self.placement.to_dict(),
            "current": self.current.to_dict() if self.current else None,
            "solve_s": {k: round(v, 4) for k, v in self.solve_s.items()},
        }


def plan_models(
    models: Sequence[ModelDemand],
    cluster: Cluster,
    running_models: Mapping[Instance, str],
    plan_id: str,
    options: PlannerOptions | None = None,
    timer: Callable[[], float] = time.perf_counter,
) -> ModelsOutcome:
    """Both stages for several models sharing ``cluster`` (``running_models``: the model of every
    running instance). ``timer`` only measures solve times."""
    options = options or PlannerOptions()
    started = timer()
    division = divide_gpus(models, cluster, options.stage1, running_models=running_models)
    stage1_done = timer()
    placement = place_models(division.instances_by_model_tp, cluster, running_models, options.stage2)
    stage2_done = timer()
    current = None
    if options.evaluate_current and cluster.placement:
        running: dict[str, dict[int, int]] = {m.name: {} for m in models}  # model -> tp -> instances
        for inst in cluster.placement:
            by_tp = running.setdefault(running_models[inst], {})
            by_tp[inst.tp] = by_tp.get(inst.tp, 0) + 1
        current = divide_gpus(models, cluster, options.stage1, running, running_models)
    current_done = timer()
    solve_s = {
        "stage1": stage1_done - started,
        "stage2": stage2_done - stage1_done,
        "current": current_done - stage2_done,
    }
    return ModelsOutcome(plan_id, division, placement, current, solve_s)
