"""Several models sharing a cluster: Stage 1 divides the GPUs (``divide_gpus``), Stage 2 places every
model's instances (``place_models``); one model through the same code gives the plans it always did."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.reconfigurator.core.example_profile import example_profile
from services.reconfigurator.core.files import load_workload
from services.reconfigurator.core.planner import plan_models
from services.reconfigurator.core.spec import Cluster, Instance, ModelDemand, Node, Workload, uniform_cluster
from services.reconfigurator.core.stage1 import Stage1Options, divide_gpus, solve_stage1
from services.reconfigurator.core.stage2 import Stage2Infeasible, candidate_slots, place_models
from shared.profiles import LatencyProfile
from tests.unit.reconfigurator.reconfig_builders import make_workload, profile_dict

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = Path(__file__).with_name("data") / "stage1_single_model_plans.json"
EXAMPLE_WORKLOAD = load_workload(ROOT / "services/reconfigurator/examples/workload.json")


def example_at(rps: float) -> Workload:
    return EXAMPLE_WORKLOAD.with_rate_scale(rps / EXAMPLE_WORKLOAD.total_rate)


def cluster64() -> Cluster:
    return uniform_cluster(8, 8, (1, 2, 4, 8))


def gpus(instances_by_tp: dict[int, int]) -> int:
    return sum(tp * n for tp, n in instances_by_tp.items())


# --- one model: the plans of the single-model ILP ---------------------------------------------------


def test_one_model_gives_the_plans_the_single_model_ilp_gave():
    """Plans recorded from the single-model Stage 1 before it became the joint ILP with one model."""
    test_profile = LatencyProfile.from_dict(profile_dict())
    for case in json.loads(GOLDEN.read_text()):
        profile = test_profile if case["profile"] == "test" else example_profile()
        if case["kv_budget_bytes"]:
            profile = dataclasses.replace(profile, kv_bytes_per_token=512 * 1024)
        rps = case["rps"]
        workload = make_workload(rps) if case["workload"] == "builders" else example_at(rps)
        tp_degrees = tuple(case["tp_degrees"])
        cluster = uniform_cluster(case["nodes"], case["gpus_per_node"], tp_degrees)
        options = Stage1Options(kv_budget_bytes=case["kv_budget_bytes"])
        plan = solve_stage1(workload, cluster, profile, options)
        assert _as_recorded(plan.to_dict()) == _as_recorded(case["plan"]), case
        all_smallest = {tp_degrees[0]: cluster.num_gpus // tp_degrees[0]}
        fixed = solve_stage1(workload, cluster, profile, options, fixed_instances_by_tp=all_smallest)
        assert _as_recorded(fixed.to_dict()) == _as_recorded(case["fixed_all_smallest"]), case


def _as_recorded(plan: dict) -> dict:
    """What the recording pins down: a degree nobody's requests run on (utilisation 0) may run any
    batch (a tie the solve order breaks), and the objective is HiGHS's within its 1e-6 gap."""
    busy = {d for d, u in plan["utilization_by_tp"].items() if u > 0}
    objective = plan["objective"] and {k: round(v, 5) for k, v in plan["objective"].items()}
    return {**plan, "batch_by_tp": {d: b for d, b in plan["batch_by_tp"].items() if d in busy},
            "objective": objective}


# --- Stage 1: the division ---------------------------------------------------------------------


@pytest.mark.parametrize("minimum", [0, 1, 2])
def test_all_load_on_one_model_gives_it_all_but_the_others_minimum(minimum):
    busy = ModelDemand("busy", example_at(40), example_profile())
    idle = ModelDemand("idle", example_at(40).with_rate_scale(0.0), example_profile(), min_instances=minimum)
    division = divide_gpus((busy, idle), cluster64())
    assert division.feasible
    assert sum(division.instances_by_model_tp["idle"].values()) == minimum
    assert division.gpus_by_model["idle"] == minimum  # the smallest degree: TP-1
    assert division.gpus_by_model["busy"] == 64 - minimum


