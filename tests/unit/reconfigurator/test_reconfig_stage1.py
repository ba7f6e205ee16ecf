"""Stage 1: the shape follows the load, the plan respects its constraints, infeasibility falls back."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.reconfigurator.core.latency import predicted_steps, request_latency_s
from services.reconfigurator.core.spec import RequestClass, StepCounts, Workload, uniform_cluster
from services.reconfigurator.core.stage1 import Stage1Options, solve_stage1
from tests.unit.reconfigurator.reconfig_builders import make_workload

SWEEP_RPS = (0.5, 4, 16, 32, 48, 64, 80, 96, 112)


def gpus_at(plan, tp: int) -> int:
    return tp * plan.instances_by_tp.get(tp, 0)


def mean_tp_degree(plan) -> float:
    """GPU-weighted mean TP degree of the plan's instances."""
    return sum(tp * tp * n for tp, n in plan.instances_by_tp.items()) / plan.num_gpus_used


@pytest.fixture
def sweep(profile, cluster16):
    return [solve_stage1(make_workload(rps), cluster16, profile) for rps in SWEEP_RPS]


def test_low_rate_picks_highest_tp_and_highest_threshold(profile, cluster16):
    plan = solve_stage1(make_workload(0.5), cluster16, profile)
    assert plan.feasible
    assert {tp: n for tp, n in plan.instances_by_tp.items() if n} == {4: 4}
    assert plan.avg_threshold == pytest.approx(0.9)
    assert all(a.threshold == 0.9 for a in plan.assignments)


def test_rising_rate_moves_to_tp1_and_lower_thresholds(sweep):
    assert all(plan.feasible for plan in sweep)
    thresholds = [plan.avg_threshold for plan in sweep]
    # More load only tightens the stability constraints, so the best average threshold never rises.
    assert all(later <= earlier + 1e-6 for earlier, later in zip(thresholds, thresholds[1:], strict=False))
    assert thresholds[0] == pytest.approx(0.9)
    assert thresholds[-1] < 0.9 - 0.05
    low, mid, high = sweep[0], sweep[len(sweep) // 2], sweep[-1]
    assert gpus_at(low, 1) == 0
    assert 0 < gpus_at(mid, 1) <= gpus_at(high, 1) == 16
    assert mean_tp_degree(low) > mean_tp_degree(mid) > mean_tp_degree(high) == 1


def test_plan_respects_slo_stability_and_batch_choice(sweep):
    for plan in sweep:
        shares_by_class: dict[str, float] = defaultdict(float)  # class -> total share
        for a in plan.assignments:
            assert a.latency_s <= a.slo_s
            assert a.batch == plan.batch_by_tp[a.tp], "one batch size per degree"
            assert plan.instances_by_tp[a.tp] > 0
            shares_by_class[a.class_name] += a.share
        assert all(total == pytest.approx(1.0, abs=1e-5) for total in shares_by_class.values())
        assert all(u <= 0.9 + 1e-6 for u in plan.utilization_by_tp.values())


def test_degrees_without_work_get_no_instances(profile, cluster16):
    workload = Workload(classes=(RequestClass("only", 256, 192, 0.5),), slo_s=4.0)
    plan = solve_stage1(workload, cluster16, profile)
    assert {tp: n for tp, n in plan.instances_by_tp.items() if n} == {4: 4}


def test_spare_gpus_are_filled_without_exceeding_the_cluster(profile, cluster16):
    plan = solve_stage1(make_workload(1.0), cluster16, profile)
    assert plan.num_gpus_used == 16


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rps=st.floats(0.0, 400.0), num_nodes=st.integers(1, 5), gpus_per_node=st.sampled_from([1, 2, 4, 6, 8]))
def test_never_plans_more_gpus_than_exist(profile, rps, num_nodes, gpus_per_node):
    degrees = tuple(d for d in (1, 2, 4) if d <= gpus_per_node)
    cluster = uniform_cluster(num_nodes, gpus_per_node, degrees)
    plan = solve_stage1(make_workload(rps), cluster, profile)
    assert plan.num_gpus_used <= cluster.num_gpus
    for tp, n in plan.instances_by_tp.items():
        assert n <= cluster.num_slots(tp)


