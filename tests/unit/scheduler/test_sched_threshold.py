"""Algorithm 1 and the remaining-step estimates."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.core import CacheMode, SchedulingLoop, StepOutcome, make_policy
from services.scheduler.core.threshold import (
    DEFAULT_THRESHOLDS,
    PredictionMode,
    StepEstimator,
    ThresholdController,
    ThresholdGrid,
)
from tests.unit.scheduler.sched_builders import make_request, make_view, step_result, uniform_prediction

# threshold -> (recompute, cache) steps; with a cache, recompute is replaced by the 8 blocks left
PREDICTION = {0.5: (8, 10), 0.6: (8, 15), 0.7: (8, 20), 0.8: (8, 30), 0.9: (8, 40), 0.95: (8, 60)}
# on an idle toy TP-1 instance: 8 * 0.1 s + cache * 0.01 s -> 0.9, 0.95, 1.0, 1.1, 1.2, 1.4 s


def first_threshold(profile, slo_s: float, policy: str = "dilaserve", budget_share: float = 1.0,
                    **request_fields) -> float:
    """Algorithm 1 as the paper states it (the whole budget) unless ``budget_share`` says otherwise, on
    a prediction made at arrival (the first step's own rule, ``unpredicted_at_max``, is off here:
    tested on its own below)."""
    loop = SchedulingLoop(make_policy(policy, {"budget_share": budget_share, "unpredicted_at_max": False}),
                          make_view(profile, [1]))
    request = make_request("r", slo_s=slo_s, **request_fields)
    request.record_prediction(uniform_prediction(PREDICTION))
    decisions = loop.on_arrival(0.0, request)
    (assignment,) = decisions.assignments
    return assignment.threshold


def test_highest_threshold_that_fits_is_chosen(profile):
    assert first_threshold(profile, slo_s=1.15) == 0.8
    assert first_threshold(profile, slo_s=1.25) == 0.9
    assert first_threshold(profile, slo_s=100.0) == 0.95


def test_budget_share_plans_against_part_of_the_budget(profile):
    assert first_threshold(profile, slo_s=1.25 / 0.6, budget_share=0.6) == 0.9  # plans against 1.25 s
    assert first_threshold(profile, slo_s=1.15 / 0.6, budget_share=0.6) == 0.8
    assert first_threshold(profile, slo_s=1.25 / 0.6, budget_share=1.0) == 0.95


def test_lowest_allowed_threshold_when_none_fits(profile):
    assert first_threshold(profile, slo_s=0.5) == 0.5


def test_quality_floor_is_never_crossed(profile):
    assert first_threshold(profile, slo_s=0.5, min_threshold=0.7) == 0.7
    assert first_threshold(profile, slo_s=100.0, max_threshold=0.8) == 0.8


def test_no_loadctl_ablation_uses_algorithm_1_alone(profile):
    assert first_threshold(profile, slo_s=1.15, policy="dilaserve-no-loadctl") == 0.8



def test_a_request_runs_its_first_step_at_its_allowed_maximum_and_is_planned_from_its_first_prediction(profile):
    """The fallback counts every canvas position (an upper bound), and a prediction made at arrival
    has not seen the model read the canvas: on either, Algorithm 1 would lower the threshold of the
    step that decides a short answer. The prediction made after the first step plans the rest."""
    loop = SchedulingLoop(make_policy("dilaserve", {"budget_share": 1.0}), make_view(profile, [1]))
    (assignment,) = loop.on_arrival(0.0, make_request("r", slo_s=0.5)).assignments
    assert assignment.threshold == 0.95  # nothing fits 0.5 s on the fallback, yet the first step is the top
    predicted = make_request("p", slo_s=0.5)
    predicted.record_prediction(uniform_prediction(PREDICTION))  # asked at arrival, as live
    (assignment,) = SchedulingLoop(make_policy("dilaserve", {"budget_share": 1.0}),
                                   make_view(profile, [1])).on_arrival(0.0, predicted).assignments
    assert assignment.threshold == 0.95
    assert first_threshold(profile, slo_s=0.5) == 0.5  # the rule off: Algorithm 1's choice
    blind = SchedulingLoop(make_policy("dilaserve", {"budget_share": 1.0, "unpredicted_at_max": False}),
                           make_view(profile, [1]))
    (assignment,) = blind.on_arrival(0.0, make_request("r", slo_s=0.5)).assignments
    assert assignment.threshold == 0.5
    result = step_result("i0", StepOutcome("r", 1, recompute=True, prediction=uniform_prediction(PREDICTION, 1)))
    (assignment,) = loop.on_step_result(0.1, result).assignments
    assert assignment.threshold == 0.5

def test_estimate_counts_recompute_and_cache_steps_apart():
    choice = ThresholdController.choose([2, 2, 2], [10, 20, 40], alpha_s=0.5, beta_s=0.01, budget_s=1.25, lo=0, hi=2)
    assert choice.index == 1 and choice.fits
    assert abs(choice.estimated_s - (2 * 0.5 + 20 * 0.01)) < 1e-12


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.integers(0, 200), min_size=6, max_size=6),
    budget=st.floats(0.0, 5.0),
    floor=st.sampled_from([0.0, 0.55, 0.7, 0.85, 0.9, 0.95]),
    ceiling=st.sampled_from([0.95, 0.9, 0.8, 0.75]),
)
def test_choice_respects_range_and_picks_highest_fitting(steps, budget, floor, ceiling):
    grid = ThresholdGrid(DEFAULT_THRESHOLDS)
    lo, hi = grid.floor_index(floor), grid.ceil_index(ceiling)
    if lo > hi:
        return
    recompute = [3.0] * 6
    choice = ThresholdController.choose(recompute, steps, 0.05, 0.01, budget, lo, hi)
    assert lo <= choice.index <= hi
    assert floor - 1e-9 <= grid.values[choice.index] <= ceiling + 1e-9
    fitting = [i for i in range(lo, hi + 1) if 3 * 0.05 + steps[i] * 0.01 <= budget]
    assert choice.index == (max(fitting) if fitting else lo)
    assert choice.fits == bool(fitting)


def test_fallback_without_prediction_uses_tokens_per_step():
    grid = ThresholdGrid((0.5, 0.9))
    estimator = StepEstimator(grid, {0.5: 8.0, 0.9: 2.0})
    request = make_request("r", gen_len=64, block_len=32)
    recompute, cache = estimator.estimate(request)
    # 64 tokens: 8 steps at 0.5, 32 at 0.9; 2 blocks -> 2 recompute steps
    assert list(recompute) == [2, 2] and list(cache) == [6, 30]


def test_no_cache_counts_every_step_as_full():
    estimator = StepEstimator(ThresholdGrid((0.5, 0.9)), {0.5: 8.0, 0.9: 2.0})
    recompute, cache = estimator.estimate(make_request("r", gen_len=64, cache_mode=CacheMode.NONE))
    assert list(recompute) == [8, 32] and list(cache) == [0, 0]


def test_online_prediction_ages_with_progress_and_oneshot_scales():
    grid = ThresholdGrid((0.5, 0.9))
    request = make_request("r", gen_len=64, block_len=64)
    request.record_prediction(uniform_prediction({0.5: (1, 9), 0.9: (1, 29)}))
    for _ in range(4):
        request.record_step(8, block_done=False)  # 32 of 64 tokens, 4 steps, inside block 0
    online = StepEstimator(grid, {0.5: 8.0, 0.9: 2.0}, PredictionMode.ONLINE)
    oneshot = StepEstimator(grid, {0.5: 8.0, 0.9: 2.0}, PredictionMode.ONESHOT)
    rec, cache = online.estimate(request)
    assert list(rec + cache) == [6, 26]  # 10 - 4, 30 - 4
    rec, cache = oneshot.estimate(request)
    assert list(rec + cache) == [5, 15]  # half of the arrival prediction
    assert list(rec) == [0, 0]  # block 0 already started, no later block


def test_fresh_prediction_changes_the_threshold_at_the_next_step(profile):
    loop = SchedulingLoop(make_policy("dilaserve"), make_view(profile, [1]))
    request = make_request("r", slo_s=1.15)
    request.record_prediction(uniform_prediction(PREDICTION))
    loop.on_arrival(0.0, request)
    pessimistic = {t: (8, 200) for t in PREDICTION}
    pessimistic[0.5] = (8, 5)
    result = step_result("i0", StepOutcome("r", 1, recompute=True, prediction=uniform_prediction(pessimistic, 1)))
    (assignment,) = loop.on_step_result(0.1, result).assignments
    assert assignment.threshold == 0.5


def test_grid_helpers():
    grid = ThresholdGrid((0.9, 0.5, 0.7))
    assert grid.values == (0.5, 0.7, 0.9)
    assert grid.floor_index(0.6) == 1 and grid.ceil_index(0.8) == 1
    assert grid.nearest_index(0.88, 0, 2) == 2 and grid.nearest_index(0.9, 0, 1) == 1
    assert np.allclose(grid.array, [0.5, 0.7, 0.9])


def test_oneshot_ablation_ignores_later_predictions(profile):
    loop = SchedulingLoop(make_policy("dilaserve-oneshot", {"budget_share": 1.0}), make_view(profile, [1]))
    request = make_request("r", slo_s=1.15)
    request.record_prediction(uniform_prediction(PREDICTION))
    loop.on_arrival(0.0, request)
    pessimistic = uniform_prediction({t: (8, 200) for t in PREDICTION}, 1)
    result = step_result("i0", StepOutcome("r", 1, recompute=True, prediction=pessimistic))
    (assignment,) = loop.on_step_result(0.1, result).assignments
    assert assignment.threshold > 0.5  # still planned from the arrival prediction


def test_quality_budget_keeps_thresholds_from_the_top_down():
    from services.scheduler.core.threshold import within_quality_budget

    curve = {0.5: 0.71, 0.6: 0.85, 0.7: 0.9925, 0.8: 0.9975, 0.9: 0.9975}
    assert within_quality_budget((0.5, 0.6, 0.7, 0.8, 0.9), curve, 1.0) == (0.7, 0.8, 0.9)
    assert within_quality_budget((0.5, 0.6, 0.7, 0.8, 0.9), curve, 0.0) == (0.8, 0.9)
    assert within_quality_budget((0.5, 0.6, 0.7, 0.8, 0.9), curve, 30.0) == (0.5, 0.6, 0.7, 0.8, 0.9)
    # a noisy dip stops the walk: nothing below a threshold that loses too much
    assert within_quality_budget((0.5, 0.6, 0.7, 0.9), {0.5: 1.0, 0.6: 0.9, 0.7: 1.0, 0.9: 1.0}, 1.0) == (0.7, 0.9)


def test_quality_budget_errors_name_what_is_missing():
    import pytest

    from services.scheduler.core.threshold import within_quality_budget

    with pytest.raises(ValueError, match=r"0\.6"):
        within_quality_budget((0.6, 0.9), {0.9: 1.0}, 1.0)
    with pytest.raises(ValueError, match="budget"):
        within_quality_budget((0.9,), {0.9: 1.0}, -1.0)


def test_recompute_steps_follow_the_prediction_when_answers_stop_early():
    """A 128-token canvas in blocks of 8 has 16 blocks, but a short answer stops at its EOS block:
    the predicted recompute steps stand (not one per block left), within the counters' bounds."""
    grid = ThresholdGrid((0.5, 0.9))
    estimator = StepEstimator(grid, {0.5: 8.0, 0.9: 2.0})
    request = make_request("r", gen_len=128, block_len=8)
    request.record_prediction(uniform_prediction({0.5: (2, 1), 0.9: (2, 6)}))
    recompute, cache = estimator.estimate(request)
    assert list(recompute) == [2, 2] and list(cache) == [1, 6]
    request.record_prediction(uniform_prediction({0.5: (0, 1), 0.9: (40, 6)}))
    recompute, _ = estimator.estimate(request)
    assert list(recompute) == [1, 16]  # the next step starts block 0; at most the 16 blocks left
    recompute, cache = StepEstimator(grid, {0.5: 8.0, 0.9: 2.0}).estimate(make_request("s", gen_len=128, block_len=8))
    assert list(recompute) == [16, 16]  # no prediction yet: every block left (an upper bound)