def test_an_idle_model_keeps_its_minimum_among_the_instances_it_runs():
    cluster = cluster64().with_placement(
        tuple(Instance(f"node-{n}", 2, (0, 1)) for n in range(4))
    )
    running = {inst: "idle" for inst in cluster.placement}
    busy = ModelDemand("busy", example_at(40), example_profile())
    idle = ModelDemand("idle", example_at(0.0), example_profile(), min_instances=1, switch_s=60.0)
    division = divide_gpus((busy, idle), cluster, running_models=running)
    assert {tp: n for tp, n in division.instances_by_model_tp["idle"].items() if n} == {2: 1}
    assert division.started_by_model["idle"] == {1: 0, 2: 0, 4: 0, 8: 0}
    assert division.gpus_by_model["busy"] == 62


@pytest.mark.parametrize("total_rps", [20, 80, 120, 240])
def test_a_3_to_1_split_between_equal_models_gives_gpus_in_about_that_ratio(total_rps):
    a = ModelDemand("a", example_at(total_rps * 0.75), example_profile())
    b = ModelDemand("b", example_at(total_rps * 0.25), example_profile())
    division = divide_gpus((a, b), cluster64())
    assert division.feasible
    ratio = division.gpus_by_model["a"] / division.gpus_by_model["b"]
    assert ratio == pytest.approx(3.0, rel=0.2)
    assert division.num_gpus_used <= 64


def test_the_joint_objective_is_per_output_token_over_both_models():
    a = ModelDemand("a", example_at(150), example_profile())
    b = ModelDemand("b", example_at(50), example_profile())
    division = divide_gpus((a, b), cluster64())
    plans = division.plans_by_model
    tokens = {"a": 150.0, "b": 50.0}  # the same mix of lengths: token rates follow request rates
    joint = sum(tokens[n] * plans[n].avg_threshold for n in plans) / sum(tokens.values())
    assert division.objective.avg_threshold == pytest.approx(joint, abs=1e-6)
    for plan in plans.values():
        assert all(a.latency_s <= a.slo_s for a in plan.assignments)
        assert all(u <= 0.9 + 1e-6 for u in plan.utilization_by_tp.values())


def test_a_model_restricted_to_wide_degrees_gets_only_those():
    wide = ModelDemand("wide", example_at(20), example_profile(), tp_degrees=(4, 8))
    narrow = ModelDemand("narrow", example_at(20), example_profile())
    division = divide_gpus((wide, narrow), cluster64())
    assert set(division.instances_by_model_tp["wide"]) == {4, 8}
    assert division.gpus_by_model["wide"] > 0


def test_a_move_that_gains_only_slack_is_made_only_when_it_buys_more_than_it_costs(profile, cluster16):
    """At low load TP-4 gives the most slack and the running TP-1 shape already reaches the top
    threshold: the move buys slack only, and costs switch_s / period_s of the period's GPU-time (all 16
    GPUs restart), so it is made only when the slack it buys is larger."""
    running = tuple(Instance(f"node-{n}", 1, (g,)) for n in range(4) for g in range(4))
    cluster = cluster16.with_placement(running)
    names = {inst: "m" for inst in running}
    workload = make_workload(0.5)
    free = divide_gpus((ModelDemand("m", workload, profile),), cluster, running_models=names)
    assert {tp: n for tp, n in free.instances_by_model_tp["m"].items() if n} == {4: 4}
    period_s = Stage1Options().period_s

    def plan(switch_s: float):
        return divide_gpus((ModelDemand("m", workload, profile, switch_s=switch_s),), cluster, running_models=names)

    plans = [plan(switch_s) for switch_s in (5.0, 30.0, 120.0, 0.99 * period_s)]
    started = [sum(tp * n for tp, n in p.started_by_model["m"].items()) for p in plans]
    assert started[0] > 0, "a cheap move that buys slack is made"
    assert plans[0].switch_gpu_s == pytest.approx(5.0 * started[0])
    assert started == sorted(started, reverse=True), "dearer moves, no more of them"
    assert started[-1] == 0 and plans[-1].instances_by_model_tp["m"] == {1: 16, 2: 0, 4: 0}
    for p in plans:  # the quality is the same: the moves buy slack only
        assert p.objective.avg_threshold == pytest.approx(free.objective.avg_threshold)
        assert p.objective.slo_slack <= free.objective.slo_slack + 1e-9


