"""The reconfigurator's outputs: the Stage 1 capacity plan, the Stage 2 placement, and the plan that
carries both under an id until the node agents acknowledge it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from .spec import Instance

_N = TypeVar("_N")  # a per-node plan (NodePlan here, or the wire's)


@dataclass(frozen=True)
class Objective:
    """Stage 1's lexicographic objective, both per output token (weights: planned rate x output)."""

    avg_threshold: float  # primary: average threshold
    slo_slack: float  # secondary: average (1 - predicted latency / SLO)

    def to_dict(self) -> dict:
        return {"avg_threshold": round(self.avg_threshold, 6), "slo_slack": round(self.slo_slack, 6)}


@dataclass(frozen=True)
class ClassAssignment:
    """A share of one class served at one (TP degree, batch, threshold)."""

    class_name: str
    tp: int
    batch: int
    threshold: float
    share: float  # fraction of the class's requests
    latency_s: float  # predicted latency of one request there
    slo_s: float

    def to_dict(self) -> dict:
        return {
            "class": self.class_name,
            "tp": self.tp,
            "batch": self.batch,
            "threshold": self.threshold,
            "share": round(self.share, 6),
            "latency_s": round(self.latency_s, 4),
            "slo_s": round(self.slo_s, 4),
        }


@dataclass(frozen=True)
class CapacityPlan:
    """Stage 1: how many instances of each TP degree, at which batch size, serving what."""

    instances_by_tp: dict[int, int]  # tp degree -> number of instances
    batch_by_tp: dict[int, int]  # tp degree -> batch size (degrees with instances only)
    assignments: tuple[ClassAssignment, ...]
    objective: Objective | None  # None: infeasible (fallback) plan
    utilization_by_tp: dict[int, float]  # tp degree -> offered work / processing rate
    fallback_reason: str | None = None  # set when Stage 1 was infeasible and this is all-TP-1
    optimal: bool = True  # False: a time limit stopped HiGHS before it proved optimality

    @property
    def feasible(self) -> bool:
        return self.fallback_reason is None

    @property
    def num_gpus_used(self) -> int:
        return sum(tp * count for tp, count in self.instances_by_tp.items())

    @property
    def avg_threshold(self) -> float | None:
        return self.objective.avg_threshold if self.objective else None

    def shape(self) -> dict:
        """What the trigger compares: tp degree -> instances, degrees with none left out."""
        return {tp: n for tp, n in self.instances_by_tp.items() if n}

    def to_dict(self) -> dict:
        return {
            "instances_by_tp": {str(tp): n for tp, n in sorted(self.instances_by_tp.items())},
            "batch_by_tp": {str(tp): b for tp, b in sorted(self.batch_by_tp.items())},
            "num_gpus_used": self.num_gpus_used,
            "objective": self.objective.to_dict() if self.objective else None,
            "utilization_by_tp": {str(tp): round(u, 4) for tp, u in sorted(self.utilization_by_tp.items())},
            "fallback_reason": self.fallback_reason,
            "optimal": self.optimal,
            "assignments": [a.to_dict() for a in self.assignments],
        }


@dataclass(frozen=True)
class DivisionPlan:
    """Stage 1 for several models: each model's capacity plan, the joint objective and the moves.

    ``objective`` is the joint one (per output token over every model's classes); each model's
    ``CapacityPlan.objective`` is its own average over its own tokens. ``started_by_model`` counts the
    instances Stage 1 starts beyond what runs now (model -> tp degree -> count) and ``switch_gpu_s``
    their cost, ``sum switch_s x tp x started`` GPU-seconds not serving."""

    plans_by_model: dict[str, CapacityPlan]  # model -> its plan
    objective: Objective | None  # None: infeasible (fallback) division
    started_by_model: dict[str, dict[int, int]]  # model -> tp degree -> instances started
    switch_gpu_s: float = 0.0
    fallback_reason: str | None = None
    optimal: bool = True

    @property
    def feasible(self) -> bool:
        return self.fallback_reason is None

    @property
    def instances_by_model_tp(self) -> dict[str, dict[int, int]]:
        # model -> tp degree -> instances
        return {name: dict(p.instances_by_tp) for name, p in self.plans_by_model.items()}

    def shape(self) -> dict:
        """What the trigger compares: (model, tp degree) -> instances, pairs with none left out."""
        return {(name, tp): n for name, by_tp in self.instances_by_model_tp.items() for tp, n in by_tp.items() if n}

    @property
    def gpus_by_model(self) -> dict[str, int]:
        return {name: p.num_gpus_used for name, p in self.plans_by_model.items()}

    @property
    def num_gpus_used(self) -> int:
        return sum(self.gpus_by_model.values())

    def to_dict(self) -> dict:
        return {
            "gpus_by_model": self.gpus_by_model,
            "num_gpus_used": self.num_gpus_used,
            "objective": self.objective.to_dict() if self.objective else None,
            "started_by_model": {
                name: {str(tp): n for tp, n in sorted(by_tp.items()) if n}
                for name, by_tp in self.started_by_model.items()
            },
            "switch_gpu_s": round(self.switch_gpu_s, 3),
            "fallback_reason": self.fallback_reason,
            "optimal": self.optimal,
            "models": {name: p.to_dict() for name, p in self.plans_by_model.items()},
        }


