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
First, one solve tries the case below overload: with every option under its class's highest
threshold fixed at 0, maximise S. Feasible, Q is the most it can be, so this is the lexicographic
optimum in one smaller solve (two models on 64 GPUs: 1.9-2.8 s of Stage 1 became 0.3-0.7 s on a
loaded 2-core machine); infeasible (a quick proof: capacity is short), the two solves above run.

Then spare GPUs (the ILP leaves them idle when they add nothing to Q or S) are filled with more
instances of the degrees in use, the most utilised first: extra instances only loosen the stability
constraints, so Q and S stay optimal. Infeasible: every GPU as TP-1 (maximum throughput), with the
reason in ``fallback_reason``.

Several models (``divide_gpus``; ``solve_stage1`` is it with one model). Every model k brings its own
workload, profile, SLOs, KV budget and allowed degrees, hence its own options; the variables above
get a model index (R[k,d], y[k,d,b], z[k,d,b], x[o] over every model's options) and so do the
per-model constraints; the GPU budget and the aligned-slot capacities sum over models. Weights w_c
are over every model's planned output tokens, so Q and S are the cluster's averages per output
token. A model without load (with more than one model) is not in the ILP: it holds exactly its
``min_instances`` (the instances it runs, smallest degrees first, then its smallest degree), which the
GPU constraints reserve; a model with load has sum_d R[k,d] >= min_instances.

Moving instances costs time: a model's ``switch_s`` (drain, stop, load its weights, warm up) against
the period ``period_s`` the plan holds, f_k = switch_s / period_s. Two terms weigh it, each in its
level's own currency:
  w[k,d,b] >= z[k,d,b] - current[k,d] y[k,d,b], w >= 0          instances started at the chosen batch
  stability: ... <= rho b (z[k,d,b] - f_k w[k,d,b])              a started instance serves (1 - f_k)
                                                                 of the period, a kept one all of it
  level 2: maximise S - sum_{k,d} switch_s_k d started[k,d] / (G period_s)
                                                                 slack less the share of the period's
                                                                 GPU-time that switching loses
So a move is made for quality (level 1) only where the capacity it brings, net of its switch time,
raises Q, and for slack alone (level 2) only where it buys more slack than the GPU-time it costs.
With several models the big-M of z is the most instances worth planning at (k,d,b) (all of k's load
there at its slowest option), which keeps the optimum and makes the joint ILP quicker to prove.
Spare GPUs go to the models with load (most utilised (model, degree) first); a model with a switch
cost first keeps the running instances that fit. Infeasible with several models: each model with load
at its smallest degree, GPUs handed out in proportion to the GPUs it needs at least.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pyomo.environ as pyo

from shared.profiles import LatencyProfile

from . import solver as highs
from .latency import class_slo_s, predicted_steps, request_latency_s
from .plan import CapacityPlan, ClassAssignment, DivisionPlan, Objective
from .spec import SINGLE_MODEL, Cluster, Instance, ModelDemand, Workload

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
    # how long a plan holds (the reconfiguration period): a started instance of a model with a
    # switch time serves (1 - switch_s / period_s) of it, a kept one all of it
    period_s: float = 300.0


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
    """Plan instances per TP degree for ``workload`` on ``cluster``: ``divide_gpus`` with one model.

    With ``fixed_instances_by_tp`` (tp degree -> instances) the shape is given and only the batch
    sizes and shares are optimised: that evaluates the current configuration for the trigger rule;
    when it cannot serve the workload the plan has ``objective=None`` and a reason, and no fallback.
    """
    model = ModelDemand(SINGLE_MODEL, workload, profile)
    fixed = None if fixed_instances_by_tp is None else {SINGLE_MODEL: fixed_instances_by_tp}
    return divide_gpus((model,), cluster, options, fixed).plans_by_model[SINGLE_MODEL]


def divide_gpus(
    models: Sequence[ModelDemand],
    cluster: Cluster,
    options: Stage1Options | None = None,
    fixed_instances: dict[str, dict[int, int]] | None = None,
    running_models: Mapping[Instance, str] | None = None,
) -> DivisionPlan:
    """Divide ``cluster``'s GPUs between ``models``: instances per TP degree for each, in one ILP.

    ``running_models`` names the model of each instance in ``cluster.placement`` (instances it does
    not name belong to no model: they are never kept); it matters only to models with a ``switch_s``.
    ``fixed_instances`` (model -> tp degree -> instances) scores a given division, as
    ``solve_stage1``'s ``fixed_instances_by_tp`` does for one model.
    """
    options = options or Stage1Options()
    _check_models(models)
    joint = _JointInputs.build(models, cluster, options, running_models, fixed_instances)
    if len(models) == 1 and not joint.inputs[0].class_names:
        plan = _idle_plan(joint.inputs[0], None if fixed_instances is None else fixed_instances[models[0].name])
        return joint.division({models[0].name: plan}, plan.objective)
    if not joint.loaded:
        return joint.division(joint.pinned_plans(), None)
    reason = _unservable_reason(joint)
    if reason is None:
        division = _solve_lexicographic(joint, options, fixed_instances)
        if division is not None:
            return division
        reason = _joint_capacity_reason(joint, options)
    if fixed_instances is not None:
        return joint.division(
            {m.name: _infeasible_fixed_plan(joint.inputs[k], fixed_instances.get(m.name, {}), reason)
             for k, m in enumerate(models)},
            None,
            reason,
        )
    return _joint_fallback(joint, reason)


def _check_models(models: Sequence[ModelDemand]) -> None:
    names = [m.name for m in models]
    if not models:
        raise ValueError("Stage 1 needs at least one model")
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be distinct: {names}")
    for m in models:
        if m.switch_s < 0 or m.min_instances < 0:
            raise ValueError(f"model '{m.name}': switch_s and min_instances must be >= 0")


@dataclass
class _JointInputs:
    """Every model's ``Stage1Inputs`` (class weights rescaled to the joint token rate), which models
    the ILP plans (``loaded``: with load, or the only model) and what the others are pinned to."""

    models: tuple[ModelDemand, ...]
    inputs: list[Stage1Inputs]
    loaded: list[int]  # model indices planned by the ILP
    pinned: dict[int, dict[int, int]]  # model index -> tp degree -> instances (idle models)
    current: dict[int, dict[int, int]]  # model index -> tp degree -> instances running now
    degrees: tuple[int, ...]  # the cluster's degrees with at least one aligned slot
    gpu_capacity_by_tp: dict[int, int]  # tp degree -> GPUs in aligned slots of that degree
    num_gpus: int
    period_s: float
    max_utilization: float

    @classmethod
    def build(
        cls,
        models: Sequence[ModelDemand],
        cluster: Cluster,
        options: Stage1Options,
        running_models: Mapping[Instance, str] | None,
        fixed_instances: dict[str, dict[int, int]] | None = None,
    ) -> _JointInputs:
        inputs = [precompute_model(m, cluster, options) for m in models]
        _rescale_weights(models, inputs)
        current = _current_counts(models, cluster, running_models)
        degrees = tuple(d for d in cluster.tp_degrees if cluster.num_slots(d) > 0)
        joint = cls(
            tuple(models),
            inputs,
            [],
            {},
            current,
            degrees,
            {d: d * cluster.num_slots(d) for d in degrees},
            cluster.num_gpus,
            options.period_s,
            options.max_utilization,
        )
        for k, m in enumerate(models):
            if len(models) == 1 or m.has_load:
                joint.loaded.append(k)
            elif fixed_instances is not None:  # scoring a given division: an idle model holds what it is given
                given = fixed_instances.get(m.name, {})
                joint.pinned[k] = {d: given.get(d, 0) for d in inputs[k].tp_degrees}
            else:
                joint.pinned[k] = joint.pin_idle(k)
        return joint

    def switch_fraction(self, k: int) -> float:
        """Share of the period a started instance of model k does not serve (0: moves are free)."""
        if self.models[k].switch_s <= 0 or self.period_s <= 0:
            return 0.0
        return min(1.0, self.models[k].switch_s / self.period_s)

    def pin_idle(self, k: int) -> dict[int, int]:
        """An idle model's minimum: its running instances, smallest degrees first, then instances of
        its smallest degree, as many as fit beside what is pinned already."""
        degrees = self.inputs[k].tp_degrees
        counts = {d: 0 for d in degrees}
        running = [d for d in degrees for _ in range(self.current.get(k, {}).get(d, 0))]
        wanted = running[: self.models[k].min_instances]
        wanted += [degrees[0]] * (self.models[k].min_instances - len(wanted)) if degrees else []
        for d in wanted:
            trial = {**counts, d: counts[d] + 1}
            if self.fits({**self._pinned_keys(), **{(k, e): n for e, n in trial.items()}}):
                counts = trial
        return counts

    def _pinned_keys(self) -> dict[tuple[int, int], int]:
        return {(k, d): n for k, by_tp in self.pinned.items() for d, n in by_tp.items()}

    def reserved_gpus(self, at_least_tp: int = 0) -> int:
        """GPUs of pinned instances of degree >= ``at_least_tp``."""
        return sum(d * n for by_tp in self.pinned.values() for d, n in by_tp.items() if d >= at_least_tp)

    def fits(self, counts: dict[tuple[int, int], int]) -> bool:
        """The ILP's GPU constraints for (model index, tp degree) -> instances: budget and, per
        degree, the aligned-slot capacity."""
        if sum(d * n for (_, d), n in counts.items()) > self.num_gpus:
            return False
        return all(
            sum(e * n for (_, e), n in counts.items() if e >= d) <= self.gpu_capacity_by_tp[d]
            for d in self.degrees
        )

    def pinned_plans(self) -> dict[str, CapacityPlan]:
        plans = {}
        for k, by_tp in self.pinned.items():
            inputs = self.inputs[k]
            batch_by_tp = {d: inputs.batches_by_tp[d][0] for d in inputs.tp_degrees}
            idle = Objective(avg_threshold=max(inputs.thresholds), slo_slack=1.0)
            plans[self.models[k].name] = _finish(inputs, by_tp, batch_by_tp, (), idle)
        return plans

    def division(
        self,
        plans: dict[str, CapacityPlan],
        objective: Objective | None,
        fallback_reason: str | None = None,
        optimal: bool = True,
    ) -> DivisionPlan:
        plans = {**plans, **{n: p for n, p in self.pinned_plans().items() if n not in plans}}
        ordered = {m.name: plans[m.name] for m in self.models}
        started: dict[str, dict[int, int]] = {}  # model -> tp degree -> instances started
        switch_gpu_s = 0.0
        for k, m in enumerate(self.models):
            now = self.current.get(k, {})
            started[m.name] = {
                d: max(0, n - now.get(d, 0)) for d, n in ordered[m.name].instances_by_tp.items()
            }
            switch_gpu_s += m.switch_s * sum(d * n for d, n in started[m.name].items())
        return DivisionPlan(ordered, objective, started, switch_gpu_s, fallback_reason, optimal)


def precompute_model(model: ModelDemand, cluster: Cluster, options: Stage1Options) -> Stage1Inputs:
    """``precompute`` for one model: its degrees and KV budget where it sets them."""
    if model.kv_budget_bytes is not None:
        options = dataclasses.replace(options, kv_budget_bytes=model.kv_budget_bytes)
    if model.tp_degrees is not None:
        allowed = tuple(d for d in cluster.tp_degrees if d in model.tp_degrees)
        cluster = Cluster(cluster.nodes, allowed, cluster.placement)
    return precompute(model.workload, cluster, model.profile, options)


def _rescale_weights(models: Sequence[ModelDemand], inputs: list[Stage1Inputs]) -> None:
    """Class weights over every model's planned output tokens, so that the joint objective is the
    average threshold per output token of the whole cluster (one model: unchanged)."""
    if len(models) == 1:
        return
    token_rates = [
        sum(r * c.output_tokens for r, c in zip(i.planned_rates, m.workload.classes, strict=True))
        for m, i in zip(models, inputs, strict=True)
    ]
    total = sum(token_rates)
    for k, i in enumerate(inputs):
        scale = token_rates[k] / total if total > 0 else 0.0
        inputs[k] = dataclasses.replace(i, weights=tuple(w * scale for w in i.weights))


def _current_counts(
    models: Sequence[ModelDemand], cluster: Cluster, running_models: Mapping[Instance, str] | None
) -> dict[int, dict[int, int]]:
    """model index -> tp degree -> instances running now (one model: every running instance)."""
    index_of = {m.name: k for k, m in enumerate(models)}
    counts: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for inst in cluster.placement:
        if len(models) == 1:
            counts[0][inst.tp] += 1
        elif running_models is not None and running_models.get(inst) in index_of:
            counts[index_of[running_models[inst]]][inst.tp] += 1
    return {k: dict(by_tp) for k, by_tp in counts.items()}


# --- the ILP -----------------------------------------------------------------------------------


def build_model(
    joint: _JointInputs, options: Stage1Options, fixed_instances: dict[str, dict[int, int]] | None = None
) -> pyo.ConcreteModel:
    """The joint Stage 1 model with the quality objective (``m.quality``) active. With one model the
    rows and columns come in the same order as the single-model ILP had, so HiGHS returns the same
    plans."""
    m = pyo.ConcreteModel(name="stage1")
    inputs, loaded = joint.inputs, joint.loaded
    kd = [(k, d) for k in loaded for d in inputs[k].tp_degrees]
    kdb = [(k, d, b) for k, d in kd for b in inputs[k].batches_by_tp[d]]
    m.options = [(k, i, o) for k in loaded for i, o in enumerate(inputs[k].options)]  # global index -> option
    m.R = pyo.Var(kd, domain=pyo.NonNegativeIntegers, bounds=lambda _, k, d: (0, inputs[k].slots_by_tp[d]))
    m.y = pyo.Var(kdb, domain=pyo.Binary)
    m.z = pyo.Var(kdb, domain=pyo.NonNegativeIntegers, bounds=lambda _, k, d, b: (0, inputs[k].slots_by_tp[d]))
    m.x = pyo.Var(range(len(m.options)), bounds=(0.0, 1.0))
    if fixed_instances is not None:
        for k, d in kd:
            by_tp = fixed_instances.get(joint.models[k].name, {})
            m.R[k, d].fix(min(by_tp.get(d, 0), inputs[k].slots_by_tp[d]))
    switched = [
        (k, d, b) for k, d, b in kdb if joint.switch_fraction(k) > 0 and joint.current.get(k, {}).get(d, 0) > 0
    ]
    switched_kd = {(k, d) for k, d in kd if joint.switch_fraction(k) > 0}
    m.w = pyo.Var(switched, domain=pyo.NonNegativeReals)  # instances started at (k, d, b) beyond those running
    _add_batch_choice(m, joint, kd)
    _add_class_coverage(m, joint)
    _add_product_linearisation(m, joint, kd, kdb, tighten=len(joint.models) > 1 and fixed_instances is None)
    _add_stability(m, joint, options.max_utilization, set(switched), switched_kd)
    _add_started(m, joint, switched)
    _add_gpu_capacity(m, joint, kd)
    _add_min_instances(m, joint, kd)
    weight = [inputs[k].weights[o.class_index] for k, _, o in m.options]
    m.quality_expr = pyo.Expression(expr=sum(weight[g] * o.threshold * m.x[g] for g, (_, _, o) in enumerate(m.options)))
    m.slack_expr = pyo.Expression(expr=sum(weight[g] * o.slack * m.x[g] for g, (_, _, o) in enumerate(m.options)))
    m.switch_expr = pyo.Expression(expr=_switch_gpu_s(m, joint, switched_kd))
    m.quality = pyo.Objective(expr=m.quality_expr, sense=pyo.maximize)
    return m


def _option_ids_by(m: pyo.ConcreteModel, key) -> dict[tuple, list[int]]:
    # key(model index, option) -> global option indices, in option order
    groups: dict[tuple, list[int]] = defaultdict(list)
    for g, (k, _, o) in enumerate(m.options):
        groups[key(k, o)].append(g)
    return groups


def _add_batch_choice(m: pyo.ConcreteModel, joint: _JointInputs, kd: list[tuple[int, int]]) -> None:
    batches = {k: joint.inputs[k].batches_by_tp for k in joint.loaded}
    m.one_batch = pyo.Constraint(kd, rule=lambda m, k, d: sum(m.y[k, d, b] for b in batches[k][d]) == 1)
    # (model, class, tp, batch) -> option indices
    kcdb_to_option_ids = _option_ids_by(m, lambda k, o: (k, o.class_index, o.tp, o.batch))
    m.at_chosen_batch = pyo.Constraint(
        list(kcdb_to_option_ids),
        rule=lambda m, k, c, d, b: sum(m.x[g] for g in kcdb_to_option_ids[(k, c, d, b)]) <= m.y[k, d, b],
    )


def _add_class_coverage(m: pyo.ConcreteModel, joint: _JointInputs) -> None:
    kc_to_option_ids = _option_ids_by(m, lambda k, o: (k, o.class_index))  # (model, class) -> option indices
    classes = [(k, c) for k in joint.loaded for c in range(len(joint.inputs[k].class_names))]
    m.served = pyo.Constraint(classes, rule=lambda m, k, c: sum(m.x[g] for g in kc_to_option_ids[(k, c)]) == 1)


def _add_product_linearisation(
    m: pyo.ConcreteModel,
    joint: _JointInputs,
    kd: list[tuple[int, int]],
    kdb: list[tuple[int, int, int]],
    tighten: bool,
) -> None:
    inputs = joint.inputs
    big_m = {(k, d, b): inputs[k].slots_by_tp[d] for k, d, b in kdb}
    if tighten:
        big_m = _useful_instances(m, joint, big_m)
    m.z_le_my = pyo.Constraint(kdb, rule=lambda m, k, d, b: m.z[k, d, b] <= big_m[(k, d, b)] * m.y[k, d, b])
    m.r_is_sum_z = pyo.Constraint(
        kd, rule=lambda m, k, d: m.R[k, d] == sum(m.z[k, d, b] for b in inputs[k].batches_by_tp[d])
    )


def _useful_instances(
    m: pyo.ConcreteModel, joint: _JointInputs, slots: dict[tuple[int, int, int], int]
) -> dict[tuple[int, int, int], int]:
    """(model, tp, batch) -> the most instances worth planning there: enough for all of the model's
    load at its slowest option there. More only loosen a stability constraint that already holds, so
    the bound keeps the optimum (spare GPUs are filled after the solve) and tightens the big-M, which
    is what makes the joint ILP of several models slow to prove optimal. Not applied to one model, so
    that its plans stay those of the single-model ILP, ties included, nor to a fixed shape."""
    # (model, tp, batch) -> class index -> slowest latency of its options there
    slowest: dict[tuple[int, int, int], dict[int, float]] = defaultdict(dict)
    for k, _, o in m.options:
        by_class = slowest[(k, o.tp, o.batch)]
        by_class[o.class_index] = max(by_class.get(o.class_index, 0.0), o.latency_s)
    bounds = {}
    for (k, d, b), n in slots.items():
        rates = joint.inputs[k].planned_rates
        in_service = sum(rates[c] * latency for c, latency in slowest.get((k, d, b), {}).items())
        serving = 1.0 - joint.switch_fraction(k)  # a started instance serves this share of the period
        if serving <= 0:
            bounds[(k, d, b)] = n
            continue
        bounds[(k, d, b)] = min(n, math.ceil(in_service / (joint.max_utilization * b * serving) + 1e-9))
    return bounds


def _add_stability(
    m: pyo.ConcreteModel,
    joint: _JointInputs,
    max_utilization: float,
    switched: set[tuple[int, int, int]],
    switched_kd: set[tuple[int, int]],
) -> None:
    kdb_to_option_ids = _option_ids_by(m, lambda k, o: (k, o.tp, o.batch))  # (model, tp, batch) -> options

    def rule(m, k, d, b):
        rates = joint.inputs[k].planned_rates
        in_service = sum(
            rates[m.options[g][2].class_index] * m.options[g][2].latency_s * m.x[g] for g in kdb_to_option_ids[(k, d, b)]
        )
        capacity = max_utilization * b * m.z[k, d, b]
        if (k, d, b) in switched:  # instances started now serve (1 - switch_s / period) of the period
            capacity = capacity - max_utilization * b * joint.switch_fraction(k) * m.w[k, d, b]
        elif (k, d) in switched_kd:  # nothing of (k, d) runs now: every instance is started
            capacity = capacity * (1.0 - joint.switch_fraction(k))
        return in_service <= capacity

    m.stable = pyo.Constraint(list(kdb_to_option_ids), rule=rule)


def _add_started(m: pyo.ConcreteModel, joint: _JointInputs, switched: list[tuple[int, int, int]]) -> None:
    """w[k,d,b] >= z[k,d,b] - current[k,d] y[k,d,b]: at the chosen batch, the instances beyond those
    running now (z = R y, so this is (R - current)+ there and 0 at the other batches)."""
    current = joint.current
    m.started = pyo.Constraint(
        switched, rule=lambda m, k, d, b: m.w[k, d, b] >= m.z[k, d, b] - current[k][d] * m.y[k, d, b]
    )


def _switch_gpu_s(m: pyo.ConcreteModel, joint: _JointInputs, switched_kd: set[tuple[int, int]]):
    """GPU-seconds that started instances spend not serving: switch_s x tp x instances started."""
    terms = []
    for k, d in sorted(switched_kd):
        cost = joint.models[k].switch_s * d
        if joint.current.get(k, {}).get(d, 0) > 0:
            terms.extend(cost * m.w[k, d, b] for b in joint.inputs[k].batches_by_tp[d])
        else:
            terms.append(cost * m.R[k, d])
    return sum(terms) if terms else 0.0


def _add_gpu_capacity(m: pyo.ConcreteModel, joint: _JointInputs, kd: list[tuple[int, int]]) -> None:
    budget = joint.num_gpus - joint.reserved_gpus()
    m.gpu_budget = pyo.Constraint(expr=sum(d * m.R[k, d] for k, d in kd) <= budget)
    m.aligned_capacity = pyo.Constraint(
        list(joint.degrees),
        rule=lambda m, d: (
            sum(e * m.R[k, e] for k, e in kd if e >= d)
            <= joint.gpu_capacity_by_tp[d] - joint.reserved_gpus(at_least_tp=d)
        ),
    )


def _add_min_instances(m: pyo.ConcreteModel, joint: _JointInputs, kd: list[tuple[int, int]]) -> None:
    floors = {k: joint.models[k].min_instances for k in joint.loaded if joint.models[k].min_instances > 0}
    m.min_instances = pyo.Constraint(
        list(floors), rule=lambda m, k: sum(m.R[j, d] for j, d in kd if j == k) >= floors[k]
    )


def _solve_lexicographic(
    joint: _JointInputs, options: Stage1Options, fixed_instances: dict[str, dict[int, int]] | None
) -> DivisionPlan | None:
    m = build_model(joint, options, fixed_instances)
    solver = highs.make_highs(options.solver)
    # exact only where the second level may not trade quality for slack (no tolerance)
    top_only = _solve_at_the_top(m, joint, solver) if options.quality_tolerance == 0 else None
    if top_only is not None:
        return top_only if fixed_instances is not None else fill_spare_gpus_joint(top_only, joint)
    first = highs.run(solver, m)
    if first not in (highs.SolveStatus.OPTIMAL, highs.SolveStatus.FEASIBLE):
        return None
    best_quality = pyo.value(m.quality_expr)
    optimal = first == highs.SolveStatus.OPTIMAL
    division = _extract(m, joint, optimal)
    m.quality.deactivate()
    m.keep_quality = pyo.Constraint(expr=m.quality_expr >= best_quality - options.quality_tolerance)
    m.slack = pyo.Objective(expr=_slack_objective(m, joint), sense=pyo.maximize)
    second = highs.run(solver, m)
    if second in (highs.SolveStatus.OPTIMAL, highs.SolveStatus.FEASIBLE):
        division = _extract(m, joint, optimal and second == highs.SolveStatus.OPTIMAL)
    if fixed_instances is None:
        division = fill_spare_gpus_joint(division, joint)
    return division


def _solve_at_the_top(m: pyo.ConcreteModel, joint: _JointInputs, solver) -> DivisionPlan | None:
    """The lexicographic optimum in one solve where the cluster can run every class at its highest
    feasible threshold (below overload, the common case): then the first level's optimum is that,
    every share below the top is 0 there, and the second level is the slack over the top options
    alone, a smaller ILP than either level over all of them. None where the top options cannot be
    served (the model is left as it was built, for the two solves)."""
    below = _below_the_top(m)
    for g in below:
        m.x[g].fix(0.0)
    m.quality.deactivate()
    m.top_slack = pyo.Objective(expr=_slack_objective(m, joint), sense=pyo.maximize)
    status = highs.run(solver, m)
    division = None
    if status in (highs.SolveStatus.OPTIMAL, highs.SolveStatus.FEASIBLE):
        division = _extract(m, joint, status == highs.SolveStatus.OPTIMAL)
    m.del_component(m.top_slack)
    m.quality.activate()
    for g in below:
        m.x[g].unfix()
    return division


def _below_the_top(m: pyo.ConcreteModel) -> list[int]:
    """Options below the highest feasible threshold of their (model, class)."""
    top: dict[tuple[int, int], float] = {}  # (model, class) -> highest feasible threshold
    for k, _, o in m.options:
        top[(k, o.class_index)] = max(top.get((k, o.class_index), 0.0), o.threshold)
    return [g for g, (k, _, o) in enumerate(m.options) if o.threshold < top[(k, o.class_index)]]


def _slack_objective(m: pyo.ConcreteModel, joint: _JointInputs):
    """The second level: average SLO slack, less the share of the period's GPU-time that started
    instances spend switching (``switch_gpu_s / (num_gpus x period_s)``): a move that only buys slack
    is made when it buys more slack than the GPU-time it costs. Without switch costs, the slack."""
    if not any(joint.switch_fraction(k) > 0 for k in joint.loaded):
        return m.slack_expr
    return m.slack_expr - m.switch_expr / (joint.num_gpus * joint.period_s)


def _extract(m: pyo.ConcreteModel, joint: _JointInputs, optimal: bool) -> DivisionPlan:
    joint_objective = Objective(avg_threshold=pyo.value(m.quality_expr), slo_slack=pyo.value(m.slack_expr))
    x = [pyo.value(m.x[g]) for g in range(len(m.options))]
    plans = {}
    for k in joint.loaded:
        inputs = joint.inputs[k]
        instances_by_tp = {d: int(round(pyo.value(m.R[k, d]))) for d in inputs.tp_degrees}
        batch_by_tp = {
            d: max(inputs.batches_by_tp[d], key=lambda b, d=d: pyo.value(m.y[k, d, b])) for d in inputs.tp_degrees
        }
        mine = [(g, o) for g, (j, _, o) in enumerate(m.options) if j == k]
        assignments = tuple(
            ClassAssignment(
                inputs.class_names[o.class_index],
                o.tp,
                o.batch,
                o.threshold,
                min(1.0, x[g]),
                o.latency_s,
                inputs.slo_s[o.class_index],
            )
            for g, o in mine
            if x[g] > _SHARE_EPSILON
        )
        objective = joint_objective if len(joint.models) == 1 else _model_objective(inputs, mine, x)
        plans[joint.models[k].name] = _finish(inputs, instances_by_tp, batch_by_tp, assignments, objective, optimal)
    return joint.division(plans, joint_objective, optimal=optimal)


def _model_objective(inputs: Stage1Inputs, mine: list[tuple[int, Option]], x: list[float]) -> Objective:
    """One model's average threshold and slack over its own output tokens."""
    share = sum(inputs.weights) or 1.0
    quality = sum(inputs.weights[o.class_index] * o.threshold * x[g] for g, o in mine) / share
    slack = sum(inputs.weights[o.class_index] * o.slack * x[g] for g, o in mine) / share
    return Objective(avg_threshold=quality, slo_slack=slack)


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


def fill_spare_gpus_joint(division: DivisionPlan, joint: _JointInputs) -> DivisionPlan:
    """Add instances on idle GPUs, to the models with load: to the most utilised (model, degree) in
    use, then any degree that fits (largest first, busiest model first). Stability only gets looser,
    so the objective values stay optimal. Instances the ILP gave to degrees without work are dropped
    first (they are an arbitrary choice of the solver), except those a model's minimum needs; a model
    with a switch cost first keeps every instance it runs now that fits (kept, an instance costs
    nothing; a start elsewhere does), and only then do idle GPUs start new ones."""
    names = [m.name for m in joint.models]
    plans = division.plans_by_model
    # (model index, tp degree) -> requests in service
    in_service = {
        (k, d): s for k in joint.loaded
        for d, s in _requests_in_service_by_tp(joint.inputs[k], plans[names[k]].assignments).items()
    }
    counts = joint._pinned_keys()
    for k in joint.loaded:
        counts.update({(k, d): n for d, n in _kept_counts(joint, plans[names[k]], in_service, k).items()})

    def with_one_more(key: tuple[int, int]) -> dict[tuple[int, int], int]:
        return {**counts, key: counts.get(key, 0) + 1}

    for k in joint.loaded:  # with a switch cost, running instances the ILP let go are kept if they fit
        for d in joint.inputs[k].tp_degrees if joint.switch_fraction(k) > 0 else ():
            while counts[(k, d)] < joint.current.get(k, {}).get(d, 0) and joint.fits(with_one_more((k, d))):
                counts = with_one_more((k, d))
    in_use = [(k, d) for k in joint.loaded for d in joint.inputs[k].tp_degrees if counts[(k, d)] > 0]

    def utilisation(key: tuple[int, int]) -> float:
        k, d = key
        batch = plans[names[k]].batch_by_tp.get(d, joint.inputs[k].batches_by_tp[d][0])
        return in_service.get(key, 0.0) / (batch * counts[key])

    while candidates := [key for key in in_use if joint.fits(with_one_more(key))]:
        busiest = max(candidates, key=lambda key: (utilisation(key), key[1], -key[0]))
        counts = with_one_more(busiest)
    recipients = sorted(joint.loaded, key=lambda k: -_model_utilisation(k, in_service, counts, plans[names[k]]))
    for d in sorted(joint.degrees, reverse=True):
        for k in recipients:
            if d not in joint.inputs[k].tp_degrees:
                continue
            while joint.fits(with_one_more((k, d))):
                counts = with_one_more((k, d))
    filled = {}
    for k in joint.loaded:
        inputs, plan = joint.inputs[k], plans[names[k]]
        batch_by_tp = {d: plan.batch_by_tp.get(d, inputs.batches_by_tp[d][0]) for d in inputs.tp_degrees}
        by_tp = {d: counts.get((k, d), 0) for d in inputs.tp_degrees}
        filled[names[k]] = _finish(inputs, by_tp, batch_by_tp, plan.assignments, plan.objective, plan.optimal)
    return joint.division(filled, division.objective, optimal=division.optimal)


def _kept_counts(
    joint: _JointInputs, plan: CapacityPlan, in_service: dict[tuple[int, int], float], k: int
) -> dict[int, int]:
    """Model k's instances before filling (tp degree -> count): the degrees with work; with a switch
    cost, also the instances it runs now; then, up to its minimum, the ILP's others (smallest first)."""
    planned = plan.instances_by_tp
    idle_degrees = [d for d in joint.inputs[k].tp_degrees if in_service.get((k, d), 0.0) <= 0]
    counts = {d: n for d, n in planned.items() if d not in idle_degrees}
    for d in idle_degrees:
        running = joint.current.get(k, {}).get(d, 0) if joint.switch_fraction(k) > 0 else 0
        counts[d] = min(planned.get(d, 0), running)
    for d in idle_degrees:
        missing = joint.models[k].min_instances - sum(counts.values())
        counts[d] += max(0, min(planned.get(d, 0) - counts[d], missing))
    return counts


def _model_utilisation(
    k: int, in_service: dict[tuple[int, int], float], counts: dict[tuple[int, int], int], plan: CapacityPlan
) -> float:
    load = sum(s for (j, _), s in in_service.items() if j == k)
    room = sum(plan.batch_by_tp.get(d, 1) * n for (j, d), n in counts.items() if j == k)
    return load / room if room else float("inf")


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


def _joint_fallback(joint: _JointInputs, reason: str) -> DivisionPlan:
    """One model: every GPU as its smallest degree (``fallback_plan``). Several: each model with load
    at its smallest degree, largest batch: one instance each (a model with little load among heavy
    ones is not starved), then instances handed out one at a time to the model furthest below its
    share of the GPUs (shares in proportion to ``_gpus_needed``) while they fit."""
    if len(joint.models) == 1:
        plan = fallback_plan(joint.inputs[0], reason)
        return joint.division({joint.models[0].name: plan}, None, plan.fallback_reason)
    counts = joint._pinned_keys()
    loaded = [k for k in joint.loaded if joint.inputs[k].tp_degrees]
    need = {k: max(_gpus_needed(joint.inputs[k], 1.0), 1e-9) for k in loaded}
    total_need = sum(need.values())
    smallest = {k: joint.inputs[k].tp_degrees[0] for k in loaded}
    for k in sorted(loaded, key=lambda k: -need[k]):  # every model with load serves: one instance first
        key = (k, smallest[k])
        if counts.get(key, 0) == 0 and joint.fits({**counts, key: 1}):
            counts[key] = 1
    while True:
        def deficit(k: int) -> float:
            return need[k] / total_need - smallest[k] * counts.get((k, smallest[k]), 0) / joint.num_gpus

        fitting = [k for k in loaded if joint.fits({**counts, (k, smallest[k]): counts.get((k, smallest[k]), 0) + 1})]
        if not fitting:
            break
        k = max(fitting, key=lambda k: (deficit(k), -k))
        counts[(k, smallest[k])] = counts.get((k, smallest[k]), 0) + 1
    full_reason = f"Stage 1 infeasible, fell back to each model at its smallest TP degree: {reason}"
    plans = {}
    for k in loaded:
        inputs = joint.inputs[k]
        by_tp = {d: counts.get((k, d), 0) for d in inputs.tp_degrees}
        batch = {smallest[k]: max(inputs.batches_by_tp[smallest[k]])}
        plans[joint.models[k].name] = _finish(inputs, by_tp, batch, (), None, fallback_reason=full_reason)
    return joint.division(plans, None, full_reason)


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
    counts = {d: 0 for d in inputs.tp_degrees}
    for d in sorted(inputs.tp_degrees, reverse=True):
        while fits_aligned_capacity(inputs, {**counts, d: counts[d] + 1}):
            counts[d] += 1
    return _finish(inputs, counts, batch_by_tp, (), best)


def _unservable_reason(joint: _JointInputs) -> str | None:
    for k in joint.loaded:
        reason = _unservable_class_reason(joint.inputs[k])
        if reason is not None:
            return reason if len(joint.models) == 1 else f"model '{joint.models[k].name}': {reason}"
    return None


def _gpus_needed(inputs: Stage1Inputs, max_utilization: float) -> float:
    """A lower bound on one model's GPUs: every class at its most GPU-efficient feasible option."""
    gpus_needed = 0.0
    for ci, rate in enumerate(inputs.planned_rates):
        gpu_seconds = min((o.latency_s * o.tp / o.batch for o in inputs.options if o.class_index == ci), default=0.0)
        gpus_needed += rate * gpu_seconds / max_utilization
    return gpus_needed


def _joint_capacity_reason(joint: _JointInputs, options: Stage1Options) -> str:
    if len(joint.models) == 1:
        return _capacity_reason(joint.inputs[0], options)
    needed = {joint.models[k].name: _gpus_needed(joint.inputs[k], options.max_utilization) for k in joint.loaded}
    detail = ", ".join(f"'{name}' {gpus:.1f}" for name, gpus in needed.items())
    return (
        f"the models need at least {sum(needed.values()):.1f} GPUs together at the lowest thresholds within "
        f"their SLOs and {options.max_utilization:.0%} utilisation ({detail}; pinned idle models hold "
        f"{joint.reserved_gpus()}), or no mix of instances keeps every degree below that utilisation; "
        f"the cluster has {joint.num_gpus}"
    )


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