def test_a_move_that_gains_quality_is_made_and_its_switch_time_counted(profile, cluster16):
    running = tuple(Instance(f"node-{n}", 4, (0, 1, 2, 3)) for n in range(4))
    cluster = cluster16.with_placement(running)
    names = {inst: "m" for inst in running}
    model = ModelDemand("m", make_workload(48), profile, switch_s=30.0)
    kept = divide_gpus((model,), cluster, fixed_instances={"m": {4: 4}}, running_models=names)
    moved = divide_gpus((model,), cluster, running_models=names)
    assert moved.objective.avg_threshold > (kept.objective.avg_threshold if kept.objective else 0.0)
    started = moved.started_by_model["m"]
    assert sum(started.values()) > 0
    assert moved.switch_gpu_s == pytest.approx(30.0 * sum(tp * n for tp, n in started.items()))
    # A switch that takes the whole period makes a started instance worth nothing in it.
    frozen = divide_gpus(
        (dataclasses.replace(model, switch_s=600.0),), cluster, Stage1Options(period_s=300.0), running_models=names
    )
    assert not frozen.feasible or sum(frozen.started_by_model["m"].values()) == 0 or (
        frozen.objective.avg_threshold <= moved.objective.avg_threshold + 1e-9
    )


def test_overload_falls_back_with_each_model_at_its_smallest_degree():
    a = ModelDemand("a", example_at(3000), example_profile())
    b = ModelDemand("b", example_at(1000), example_profile())
    division = divide_gpus((a, b), cluster64())
    assert not division.feasible and division.objective is None
    assert "each model at its smallest TP degree" in division.fallback_reason
    by_model = division.instances_by_model_tp
    assert {tp for m in by_model.values() for tp, n in m.items() if n} == {1}
    assert division.num_gpus_used == 64
    assert by_model["a"][1] / by_model["b"][1] == pytest.approx(3.0, rel=0.2)


def test_overload_starves_no_model_with_load():
    heavy = ModelDemand("heavy", example_at(3000), example_profile())
    light = ModelDemand("light", example_at(10), example_profile(), min_instances=0)
    division = divide_gpus((heavy, light), cluster64())
    assert not division.feasible
    assert division.instances_by_model_tp["light"][1] >= 1
    assert division.num_gpus_used == 64


def test_names_must_differ_and_no_model_is_refused():
    model = ModelDemand("m", example_at(1), example_profile())
    with pytest.raises(ValueError, match="distinct"):
        divide_gpus((model, model), cluster64())
    with pytest.raises(ValueError, match="at least one"):
        divide_gpus((), cluster64())


# --- Stage 2: every model's instances on the nodes ------------------------------------------------


def brute_force_max_kept(cluster: Cluster, running: dict[Instance, str], wanted: dict[str, dict[int, int]]) -> int:
    """Depth-first over candidate slots, each unused or serving one model: the most kept."""
    slots = candidate_slots(cluster)
    best = -1

    def visit(i: int, used: frozenset, remaining: dict[tuple[str, int], int], kept: int) -> None:
        nonlocal best
        if all(n == 0 for n in remaining.values()):
            best = max(best, kept)
            return
        if i == len(slots) or kept + sum(remaining.values()) <= best:
            return
        slot = slots[i]
        slot_gpus = {(slot.node, g) for g in slot.gpu_ids}
        if not slot_gpus & used:
            for (model, tp), n in remaining.items():
                if tp == slot.tp and n > 0:
                    gain = running.get(slot) == model
                    visit(i + 1, used | slot_gpus, {**remaining, (model, tp): n - 1}, kept + gain)
        visit(i + 1, used, remaining, kept)

    remaining = {(model, tp): n for model, by_tp in wanted.items() for tp, n in by_tp.items() if n}
    visit(0, frozenset(), remaining, 0)
    return best


