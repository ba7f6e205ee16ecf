"""Stage 1: quality-aware capacity planning, an ILP in Pyomo solved by HiGHS.

Sets: classes c, TP degrees d, candidate batch sizes b (per degree, up to the profile's largest),
thresholds t. Precomputed outside the ILP (``precompute``): for every (c, d, b, t) the predicted
latency ``lat`` of one request (recompute and cache steps costed apart, see ``latency.py``); only the
tuples with ``lat <= SLO_c`` become *options* o, which is the 0/1 SLO-feasibility parameter applied
by not creating the others.

Variables:
  R[d] integer, 0..slots(d)       instances of degree d
  y[d,b] binary                   degree d runs batch size b (exactly one b per d)
  z[d,b] integer, 0..slots(d)     instances of degree d at batch b, i.e. R[d] * y[d,b]
  x[o] in [0, 1]                  share of class c(o) served by option o

Constraints:
  sum_b y[d,b] = 1                                        one batch size per degree
  sum_{o of c} x[o] = 1                                    every class fully served
  sum_{o of (c,d,b)} x[o] <= y[d,b]                        options only at the chosen batch
  z[d,b] <= slots(d) y[d,b];  R[d] = sum_b z[d,b]          z = R * y (big-M = slots(d); written as
                                                           a disaggregation, whose LP relaxation is
                                                           tighter than the four-inequality form)
  sum_{o at (d,b)} lam_c lat_o x[o] <= rho b z[d,b]        stability: requests in service (Little's
                                                           law: rate x latency) below rho x batch x
                                                           instances, i.e. offered work below the
                                                           processing rate
  sum_d d R[d] <= G                                        GPU budget
  sum_{d' >= d} d' R[d'] <= d * sum_n floor(G_n / d)       aligned slots: with degrees that divide
                                                           each other this makes every R placeable
                                                           by Stage 2 (largest degrees first)

Objective, lexicographic, in two solves (a weighted sum cannot keep the order with continuous x):
  1. maximise Q = sum_o w_c t_o x[o]            average threshold per output token,
                                                 w_c = lam_c out_c / sum lam out
  2. add Q >= Q* - tolerance, maximise S = sum_o w_c (1 - lat_o / SLO_c) x[o]   (SLO slack)

Then spare GPUs (the ILP leaves them idle when they add nothing to Q or S) are filled with more
instances of the degrees in use, the most utilised first: extra instances only loosen the stability
constraints, so Q and S stay optimal. Infeasible: every GPU as TP-1 (maximum throughput), with the
reason in ``fallback_reason``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pyomo.environ as pyo

from shared.profiles import LatencyProfile

from . import solver as highs
from .latency import class_slo_s, predicted_steps, request_latency_s
from .plan import CapacityPlan, ClassAssignment, Objective
from .spec import Cluster, Workload

_SHARE_EPSILON = 1e-6  # shares below this are solver noise, not assignments


@dataclass(frozen=True)
class Stage1Options:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # candidates, capped by the profile per degree
    max_utilization: float = 0.9  # rho: stability margin below the processing rate
    quality_tolerance: float = 0.0  # solve 2 may lose this much average threshold (HiGHS adds its 1e-7)
    solver: highs.SolverOptions = field(default_factory=highs.SolverOptions)
    # KV cache memory per GPU (0: none): a degree-d instance holds d x this / the profile's
    # kv_bytes_per_token context tokens, so a batch of b requests of a class is an option only where
    # b x (its prompt + output tokens) fits (TP-2 has twice TP-1's room)
    kv_budget_bytes: int = 0


@dataclass(frozen=True)
class Option:
    """One SLO-feasible (class, degree, batch, threshold)."""

    class_index: int
    tp: int
    batch: int
    threshold: float
    latency_s: float
    slack: float  # 1 - latency / SLO, in [0, 1)


@dataclass(frozen=True)
class Stage1Inputs:
    """Everything the ILP needs, computed from workload, cluster and profile."""

    class_names: tuple[str, ...]
    planned_rates: tuple[float, ...]  # requests per second, safety buffer included
    weights: tuple[float, ...]  # per class: share of planned output tokens
    slo_s: tuple[float, ...]
    thresholds: tuple[float, ...]
    tp_degrees: tuple[int, ...]
    batches_by_tp: dict[int, tuple[int, ...]]  # tp degree -> candidate batch sizes
    slots_by_tp: dict[int, int]  # tp degree -> aligned slots in the cluster (max instances)
    gpu_capacity_by_tp: dict[int, int]  # tp degree -> GPUs in aligned slots of that degree
    num_gpus: int
    options: tuple[Option, ...]
    # class index -> (fastest latency, tp, batch, threshold): to explain an unservable class
    fastest_by_class: dict[int, tuple[float, int, int, float]]


def kv_tokens_of(profile: LatencyProfile, tp: int, kv_budget_bytes: int) -> int | None:
    """Context tokens a degree-``tp`` instance's KV memory holds (None: no budget, or a profile that
    does not know its KV bytes per token)."""
    if not kv_budget_bytes:
        return None
    return profile.kv_tokens(tp, kv_budget_bytes)


def precompute(
    workload: Workload, cluster: Cluster, profile: LatencyProfile, options: Stage1Options
) -> Stage1Inputs:
    tp_degrees = tuple(d for d in cluster.tp_degrees if cluster.num_slots(d) > 0)
    batches_by_tp = {
        d: tuple(b for b in options.batch_sizes if b <= profile.max_batch(d)) or (1,) for d in tp_degrees
    }
    planned_rates = tuple(workload.planned_rate(c) for c in workload.classes)
    token_rates = [rate * c.output_tokens for rate, c in zip(planned_rates, workload.classes, strict=True)]
    total_token_rate = sum(token_rates)
    if total_token_rate > 0:
        weights = tuple(r / total_token_rate for r in token_rates)
    else:  # no traffic: still plan for the mix of lengths, equally weighted
        total_output = sum(c.output_tokens for c in workload.classes) or 1
        weights = tuple(c.output_tokens / total_output for c in workload.classes)
    slo_s = tuple(class_slo_s(profile, workload, c) for c in workload.classes)
    all_options: list[Option] = []
    fastest_by_class: dict[int, tuple[float, int, int, float]] = {}
    kv_tokens = {d: kv_tokens_of(profile, d, options.kv_budget_bytes) for d in tp_degrees}
    for ci, request_class in enumerate(workload.classes):
        context = request_class.prompt_tokens + request_class.output_tokens
        for threshold in workload.thresholds:
            steps = predicted_steps(workload, request_class, threshold)
            for d in tp_degrees:
                for b in batches_by_tp[d]:
                    if kv_tokens[d] is not None and b * context > kv_tokens[d]:
                        continue  # the batch's KV caches do not fit the instance's memory
                    latency = request_latency_s(profile, request_class, steps, d, b)
                    fastest_by_class[ci] = min(
                        fastest_by_class.get(ci, (latency, d, b, threshold)), (latency, d, b, threshold)
                    )
                    if latency <= slo_s[ci]:
                        all_options.append(Option(ci, d, b, threshold, latency, 1.0 - latency / slo_s[ci]))
    return Stage1Inputs(
        class_names=tuple(c.name for c in workload.classes),
        planned_rates=planned_rates,
        weights=weights,
        slo_s=slo_s,
        thresholds=tuple(workload.thresholds),
        tp_degrees=tp_degrees,
        batches_by_tp=batches_by_tp,
        slots_by_tp={d: cluster.num_slots(d) for d in tp_degrees},
        gpu_capacity_by_tp={d: d * cluster.num_slots(d) for d in tp_degrees},
        num_gpus=cluster.num_gpus,
        options=tuple(all_options),
        fastest_by_class=fastest_by_class,
    )


def solve_stage1(
    workload: Workload,
    cluster: Cluster,
    profile: LatencyProfile,
    options: Stage1Options | None = None,
    fixed_instances_by_tp: dict[int, int] | None = None,
) -> CapacityPlan:
    """Plan instances per TP degree for ``workload`` on ``cluster``.

    With ``fixed_instances_by_tp`` (tp degree -> instances) the shape is given and only the batch
    sizes and shares are optimised: that evaluates the current configuration for the trigger rule;
    when it cannot serve the workload the plan has ``objective=None`` and a reason, and no fallback.
    """
    options = options or Stage1Options()
    inputs = precompute(workload, cluster, profile, options)
    if not inputs.class_names:
        return _idle_plan(inputs, fixed_instances_by_tp)
    unservable = _unservable_class_reason(inputs)
    if unservable is None:
        plan = _solve_lexicographic(inputs, options, fixed_instances_by_tp)
        if plan is not None:
            return plan
        reason = _capacity_reason(inputs, options)
    else:
        reason = unservable
    if fixed_instances_by_tp is not None:
        return _infeasible_fixed_plan(inputs, fixed_instances_by_tp, reason)
    return fallback_plan(inputs, reason)


# --- the ILP -----------------------------------------------------------------------------------


def build_model(
    inputs: Stage1Inputs, options: Stage1Options, fixed_instances_by_tp: dict[int, int] | None = None
) -> pyo.ConcreteModel:
    """The Stage 1 model with the quality objective (``m.quality``) active."""
    m = pyo.ConcreteModel(name="stage1")
    degree_batch_pairs = [(d, b) for d in inputs.tp_degrees for b in inputs.batches_by_tp[d]]
    m.R = pyo.Var(
        inputs.tp_degrees, domain=pyo.NonNegativeIntegers, bounds=lambda _, d: (0, inputs.slots_by_tp[d])
    )
    m.y = pyo.Var(degree_batch_pairs, domain=pyo.Binary)
    m.z = pyo.Var(
        degree_batch_pairs, domain=pyo.NonNegativeIntegers, bounds=lambda _, d, b: (0, inputs.slots_by_tp[d])
    )
    m.x = pyo.Var(range(len(inputs.options)), bounds=(0.0, 1.0))
    if fixed_instances_by_tp is not None:
        for d in inputs.tp_degrees:
            m.R[d].fix(min(fixed_instances_by_tp.get(d, 0), inputs.slots_by_tp[d]))
    _add_batch_choice(m, inputs)
    _add_class_coverage(m, inputs)
    _add_product_linearisation(m, inputs, degree_batch_pairs)
    _add_stability(m, inputs, options.max_utilization)
    _add_gpu_capacity(m, inputs)
    m.quality_expr = pyo.Expression(
        expr=sum(inputs.weights[o.class_index] * o.threshold * m.x[i] for i, o in enumerate(inputs.options))
    )
    m.slack_expr = pyo.Expression(
        expr=sum(inputs.weights[o.class_index] * o.slack * m.x[i] for i, o in enumerate(inputs.options))
    )
    m.quality = pyo.Objective(expr=m.quality_expr, sense=pyo.maximize)
    return m


def _add_batch_choice(m: pyo.ConcreteModel, inputs: Stage1Inputs) -> None:
    m.one_batch = pyo.Constraint(
        inputs.tp_degrees, rule=lambda m, d: sum(m.y[d, b] for b in inputs.batches_by_tp[d]) == 1
    )
    # (class, tp, batch) -> option indices
    cdb_to_option_ids: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    for i, o in enumerate(inputs.options):
        cdb_to_option_ids[(o.class_index, o.tp, o.batch)].append(i)
    m.at_chosen_batch = pyo.Constraint(
        list(cdb_to_option_ids),
        rule=lambda m, c, d, b: sum(m.x[i] for i in cdb_to_option_ids[(c, d, b)]) <= m.y[d, b],
    )


def _add_class_coverage(m: pyo.ConcreteModel, inputs: Stage1Inputs) -> None:
    class_to_option_ids: dict[int, list[int]] = defaultdict(list)  # class index -> option indices
    for i, o in enumerate(inputs.options):
        class_to_option_ids[o.class_index].append(i)
    m.served = pyo.Constraint(
        range(len(inputs.class_names)), rule=lambda m, c: sum(m.x[i] for i in class_to_option_ids[c]) == 1
    )


def _add_product_linearisation(
    m: pyo.ConcreteModel, inputs: Stage1Inputs, pairs: list[tuple[int, int]]
) -> None:
    big_m = inputs.slots_by_tp
    m.z_le_my = pyo.Constraint(pairs, rule=lambda m, d, b: m.z[d, b] <= big_m[d] * m.y[d, b])
    m.r_is_sum_z = pyo.Constraint(
        inputs.tp_degrees, rule=lambda m, d: m.R[d] == sum(m.z[d, b] for b in inputs.batches_by_tp[d])
    )


def _add_stability(m: pyo.ConcreteModel, inputs: Stage1Inputs, max_utilization: float) -> None:
    db_to_option_ids: dict[tuple[int, int], list[int]] = defaultdict(list)  # (tp, batch) -> option indices
    for i, o in enumerate(inputs.options):
        db_to_option_ids[(o.tp, o.batch)].append(i)

    def rule(m, d, b):
        in_service = sum(
            inputs.planned_rates[inputs.options[i].class_index] * inputs.options[i].latency_s * m.x[i]
            for i in db_to_option_ids[(d, b)]
        )
        return in_service <= max_utilization * b * m.z[d, b]

    m.stable = pyo.Constraint(list(db_to_option_ids), rule=rule)


def _add_gpu_capacity(m: pyo.ConcreteModel, inputs: Stage1Inputs) -> None:
    m.gpu_budget = pyo.Constraint(expr=sum(d * m.R[d] for d in inputs.tp_degrees) <= inputs.num_gpus)
    m.aligned_capacity = pyo.Constraint(
        inputs.tp_degrees,
        rule=lambda m, d: (
            sum(e * m.R[e] for e in inputs.tp_degrees if e >= d) <= inputs.gpu_capacity_by_tp[d]
        ),
    )


def _solve_lexicographic(
    inputs: Stage1Inputs, options: Stage1Options, fixed_instances_by_tp: dict[int, int] | None
) -> CapacityPlan | None:
    m = build_model(inputs, options, fixed_instances_by_tp)
    solver = highs.make_highs(options.solver)
    first = highs.run(solver, m)
    if first not in (highs.SolveStatus.OPTIMAL, highs.SolveStatus.FEASIBLE):
        return None
    best_quality = pyo.value(m.quality_expr)
    plan = _extract(m, inputs, optimal=first == highs.SolveStatus.OPTIMAL)
    m.quality.deactivate()
    m.keep_quality = pyo.Constraint(expr=m.quality_expr >= best_quality - options.quality_tolerance)
    m.slack = pyo.Objective(expr=m.slack_expr, sense=pyo.maximize)
    second = highs.run(solver, m)
    if second in (highs.SolveStatus.OPTIMAL, highs.SolveStatus.FEASIBLE):
        plan = _extract(m, inputs, optimal=plan.optimal and second == highs.SolveStatus.OPTIMAL)
    if fixed_instances_by_tp is None:
        plan = fill_spare_gpus(plan, inputs)
    return plan


def _extract(m: pyo.ConcreteModel, inputs: Stage1Inputs, optimal: bool) -> CapacityPlan:
    instances_by_tp = {d: int(round(pyo.value(m.R[d]))) for d in inputs.tp_degrees}
    batch_by_tp = {
        d: max(inputs.batches_by_tp[d], key=lambda b, d=d: pyo.value(m.y[d, b])) for d in inputs.tp_degrees
    }
    assignments = tuple(
        ClassAssignment(
            inputs.class_names[o.class_index],
            o.tp,
            o.batch,
            o.threshold,
            min(1.0, pyo.value(m.x[i])),
            o.latency_s,
            inputs.slo_s[o.class_index],
        )
        for i, o in enumerate(inputs.options)
        if pyo.value(m.x[i]) > _SHARE_EPSILON
    )
    objective = Objective(avg_threshold=pyo.value(m.quality_expr), slo_slack=pyo.value(m.slack_expr))
    return _finish(inputs, instances_by_tp, batch_by_tp, assignments, objective, optimal=optimal)


def _finish(
    inputs: Stage1Inputs,
    instances_by_tp: dict[int, int],
    batch_by_tp: dict[int, int],
    assignments: tuple[ClassAssignment, ...],
    objective: Objective | None,
    optimal: bool = True,
    fallback_reason: str | None = None,
) -> CapacityPlan:
    in_use_batch = {d: batch_by_tp[d] for d in inputs.tp_degrees if instances_by_tp.get(d, 0) > 0}
    return CapacityPlan(
        instances_by_tp={d: instances_by_tp.get(d, 0) for d in inputs.tp_degrees},
        batch_by_tp=in_use_batch,
        assignments=assignments,
        objective=objective,
        utilization_by_tp=_utilization(inputs, instances_by_tp, in_use_batch, assignments),
        fallback_reason=fallback_reason,
        optimal=optimal,
    )


def _requests_in_service_by_tp(
    inputs: Stage1Inputs, assignments: tuple[ClassAssignment, ...]
) -> dict[int, float]:
    rate_by_class = dict(zip(inputs.class_names, inputs.planned_rates, strict=True))  # class name -> rate
    in_service: dict[int, float] = defaultdict(float)  # tp degree -> requests in service (Little)
    for a in assignments:
        in_service[a.tp] += rate_by_class[a.class_name] * a.share * a.latency_s
    return in_service


def _utilization(
    inputs: Stage1Inputs,
    instances_by_tp: dict[int, int],
    batch_by_tp: dict[int, int],
    assignments: tuple[ClassAssignment, ...],
) -> dict[int, float]:
    in_service = _requests_in_service_by_tp(inputs, assignments)
    return {d: in_service.get(d, 0.0) / (batch_by_tp[d] * instances_by_tp[d]) for d in batch_by_tp}


# --- spare GPUs, fallback, reasons ----------------------------------------------------------------


def fits_aligned_capacity(inputs: Stage1Inputs, instances_by_tp: dict[int, int]) -> bool:
    """The ILP's GPU constraints: budget and, per degree, the aligned-slot capacity."""
    if sum(d * n for d, n in instances_by_tp.items()) > inputs.num_gpus:
        return False
    return all(
        sum(e * instances_by_tp.get(e, 0) for e in inputs.tp_degrees if e >= d)
        <= inputs.gpu_capacity_by_tp[d]
        for d in inputs.tp_degrees
    )