@dataclass(frozen=True)
class NodePlan:
    """What one node's agent does: keep these instances, stop these, then start these."""

    node: str
    keep: tuple[Instance, ...] = ()
    stop: tuple[Instance, ...] = ()
    start: tuple[Instance, ...] = ()

    def to_dict(self) -> dict:
        def slim(instances: tuple[Instance, ...]) -> list[dict]:
            return [{"tp": i.tp, "gpu_ids": list(i.gpu_ids)} for i in instances]

        return {
            "node": self.node,
            "keep": slim(self.keep),
            "stop": slim(self.stop),
            "start": slim(self.start),
        }


def rolling_waves(nodes: Sequence[_N]) -> tuple[tuple[_N, ...], ...]:
    """``PlacementPlan.waves`` for any per-node plans with ``node``, ``stop`` and ``start`` (the core's
    or the wire's): one changed node per wave, nodes that only start instances first."""
    changed = sorted((n for n in nodes if n.stop or n.start), key=lambda n: (bool(n.stop), n.node))
    return tuple((n,) for n in changed)


@dataclass(frozen=True)
class PlacementPlan:
    """Stage 2: per-node keep, stop and start lists."""

    nodes: tuple[NodePlan, ...]
    optimal: bool = True

    @property
    def num_kept(self) -> int:
        return sum(len(n.keep) for n in self.nodes)

    @property
    def num_stopped(self) -> int:
        return sum(len(n.stop) for n in self.nodes)

    @property
    def num_started(self) -> int:
        return sum(len(n.start) for n in self.nodes)

    def waves(self) -> tuple[tuple[NodePlan, ...], ...]:
        """A rolling order: one node's changes per wave, the next wave once the previous one's new
        instances are up, so that the cluster never drains more than one node's worth of capacity
        at a time (a shape switch at a burst's onset otherwise leaves nothing live while every
        changed node drains and loads its model). Nodes that only start instances go first; nodes
        without changes are in no wave."""
        return rolling_waves(self.nodes)

    def target_instances(self) -> list[Instance]:
        """Every instance running once the plan is applied."""
        return [inst for n in self.nodes for inst in (*n.keep, *n.start)]

    def to_dict(self) -> dict:
        return {
            "num_kept": self.num_kept,
            "num_stopped": self.num_stopped,
            "num_started": self.num_started,
            "optimal": self.optimal,
            "nodes": [n.to_dict() for n in self.nodes],
        }


@dataclass(frozen=True)
class ModelPlacement:
    """Stage 2 for several models: one ``PlacementPlan`` per model (its keep, stop and start lists).

    A slot that changes model appears in one model's ``stop`` and another's ``start``: the node agent
    stops every model's ``stop`` before it starts any ``start``."""

    by_model: dict[str, PlacementPlan]  # model -> its keep/stop/start per node
    optimal: bool = True

    @property
    def num_kept(self) -> int:
        return sum(p.num_kept for p in self.by_model.values())

    @property
    def num_stopped(self) -> int:
        return sum(p.num_stopped for p in self.by_model.values())

    @property
    def num_started(self) -> int:
        return sum(p.num_started for p in self.by_model.values())

    def target_instances_by_model(self) -> dict[str, list[Instance]]:
        # model -> every instance of it running once the plan is applied
        return {name: p.target_instances() for name, p in self.by_model.items()}

    def to_dict(self) -> dict:
        return {
            "num_kept": self.num_kept,
            "num_stopped": self.num_stopped,
            "num_started": self.num_started,
            "optimal": self.optimal,
            "models": {name: p.to_dict() for name, p in self.by_model.items()},
        }


@dataclass(frozen=True)
class ReconfigPlan:
    """One reconfiguration, identified by ``plan_id`` (acknowledgements name it)."""

    plan_id: str
    capacity: CapacityPlan
    placement: PlacementPlan

    @property
    def fallback_reason(self) -> str | None:
        return self.capacity.fallback_reason

    def to_dict(self) -> dict:
        return {
            "plan_id": self.plan_id,
            "capacity": self.capacity.to_dict(),
            "placement": self.placement.to_dict(),
        }