def test_overload_falls_back_to_all_tp1_with_reason(profile, cluster16):
    plan = solve_stage1(make_workload(1000.0), cluster16, profile)
    assert not plan.feasible
    assert plan.objective is None
    assert {tp: n for tp, n in plan.instances_by_tp.items() if n} == {1: 16}
    assert "fell back to all TP-1" in plan.fallback_reason
    assert "offered load" in plan.fallback_reason and "the cluster has 16" in plan.fallback_reason


def test_unmeetable_slo_falls_back_and_names_the_class(profile, cluster16):
    workload = Workload(classes=(RequestClass("impatient", 256, 256, 1.0, slo_s=0.01),))
    plan = solve_stage1(workload, cluster16, profile)
    assert not plan.feasible
    assert plan.instances_by_tp[1] == 16
    assert "class 'impatient' cannot meet its SLO" in plan.fallback_reason


def test_fixed_shape_is_scored_or_rejected(profile, cluster16):
    workload = make_workload(16)
    roomy = solve_stage1(workload, cluster16, profile, fixed_instances_by_tp={1: 16})
    assert roomy.feasible and roomy.instances_by_tp == {1: 16, 2: 0, 4: 0}
    best = solve_stage1(workload, cluster16, profile)
    assert best.objective.slo_slack >= roomy.objective.slo_slack - 1e-6
    too_small = solve_stage1(workload, cluster16, profile, fixed_instances_by_tp={1: 1})
    assert too_small.objective is None and "cannot serve" in too_small.fallback_reason


def test_no_classes_gives_the_lowest_latency_shape(profile, cluster16):
    plan = solve_stage1(Workload(classes=()), cluster16, profile)
    assert plan.instances_by_tp[4] == 4


def test_recompute_and_cache_steps_are_costed_apart(profile):
    request_class = RequestClass(
        "c", 256, 256, 1.0, steps_by_threshold={0.9: StepCounts(recompute=8, cache=100)}
    )
    steps = predicted_steps(Workload(classes=(request_class,)), request_class, 0.9)
    assert steps == StepCounts(8, 100)
    latency = request_latency_s(profile, request_class, steps, tp=1, batch=1)
    assert latency == pytest.approx(8 * profile.alpha(1, 1) * (512 / 512) + 100 * profile.beta(1, 1))


def test_default_steps_grow_with_threshold_and_cache_off_makes_all_recompute():
    request_class = RequestClass("c", 100, 256, 1.0)
    cached = Workload(classes=(request_class,), block_length=32)
    low, high = predicted_steps(cached, request_class, 0.5), predicted_steps(cached, request_class, 0.9)
    assert low.recompute == high.recompute == 8  # one per block
    assert high.cache > low.cache
    uncached = Workload(classes=(request_class,), block_length=32, kv_cache=False)
    steps = predicted_steps(uncached, request_class, 0.9)
    assert steps.cache == 0 and steps.recompute == high.total


def test_options_pass_through(profile, cluster16):
    strict = Stage1Options(max_utilization=0.5)
    loose = solve_stage1(make_workload(48), cluster16, profile)
    tight = solve_stage1(make_workload(48), cluster16, profile, strict)
    assert all(u <= 0.5 + 1e-6 for u in tight.utilization_by_tp.values())
    assert tight.avg_threshold is None or tight.avg_threshold <= loose.avg_threshold + 1e-6


def test_a_kv_budget_keeps_each_batch_within_its_degrees_memory(profile, cluster16):
    import dataclasses

    profile = dataclasses.replace(profile, kv_bytes_per_token=512 * 1024)
    budget = 1 << 30  # 1 GiB per GPU: 2,048 tokens at TP-1 (four 512-token requests), 4,096 at TP-2
    free = solve_stage1(make_workload(56), cluster16, profile)
    bound = solve_stage1(make_workload(56), cluster16, profile, Stage1Options(kv_budget_bytes=budget))
    assert free.feasible and bound.feasible
    longest = 256 + 256
    assert any(a.batch * longest > profile.kv_tokens(a.tp, budget) for a in free.assignments)
    for a in bound.assignments:
        assert a.batch * longest <= profile.kv_tokens(a.tp, budget)
    assert bound.avg_threshold < free.avg_threshold  # memory costs quality at this load
