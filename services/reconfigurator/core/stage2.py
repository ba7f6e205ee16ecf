"""Stage 2: the minimal-disruption placement, an ILP in Pyomo solved by HiGHS, for one model or several.

Stage 1 fixes R[m,d], the number of instances of model m at TP degree d. A node n with GPUs G_n
(sorted) offers floor(|G_n| / d) aligned *slots* of degree d: slot k holds GPUs G_n[k*d : (k+1)*d]. A
running instance whose GPUs are not such a slot is a slot of its own, so that it too can be kept. With
degrees that divide each other the aligned slots nest (any two are disjoint or one holds the other).

The ILP is built over node *types*, not over slots: nodes with the same GPUs and the same running
instances (degree, GPUs, model) are interchangeable, so what matters is how many nodes of a type take
each *node option*: a set of disjoint slots, summarised by its instances per degree v[d] and, per model
and degree, how many of them are running instances of that model kc[m,d] (the ones it can keep). The
options of a type are found by a dynamic programme over the nested slots (each slot: itself, or the
options of the slots inside it combined), then over the subsets of its unaligned running instances.
A 4-GPU node with TP 1, 2, 4 and nothing running has 10 options; an 8,192-GPU cluster a few types.

Variables:   n[t,o] integer in [0, N_t]   nodes of type t that take option o (N_t: nodes of type t)
             l[t,o,m,d] integer           of those nodes' degree-d slots, how many serve model m
             k[t,o,m,d] >= 0              how many of those are kept (running instances of m there)
Constraints: sum_o n[t,o] = N_t                     every node takes one option (the empty one too)
             sum_m l[t,o,m,d] = v_o[d] n[t,o]       every chosen slot serves one model
             k[t,o,m,d] <= l[t,o,m,d], k[t,o,m,d] <= kc_o[m,d] n[t,o]
             sum_{t,o} l[t,o,m,d] = R[m,d]          the instances Stage 1 asked for
Objective:   maximise sum k                         instances kept in place

With one model l = v n and k = kc n, so only n remains. The aggregation is exact: a model's keepable
slots of one type are spread over its nodes greedily (each node keeps what the labels allow), the other
labels fill the free slots; which of the interchangeable nodes get which option is canonical (the
type's nodes in cluster order, options in the order found). Every chosen slot that is a running
instance of the same model is kept; every other chosen slot starts an instance; every running instance
not kept is stopped.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import pyomo.environ as pyo

from . import solver as highs
from .plan import ModelPlacement, NodePlan, PlacementPlan
from .spec import SINGLE_MODEL, Cluster, Instance, Node


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
    running_models = {inst: SINGLE_MODEL for inst in cluster.placement}
    placed = place_models({SINGLE_MODEL: instances_by_tp}, cluster, running_models, options)
    return placed.by_model[SINGLE_MODEL]


def place_models(
    instances_by_model_tp: Mapping[str, Mapping[int, int]],
    cluster: Cluster,
    running_models: Mapping[Instance, str],
    options: Stage2Options | None = None,
) -> ModelPlacement:
    """Place every model's instances (model -> tp degree -> count) on ``cluster``, keeping as many
    running instances as possible; ``running_models`` names the model of every instance in
    ``cluster.placement``. An instance keeps its model: a slot that changes model is a stop and a start."""
    options = options or Stage2Options()
    for counts in instances_by_model_tp.values():
        _check_degrees(counts, cluster)
    unnamed = [inst for inst in cluster.placement if inst not in running_models]
    if unnamed:
        raise ValueError(f"running instances without a model: {unnamed[:3]}")
    models = list(instances_by_model_tp)
    models += sorted({running_models[i] for i in cluster.placement} - set(models))
    layout = _Layout(cluster, models, running_models)
    wanted = {
        (mi, di): instances_by_model_tp.get(name, {}).get(d, 0)
        for mi, name in enumerate(models)
        for di, d in enumerate(layout.degrees)
    }
    m = _build_model(layout, wanted)
    if m.count_terms_missing:
        status = highs.SolveStatus.INFEASIBLE
    elif not any(True for _ in m.component_data_objects(pyo.Var)):
        status = highs.SolveStatus.OPTIMAL  # nothing wanted, no slot to choose
    else:
        status = highs.run(highs.make_highs(options.solver), m)
    if status == highs.SolveStatus.INFEASIBLE:
        total = defaultdict(int)  # tp degree -> instances of every model
        for counts in instances_by_model_tp.values():
            for d, n in counts.items():
                total[d] += n
        raise Stage2Infeasible(
            f"cannot place {_describe(total)} on {cluster.num_gpus} GPUs "
            f"in {len(cluster.nodes)} nodes with aligned slots"
        )
    if status == highs.SolveStatus.FAILED:
        raise RuntimeError("Stage 2: HiGHS found no placement within its time limit")
    optimal = status == highs.SolveStatus.OPTIMAL
    node_plans = _node_plans(cluster, _expand(m, layout), running_models, models)
    return ModelPlacement({name: PlacementPlan(plans, optimal) for name, plans in node_plans.items()}, optimal)


def _check_degrees(instances_by_tp: Mapping[int, int], cluster: Cluster) -> None:
    for d, count in instances_by_tp.items():
        if count > 0 and d not in cluster.tp_degrees:
            raise Stage2Infeasible(f"TP degree {d} is not allowed on this cluster ({cluster.tp_degrees})")
        if count < 0:
            raise Stage2Infeasible(f"negative instance count for TP {d}")


# --- node types and their options ------------------------------------------------------------------


@dataclass(frozen=True)
class _Slot:
    tp: int
    gpu_ids: tuple[int, ...]
    model: int  # the model index of the instance running on exactly these GPUs (-1: none)


@dataclass(frozen=True)
class _NodeOption:
    v: tuple[int, ...]  # degree index -> slots chosen
    kc: tuple[int, ...]  # model index * num_degrees + degree index -> running instances among them
    slots: tuple[_Slot, ...]  # one set of slots with these counts


class _Layout:
    """The cluster's nodes grouped into types, with every type's node options."""

    def __init__(self, cluster: Cluster, models: list[str], running_models: Mapping[Instance, str]):
        self.degrees = tuple(cluster.tp_degrees)
        self.num_models = len(models)
        model_index = {name: i for i, name in enumerate(models)}
        running_by_node: dict[str, list[Instance]] = defaultdict(list)  # node -> its running instances
        for inst in cluster.placement:
            if inst.tp in self.degrees:
                running_by_node[inst.node].append(inst)
        # type signature -> node indices of that type, in cluster order
        self.nodes_by_type: dict[tuple, list[int]] = defaultdict(list)
        self.options_by_type: dict[tuple, list[_NodeOption]] = {}
        self.nodes = cluster.nodes
        # node index -> GPUs -> the instance running on exactly those
        self.running_at: list[dict[tuple[int, ...], Instance]] = []
        for i, node in enumerate(cluster.nodes):
            running = {inst.gpu_ids: inst for inst in running_by_node.get(node.name, [])}
            self.running_at.append(running)
            signature = (
                node.gpu_ids,
                tuple(sorted((inst.tp, inst.gpu_ids, model_index[running_models[inst]]) for inst in running.values())),
            )
            self.nodes_by_type[signature].append(i)
        # a node alone in its type gets a variable per slot and model (fewer than its options); the
        # types of several nodes get the aggregated variables
        self.single_nodes = [ids[0] for ids in self.nodes_by_type.values() if len(ids) == 1]
        self.nodes_by_type = {sig: ids for sig, ids in self.nodes_by_type.items() if len(ids) > 1}
        for signature, ids in self.nodes_by_type.items():
            self.options_by_type[signature] = self._options(cluster.nodes[ids[0]], signature[1])
        self.model_index = model_index
        self.running_models = running_models

    def node_slots(self, i: int) -> list[_Slot]:
        """Node i's aligned slots, then its running instances that are not aligned."""
        node = self.nodes[i]
        running = self.running_at[i]

        def model_at(tp: int, gpus: tuple[int, ...]) -> int:
            inst = running.get(gpus)
            return self.model_index[self.running_models[inst]] if inst is not None and inst.tp == tp else -1

        slots = [
            _Slot(d, node.slot_gpu_ids(d, k), model_at(d, node.slot_gpu_ids(d, k)))
            for d in self.degrees
            for k in range(node.num_slots(d))
        ]
        aligned = {slot.gpu_ids for slot in slots}
        slots += [_Slot(inst.tp, gpus, model_at(inst.tp, gpus)) for gpus, inst in sorted(running.items())
                  if gpus not in aligned]
        return slots

    def _zero(self) -> _NodeOption:
        return _NodeOption((0,) * len(self.degrees), (0,) * (len(self.degrees) * self.num_models), ())

    def _single(self, slot: _Slot) -> _NodeOption:
        di = self.degrees.index(slot.tp)
        v = tuple(1 if j == di else 0 for j in range(len(self.degrees)))
        kc = [0] * (len(self.degrees) * self.num_models)
        if slot.model >= 0:
            kc[slot.model * len(self.degrees) + di] = 1
        return _NodeOption(v, tuple(kc), (slot,))

    def _options(self, node: Node, running: tuple[tuple[int, tuple[int, ...], int], ...]) -> list[_NodeOption]:
        slot_model = {gpus: (tp, mi) for tp, gpus, mi in running}  # GPUs -> (degree, model) running there
        aligned = {
            node.slot_gpu_ids(d, k) for d in self.degrees for k in range(node.num_slots(d))
        }
        unaligned = [(tp, gpus, mi) for tp, gpus, mi in running if gpus not in aligned]
        found: list[_NodeOption] = []
        for size in range(len(unaligned) + 1):
            for subset in itertools.combinations(unaligned, size):
                blocked = [g for _, gpus, _ in subset for g in gpus]
                if len(blocked) != len(set(blocked)):
                    continue  # they overlap: not a valid choice
                combined = [self._root_options(node, set(blocked), slot_model)]
                combined += [[self._single(_Slot(tp, gpus, mi))] for tp, gpus, mi in subset]
                found.extend(_minkowski_all(combined))
        return _dedupe(found)

    def _root_options(self, node: Node, blocked: set[int], slot_model: dict) -> list[_NodeOption]:
        """The options over the node's aligned slots, none of them on a ``blocked`` GPU."""
        degrees = [d for d in self.degrees if node.num_slots(d) > 0]
        if not degrees:
            return [self._zero()]

        def options(level: int, start: int) -> list[_NodeOption]:
            d = degrees[level]
            if level == 0:
                inside = [self._zero()]
            else:
                step = degrees[level - 1]
                inside = _minkowski_all([options(level - 1, s) for s in range(start, start + d, step)])
            gpus = node.gpu_ids[start : start + d]
            if not blocked.intersection(gpus):
                tp_model = slot_model.get(gpus)
                model = tp_model[1] if tp_model is not None and tp_model[0] == d else -1
                inside = [*inside, self._single(_Slot(d, gpus, model))]
            return _dedupe(inside)

        roots = []  # (level, start) of slots that no larger slot holds
        covered = 0
        for level in range(len(degrees) - 1, -1, -1):
            d = degrees[level]
            for k in range(covered // d, node.num_slots(d)):
                roots.append((level, k * d))
            covered = max(covered, node.num_slots(d) * d)
        return _minkowski_all([options(level, start) for level, start in roots])


def _dedupe(options: list[_NodeOption]) -> list[_NodeOption]:
    """One option per (v, kc), and none whose kc another with the same v bounds from above: it keeps
    no more running instances of any model, so it is never needed (and sums keep the order)."""
    by_v: dict[tuple[int, ...], dict[tuple[int, ...], _NodeOption]] = defaultdict(dict)  # v -> kc -> option
    for option in options:
        by_v[option.v].setdefault(option.kc, option)
    kept = []
    for by_kc in by_v.values():
        for kc, option in by_kc.items():
            if not any(other != kc and all(a <= b for a, b in zip(kc, other, strict=True)) for other in by_kc):
                kept.append(option)
    return kept


def _minkowski_all(groups: list[list[_NodeOption]]) -> list[_NodeOption]:
    """Every way of taking one option from each group (slots on disjoint GPUs), deduplicated."""
    result = groups[0]
    for group in groups[1:]:
        result = _dedupe([
            _NodeOption(
                tuple(x + y for x, y in zip(a.v, b.v, strict=True)),
                tuple(x + y for x, y in zip(a.kc, b.kc, strict=True)),
                a.slots + b.slots,
            )
            for a in result
            for b in group
        ])
    return result


# --- the ILP -----------------------------------------------------------------------------------


def _build_model(layout: _Layout, wanted: dict[tuple[int, int], int]) -> pyo.ConcreteModel:
    m = pyo.ConcreteModel(name="stage2")
    count_terms: dict[tuple[int, int], list] = defaultdict(list)  # (model, degree index) -> terms
    kept_terms: list = []
    _add_type_variables(m, layout, wanted, count_terms, kept_terms)
    _add_slot_variables(m, layout, wanted, count_terms, kept_terms)
    m.count_terms_missing = any(n > 0 and not count_terms[key] for key, n in wanted.items())
    m.count = pyo.Constraint(
        [key for key in wanted if count_terms[key]],
        rule=lambda m, mi, di: sum(count_terms[(mi, di)]) == wanted[(mi, di)],
    )
    m.kept = pyo.Objective(expr=sum(kept_terms) if kept_terms else 0.0, sense=pyo.maximize)
    return m


def _add_slot_variables(
    m: pyo.ConcreteModel, layout: _Layout, wanted: dict[tuple[int, int], int], count_terms: dict, kept_terms: list
) -> None:
    """u[i,s,mi] binary: slot s of node i (alone in its type) serves model mi; a GPU in one chosen
    slot at most. Only (slot, model) pairs whose model wants that degree get a variable."""
    m.slots = {i: layout.node_slots(i) for i in layout.single_nodes}  # node index -> its slots
    keys = [
        (i, si, mi)
        for i, slots in m.slots.items()
        for si, slot in enumerate(slots)
        for mi in range(layout.num_models)
        if wanted.get((mi, layout.degrees.index(slot.tp)), 0) > 0
    ]
    m.u = pyo.Var(keys, domain=pyo.Binary)
    gpu_to_keys: dict[tuple[int, int], list] = defaultdict(list)  # (node index, gpu) -> u keys on it
    for key in keys:
        i, si, mi = key
        slot = m.slots[i][si]
        for gpu in slot.gpu_ids:
            gpu_to_keys[(i, gpu)].append(key)
        count_terms[(mi, layout.degrees.index(slot.tp))].append(m.u[key])
        if slot.model == mi:
            kept_terms.append(m.u[key])
    shared = [g for g, ks in gpu_to_keys.items() if len(ks) > 1]
    m.gpu_once = pyo.Constraint(shared, rule=lambda m, i, g: sum(m.u[key] for key in gpu_to_keys[(i, g)]) <= 1)


def _add_type_variables(
    m: pyo.ConcreteModel, layout: _Layout, wanted: dict[tuple[int, int], int], count_terms: dict, kept_terms: list
) -> None:
    """n[t,o], l[t,o,mi,di] and k[t,o,mi,di] for the types of several nodes (module docstring)."""
    types = list(layout.options_by_type)
    num_degrees, num_models = len(layout.degrees), layout.num_models
    m.pairs = [(t, o) for t, sig in enumerate(types) for o in range(len(layout.options_by_type[sig]))]
    option = {(t, o): layout.options_by_type[types[t]][o] for t, o in m.pairs}  # (type, option) -> option
    count = {t: len(layout.nodes_by_type[sig]) for t, sig in enumerate(types)}  # type -> nodes
    m.types = types
    m.n = pyo.Var(m.pairs, domain=pyo.NonNegativeIntegers, bounds=lambda _, t, o: (0, count[t]))
    options_of: dict[int, list] = defaultdict(list)  # type -> its (type, option) pairs
    for pair in m.pairs:
        options_of[pair[0]].append(pair)
    m.one_option = pyo.Constraint(list(count), rule=lambda m, t: sum(m.n[p] for p in options_of[t]) == count[t])
    if num_models == 1:
        for p in m.pairs:
            for di in range(num_degrees):
                if option[p].v[di]:
                    count_terms[(0, di)].append(option[p].v[di] * m.n[p])
            if sum(option[p].kc):
                kept_terms.append(sum(option[p].kc) * m.n[p])
        return
    labels = [(t, o, mi, di) for t, o in m.pairs for di in range(num_degrees) if option[(t, o)].v[di]
              for mi in range(num_models) if wanted.get((mi, di), 0) > 0]
    keepable = [(t, o, mi, di) for t, o, mi, di in labels if option[(t, o)].kc[mi * num_degrees + di]]
    m.l = pyo.Var(labels, domain=pyo.NonNegativeIntegers)
    m.k = pyo.Var(keepable, domain=pyo.NonNegativeReals)
    by_slot_kind: dict[tuple[int, int, int], list] = defaultdict(list)  # (type, option, degree) -> labels
    for key in labels:
        t, o, mi, di = key
        by_slot_kind[(t, o, di)].append(key)
        count_terms[(mi, di)].append(m.l[key])
    slot_kinds = [(t, o, di) for t, o in m.pairs for di in range(num_degrees) if option[(t, o)].v[di]]
    m.labelled = pyo.Constraint(
        slot_kinds,
        rule=lambda m, t, o, di: sum(m.l[key] for key in by_slot_kind[(t, o, di)]) == option[(t, o)].v[di] * m.n[t, o],
    )
    m.kept_labelled = pyo.Constraint(keepable, rule=lambda m, *key: m.k[key] <= m.l[key])
    m.kept_running = pyo.Constraint(
        keepable,
        rule=lambda m, t, o, mi, di: m.k[t, o, mi, di] <= option[(t, o)].kc[mi * num_degrees + di] * m.n[t, o],
    )
    kept_terms.extend(m.k[key] for key in keepable)


# --- from the solution to instances ----------------------------------------------------------------


def _expand(m: pyo.ConcreteModel, layout: _Layout) -> dict[int, list[tuple[Instance, int]]]:
    """node index -> chosen (instance, model index): each type's nodes in order take the chosen
    options, then every slot gets a model (its running model first, while that model's labels last);
    a node alone in its type takes the slots its variables chose."""
    num_degrees = len(layout.degrees)
    chosen: dict[int, list[tuple[Instance, int]]] = defaultdict(list)
    for t, sig in enumerate(m.types):
        nodes = iter(layout.nodes_by_type[sig])
        for o, option in enumerate(layout.options_by_type[sig]):
            taken = int(round(pyo.value(m.n[t, o])))
            if taken == 0:
                continue
            group = [next(nodes) for _ in range(taken)]
            labels_left = {
                (mi, di): (taken * option.v[di] if layout.num_models == 1 else _label_count(m, (t, o, mi, di)))
                for di in range(num_degrees) if option.v[di] for mi in range(layout.num_models)
            }
            _label(layout, group, option, labels_left, chosen)
    for (i, si, mi), var in m.u.items():
        if pyo.value(var) > 0.5:
            slot = m.slots[i][si]
            running = layout.running_at[i].get(slot.gpu_ids) if slot.model == mi else None
            chosen[i].append((running or Instance(layout.nodes[i].name, slot.tp, slot.gpu_ids), mi))
    return chosen


def _label_count(m: pyo.ConcreteModel, key: tuple[int, int, int, int]) -> int:
    return int(round(pyo.value(m.l[key]))) if key in m.l else 0


def _label(
    layout: _Layout,
    group: list[int],
    option: _NodeOption,
    labels_left: dict[tuple[int, int], int],
    chosen: dict[int, list[tuple[Instance, int]]],
) -> None:
    free: list[tuple[int, _Slot]] = []  # (node index, slot) still without a model
    for i in group:
        for slot in option.slots:
            di = layout.degrees.index(slot.tp)
            if slot.model >= 0 and labels_left.get((slot.model, di), 0) > 0:
                labels_left[(slot.model, di)] -= 1
                chosen[i].append((layout.running_at[i][slot.gpu_ids], slot.model))
            else:
                free.append((i, slot))
    for i, slot in free:
        di = layout.degrees.index(slot.tp)
        mi = next(mi for mi in range(layout.num_models) if labels_left.get((mi, di), 0) > 0)
        labels_left[(mi, di)] -= 1
        chosen[i].append((Instance(layout.nodes[i].name, slot.tp, slot.gpu_ids), mi))


def _node_plans(
    cluster: Cluster,
    chosen: dict[int, list[tuple[Instance, int]]],
    running_models: Mapping[Instance, str],
    models: list[str],
) -> dict[str, tuple[NodePlan, ...]]:
    """model -> its keep, stop and start lists on every node."""
    # (node, model) -> its running instances there
    running: dict[tuple[str, str], set[Instance]] = defaultdict(set)
    for inst in cluster.placement:
        running[(inst.node, running_models[inst])].add(inst)
    plans: dict[str, list[NodePlan]] = {name: [] for name in models}
    for i, node in enumerate(cluster.nodes):
        target_by_model: dict[str, set[Instance]] = defaultdict(set)  # model -> its instances here
        for inst, mi in chosen.get(i, []):
            target_by_model[models[mi]].add(inst)
        for name in models:
            target, now = target_by_model[name], running[(node.name, name)]
            plans[name].append(NodePlan(
                node.name,
                keep=tuple(sorted(now & target)),
                stop=tuple(sorted(now - target)),
                start=tuple(sorted(target - now)),
            ))
    return {name: tuple(p) for name, p in plans.items()}


def _describe(instances_by_tp: Mapping[int, int]) -> str:
    return ", ".join(f"{n} x TP-{d}" for d, n in sorted(instances_by_tp.items()) if n) or "nothing"