def assert_valid(placement, cluster: Cluster, running: dict[Instance, str], wanted: dict[str, dict[int, int]]):
    targets = placement.target_instances_by_model()
    used = [(i.node, g) for insts in targets.values() for i in insts for g in i.gpu_ids]
    assert len(used) == len(set(used)), "a GPU is used twice"
    for model, insts in targets.items():
        assert Counter(i.tp for i in insts) == Counter({d: n for d, n in wanted.get(model, {}).items() if n})
    for model, plan in placement.by_model.items():
        kept_and_stopped = [i for n in plan.nodes for i in (*n.keep, *n.stop)]
        assert sorted(kept_and_stopped) == sorted(i for i, m in running.items() if m == model)


@st.composite
def two_model_scenario(draw):
    node_sizes = tuple(draw(st.lists(st.sampled_from([2, 4]), min_size=1, max_size=2)))
    degrees = (1, 2, 4) if max(node_sizes) >= 4 else (1, 2)
    cluster = Cluster(tuple(Node(f"node-{i}", tuple(range(s))) for i, s in enumerate(node_sizes)), degrees)
    slots = candidate_slots(cluster)
    running, used = {}, set()
    for slot in draw(st.permutations(slots)):
        slot_gpus = {(slot.node, g) for g in slot.gpu_ids}
        if not slot_gpus & used and draw(st.booleans()):
            running[slot] = draw(st.sampled_from(["a", "b"]))
            used |= slot_gpus
    wanted: dict[str, dict[int, int]] = {"a": {}, "b": {}}
    used = set()
    for slot in draw(st.permutations(slots)):
        slot_gpus = {(slot.node, g) for g in slot.gpu_ids}
        if not slot_gpus & used and draw(st.booleans()):
            model = draw(st.sampled_from(["a", "b"]))
            wanted[model][slot.tp] = wanted[model].get(slot.tp, 0) + 1
            used |= slot_gpus
    return cluster.with_placement(tuple(running)), running, wanted


@settings(max_examples=40, deadline=None)
@given(two_model_scenario())
def test_two_models_are_placed_validly_keeping_the_most(case):
    cluster, running, wanted = case
    placement = place_models(wanted, cluster, running)
    assert_valid(placement, cluster, running, wanted)
    assert placement.num_kept == brute_force_max_kept(cluster, running, wanted)


def test_a_slot_that_changes_model_is_a_stop_and_a_start():
    cluster = Cluster((Node("n", (0, 1)),), (1, 2))
    inst = Instance("n", 2, (0, 1))
    cluster = cluster.with_placement((inst,))
    placement = place_models({"a": {}, "b": {2: 1}}, cluster, {inst: "a"})
    assert placement.by_model["a"].nodes[0].stop == (inst,)
    assert placement.by_model["b"].nodes[0].start == (inst,)
    assert placement.num_kept == 0


def test_unplaceable_or_unnamed_is_refused():
    cluster = uniform_cluster(2, 4, (1, 2, 4))
    with pytest.raises(Stage2Infeasible):
        place_models({"a": {4: 2}, "b": {1: 1}}, cluster, {})
    running = cluster.with_placement((Instance("node-0", 1, (0,)),))
    with pytest.raises(ValueError, match="without a model"):
        place_models({"a": {1: 1}}, running, {})


def test_a_large_cluster_groups_its_nodes_and_keeps_what_runs():
    cluster = uniform_cluster(1024, 8, (1, 2, 4, 8))
    running = {Instance(f"node-{n}", 8, tuple(range(8))): "a" if n % 2 else "b" for n in range(512)}
    cluster = cluster.with_placement(tuple(running))
    wanted = {"a": {8: 256, 1: 1024}, "b": {4: 512, 2: 512}}
    placement = place_models(wanted, cluster, running)
    assert_valid(placement, cluster, running, wanted)
    assert placement.num_kept == 256  # every running TP-8 of "a"; "b"'s TP-8s become TP-4s and TP-2s


# --- both stages ------------------------------------------------------------------------------------