def test_plan_once_keeps_the_first_choice_and_load_control_caps_it(profile):
    """The load-control experiment's ablation: Algorithm 1 once per request; a fresh (pessimistic)
    prediction does not move the threshold, while load control's cap still lowers it at a step."""
    pessimistic = {t: (8, 200) for t in PREDICTION}
    pessimistic[0.5] = (8, 5)

    def threshold_after_a_step(policy: str, overrides: dict) -> tuple[float, float]:
        loop = SchedulingLoop(make_policy(policy, {"budget_share": 1.0, "unpredicted_at_max": False, **overrides}),
                              make_view(profile, [1]))
        request = make_request("r", slo_s=1.15)
        request.record_prediction(uniform_prediction(PREDICTION))
        (first,) = loop.on_arrival(0.0, request).assignments
        result = step_result("i0", StepOutcome("r", 1, recompute=True, prediction=uniform_prediction(pessimistic, 1)))
        (after,) = loop.on_step_result(0.1, result).assignments
        return first.threshold, after.threshold

    assert threshold_after_a_step("dilaserve", {}) == (0.8, 0.5)  # per step: re-planned
    assert threshold_after_a_step("dilaserve", {"plan_once": True}) == (0.8, 0.8)  # planned once: kept

    # overload (7 requests on one instance, as in test_sched_load): the planned threshold is capped
    loop = SchedulingLoop(make_policy("dilaserve", {"plan_once": True}), make_view(profile, [1]))
    decisions = loop.on_arrivals(0.0, [make_request(f"r{i}", slo_s=2.0) for i in range(7)])
    assert all(a.threshold <= a.max_allowed_threshold for a in decisions.assignments)
    assert decisions.assignments[-1].threshold == 0.5
    # a cap that lifts gives the planned threshold back (indices into the candidates)
    policy, request = loop.policy, make_request("late", slo_s=2.0)
    assert policy._planned_once([request], np.array([4]), np.array([0]), np.array([2])).tolist() == [2]
    assert policy._planned_once([request], np.array([0]), np.array([0]), np.array([5])).tolist() == [4]