def fill_spare_gpus(plan: CapacityPlan, inputs: Stage1Inputs) -> CapacityPlan:
    """Add instances on idle GPUs: to the most utilised degree in use, then any degree that fits
    (largest first). Stability only gets looser, so the objective values stay optimal. Instances the
    ILP gave to degrees without work are dropped first (they are an arbitrary choice of the solver)."""
    in_service = _requests_in_service_by_tp(inputs, plan.assignments)
    # Instances of a degree that serves nothing are arbitrary (they change neither Q nor S): drop them.
    counts = {d: n if in_service.get(d, 0.0) > 0 else 0 for d, n in plan.instances_by_tp.items()}
    in_use = [d for d in inputs.tp_degrees if counts.get(d, 0) > 0]

    def with_one_more(d: int) -> dict[int, int]:
        return {**counts, d: counts.get(d, 0) + 1}

    while candidates := [d for d in in_use if fits_aligned_capacity(inputs, with_one_more(d))]:
        busiest = max(
            candidates, key=lambda d: (in_service.get(d, 0.0) / (plan.batch_by_tp[d] * counts[d]), d)
        )
        counts = with_one_more(busiest)
    for d in sorted(inputs.tp_degrees, reverse=True):
        while fits_aligned_capacity(inputs, with_one_more(d)):
            counts = with_one_more(d)
    batch_by_tp = {d: plan.batch_by_tp.get(d, inputs.batches_by_tp[d][0]) for d in inputs.tp_degrees}
    return _finish(inputs, counts, batch_by_tp, plan.assignments, plan.objective, plan.optimal)


