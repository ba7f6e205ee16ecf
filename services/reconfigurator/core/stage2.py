"""Stage 2: the minimal-disruption placement, an ILP in Pyomo solved by HiGHS.

Nodes are interchangeable, so Stage 1 only fixes R[d], the number of instances per TP degree. A node
n with GPUs G_n (sorted) offers floor(|G_n| / d) aligned *slots* of degree d: slot k holds GPUs
G_n[k*d : (k+1)*d]. A running instance whose GPUs are not such a slot is a slot of its own, so that
it too can be kept.

Variables:   u[s] binary            slot s hosts an instance in the new plan
Constraints: sum_{s holds g} u[s] <= 1      for every GPU g (no GPU used twice)
             sum_{s of degree d} u[s] = R[d] for every degree d
Objective:   maximise sum_{s is a running instance} u[s]   (instances kept in place)

Every chosen slot that is a running instance is kept; every other chosen slot starts an instance;
every running instance not chosen is stopped.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pyomo.environ as pyo

from . import solver as highs
from .plan import NodePlan, PlacementPlan
from .spec import Cluster, Instance


class Stage2Infeasible(ValueError):
    """The requested instance counts cannot be placed on the cluster's GPUs."""


@dataclass(frozen=True)
class Stage2Options:
    solver: highs.SolverOptions = field(default_factory=lambda: highs.SolverOptions(mip_rel_gap=0.0))


def candidate_slots(cluster: Cluster) -> list[Instance]:
    """Aligned slots of every degree on every node, then running instances that are not aligned."""
    slots = [
        Instance(node.name, d, node.slot_gpu_ids(d, k))
        for node in cluster.nodes
        for d in cluster.tp_degrees
        for k in range(node.num_slots(d))
    ]
    aligned = set(slots)
    slots.extend(
        inst
        for inst in sorted(set(cluster.placement))
        if inst.tp in cluster.tp_degrees and inst not in aligned
    )
    return slots


def solve_stage2(
    instances_by_tp: dict[int, int], cluster: Cluster, options: Stage2Options | None = None
) -> PlacementPlan:
    """Place ``instances_by_tp`` (tp degree -> count) keeping as many running instances as possible."""
    options = options or Stage2Options()
    _check_degrees(instances_by_tp, cluster)
    slots = candidate_slots(cluster)
    running = set(cluster.placement)
    m = _build_model(slots, running, instances_by_tp, cluster)
    status = highs.run(highs.make_highs(options.solver), m)
    if status == highs.SolveStatus.INFEASIBLE:
        raise Stage2Infeasible(
            f"cannot place {_describe(instances_by_tp)} on {cluster.num_gpus} GPUs "
            f"in {len(cluster.nodes)} nodes with aligned slots"
        )
    if status == highs.SolveStatus.FAILED:
        raise RuntimeError("Stage 2: HiGHS found no placement within its time limit")
    chosen = {slots[i] for i in m.u if pyo.value(m.u[i]) > 0.5}
    return PlacementPlan(
        nodes=_node_plans(cluster, chosen, running), optimal=status == highs.SolveStatus.OPTIMAL
    )


def _check_degrees(instances_by_tp: dict[int, int], cluster: Cluster) -> None:
    for d, count in instances_by_tp.items():
        if count > 0 and d not in cluster.tp_degrees:
            raise Stage2Infeasible(f"TP degree {d} is not allowed on this cluster ({cluster.tp_degrees})")
        if count < 0:
            raise Stage2Infeasible(f"negative instance count for TP {d}")


def _build_model(
    slots: list[Instance], running: set[Instance], instances_by_tp: dict[int, int], cluster: Cluster
) -> pyo.ConcreteModel:
    m = pyo.ConcreteModel(name="stage2")
    m.u = pyo.Var(range(len(slots)), domain=pyo.Binary)
    gpu_to_slot_ids: dict[tuple[str, int], list[int]] = defaultdict(list)  # (node, gpu id) -> slot indices
    tp_to_slot_ids: dict[int, list[int]] = defaultdict(list)  # tp degree -> slot indices
    for i, slot in enumerate(slots):
        tp_to_slot_ids[slot.tp].append(i)
        for gpu in slot.gpu_ids:
            gpu_to_slot_ids[(slot.node, gpu)].append(i)
    shared_gpus = [g for g, ids in gpu_to_slot_ids.items() if len(ids) > 1]
    m.gpu_once = pyo.Constraint(
        shared_gpus, rule=lambda m, node, gpu: sum(m.u[i] for i in gpu_to_slot_ids[(node, gpu)]) <= 1
    )
    m.count = pyo.Constraint(
        list(cluster.tp_degrees),
        rule=lambda m, d: sum(m.u[i] for i in tp_to_slot_ids[d]) == instances_by_tp.get(d, 0),
    )
    kept = [i for i, slot in enumerate(slots) if slot in running]
    m.kept = pyo.Objective(expr=sum(m.u[i] for i in kept), sense=pyo.maximize)
    return m


def _node_plans(cluster: Cluster, chosen: set[Instance], running: set[Instance]) -> tuple[NodePlan, ...]:
    # node -> "keep" / "stop" / "start" -> instances
    node_to_lists: dict[str, dict[str, list[Instance]]] = defaultdict(lambda: defaultdict(list))
    for inst in running:
        node_to_lists[inst.node]["keep" if inst in chosen else "stop"].append(inst)
    for inst in chosen - running:
        node_to_lists[inst.node]["start"].append(inst)
    return tuple(
        NodePlan(
            node.name,
            keep=tuple(sorted(node_to_lists[node.name]["keep"])),
            stop=tuple(sorted(node_to_lists[node.name]["stop"])),
            start=tuple(sorted(node_to_lists[node.name]["start"])),
        )
        for node in cluster.nodes
    )


def _describe(instances_by_tp: dict[int, int]) -> str:
    return ", ".join(f"{n} x TP-{d}" for d, n in sorted(instances_by_tp.items()) if n) or "nothing"