def test_plan_models_divides_places_and_scores_what_runs():
    cluster = cluster64()
    first = plan_models(
        (ModelDemand("a", example_at(30), example_profile(), min_instances=1),
         ModelDemand("b", example_at(90), example_profile(), min_instances=1)),
        cluster, {}, "plan-1",
    )
    targets = first.placement.target_instances_by_model()
    running = {inst: model for model, insts in targets.items() for inst in insts}
    flipped = (ModelDemand("a", example_at(90), example_profile(), switch_s=60.0, min_instances=1),
               ModelDemand("b", example_at(30), example_profile(), switch_s=60.0, min_instances=1))
    second = plan_models(flipped, cluster.with_placement(tuple(running)), running, "plan-2")
    assert second.division.gpus_by_model["a"] > second.division.gpus_by_model["b"]
    assert second.current is not None
    assert {m: {tp: n for tp, n in by_tp.items() if n} for m, by_tp in second.current.instances_by_model_tp.items()} == {
        m: dict(Counter(i.tp for i, n in running.items() if n == m)) for m in ("a", "b")
    }
    wanted = second.division.instances_by_model_tp
    assert_valid(second.placement, cluster.with_placement(tuple(running)), running, wanted)
    assert set(second.solve_s) == {"stage1", "stage2", "current"}
    assert json.dumps(second.to_dict())


def test_with_a_switch_cost_running_instances_are_kept_where_they_fit(profile, cluster16):
    running = (Instance("node-0", 2, (0, 1)), Instance("node-0", 2, (2, 3)), Instance("node-1", 4, (0, 1, 2, 3)))
    names = {inst: "a" for inst in running}
    cluster = cluster16.with_placement(running)

    def divide(switch_s: float):
        models = (ModelDemand("a", make_workload(0.5), profile, switch_s=switch_s),
                  ModelDemand("b", make_workload(0.2), profile, switch_s=switch_s))
        return divide_gpus(models, cluster, running_models=names)

    free, costly = divide(0.0), divide(100.0)
    assert free.instances_by_model_tp["a"][2] == 0  # free moves: the TP-2s give way to the best shape
    assert costly.instances_by_model_tp["a"][2] == 2 and costly.started_by_model["a"][2] == 0
    assert costly.instances_by_model_tp["a"][4] >= 1 and costly.num_gpus_used <= 16
    assert costly.switch_gpu_s == pytest.approx(
        100.0 * sum(tp * n for by_tp in costly.started_by_model.values() for tp, n in by_tp.items())
    )


def test_scoring_a_given_division_holds_an_idle_model_at_what_it_is_given():
    busy = ModelDemand("busy", example_at(40), example_profile())
    idle = ModelDemand("idle", example_at(0.0), example_profile(), min_instances=1)
    given = {"busy": {8: 6}, "idle": {8: 2}}
    scored = divide_gpus((busy, idle), cluster64(), fixed_instances=given)
    assert scored.instances_by_model_tp["idle"] == {1: 0, 2: 0, 4: 0, 8: 2}
    assert scored.instances_by_model_tp["busy"] == {1: 0, 2: 0, 4: 0, 8: 6}


@pytest.mark.parametrize("rps", [20.0, 120.0, 200.0])
def test_one_solve_at_the_top_reaches_the_two_solves_optimum(rps, monkeypatch):
    """Below overload Stage 1 solves once, over the options at each class's highest threshold; the
    plan scores what the two lexicographic solves over every option reach (200 rps: thresholds fall,
    so the two solves run)."""
    from services.reconfigurator.core import stage1

    demands = tuple(ModelDemand(f"m{i}", example_at(rps * share), example_profile(), switch_s=60.0, min_instances=1)
                    for i, share in enumerate((0.75, 0.25)))
    one = divide_gpus(demands, cluster64())
    monkeypatch.setattr(stage1, "_solve_at_the_top", lambda *_: None)
    two = divide_gpus(demands, cluster64())
    assert one.feasible and two.feasible
    assert one.objective.avg_threshold == pytest.approx(two.objective.avg_threshold, abs=1e-6)
    assert one.objective.slo_slack == pytest.approx(two.objective.slo_slack, abs=1e-5)
    assert (one.objective.avg_threshold == pytest.approx(0.9)) == (rps < 150)  # which path ran