def fallback_plan(inputs: Stage1Inputs, reason: str) -> CapacityPlan:
    """Every GPU as an instance of the smallest degree (TP-1: the most throughput), largest batch,
    lowest threshold; the threshold controller and load control take it from there."""
    smallest = inputs.tp_degrees[0] if inputs.tp_degrees else 1
    batch = max(inputs.batches_by_tp.get(smallest, (1,)))
    instances_by_tp = {d: 0 for d in inputs.tp_degrees}
    instances_by_tp[smallest] = inputs.slots_by_tp.get(smallest, 0)
    return _finish(
        inputs,
        instances_by_tp,
        {smallest: batch},
        (),
        None,
        fallback_reason=f"Stage 1 infeasible, fell back to all TP-{smallest}: {reason}",
    )


def _infeasible_fixed_plan(
    inputs: Stage1Inputs, instances_by_tp: dict[int, int], reason: str
) -> CapacityPlan:
    return CapacityPlan(
        instances_by_tp=dict(instances_by_tp),
        batch_by_tp={},
        assignments=(),
        objective=None,
        utilization_by_tp={},
        fallback_reason=f"this shape cannot serve the workload: {reason}",
    )


def _idle_plan(inputs: Stage1Inputs, fixed_instances_by_tp: dict[int, int] | None) -> CapacityPlan:
    """No request classes: nothing constrains the shape; the largest degrees give the lowest latency."""
    best = Objective(avg_threshold=max(inputs.thresholds), slo_slack=1.0)
    batch_by_tp = {d: inputs.batches_by_tp[d][0] for d in inputs.tp_degrees}
    if fixed_instances_by_tp is not None:
        return _finish(inputs, fixed_instances_by_tp, batch_by_tp, (), best)
    empty = _finish(inputs, {d: 0 for d in inputs.tp_degrees}, batch_by_tp, (), best)
    return fill_spare_gpus(empty, inputs)


def _unservable_class_reason(inputs: Stage1Inputs) -> str | None:
    if not inputs.tp_degrees:
        return "no TP degree fits on any node"
    servable = {o.class_index for o in inputs.options}
    for ci, name in enumerate(inputs.class_names):
        if ci not in servable:
            latency, d, b, threshold = inputs.fastest_by_class[ci]
            return (
                f"class '{name}' cannot meet its SLO of {inputs.slo_s[ci]:.3g} s at any TP degree, batch or "
                f"threshold (fastest: {latency:.3g} s at TP-{d}, batch {b}, threshold {threshold})"
            )
    return None


def _capacity_reason(inputs: Stage1Inputs, options: Stage1Options) -> str:
    """A lower bound on the GPUs needed: every class at its most GPU-efficient feasible option."""
    gpus_needed = 0.0
    for ci, rate in enumerate(inputs.planned_rates):
        gpu_seconds = min(o.latency_s * o.tp / o.batch for o in inputs.options if o.class_index == ci)
        gpus_needed += rate * gpu_seconds / options.max_utilization
    total_rate = sum(inputs.planned_rates)
    load = f"offered load of {total_rate:.3g} req/s (safety buffer included)"
    if gpus_needed > inputs.num_gpus:
        return (
            f"{load} needs at least {gpus_needed:.1f} GPUs at the lowest thresholds within the SLOs "
            f"and {options.max_utilization:.0%} utilisation; the cluster has {inputs.num_gpus}"
        )
    return (
        f"{load}: no mix of instances on {inputs.num_gpus} GPUs keeps every TP degree below "
        f"{options.max_utilization:.0%} utilisation with one batch size per degree "
        f"(a lower bound ignoring that is {gpus_needed:.1f} GPUs)"
    )
