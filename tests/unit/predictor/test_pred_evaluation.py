import numpy as np
import pytest

from services.predictor.core.evaluation import (
    aged_one_shot,
    choose_granularity,
    error_table,
    errors,
    granularity_study,
    replay_policy,
)
from services.predictor.core.policy import UpdatePolicy


def test_errors_and_table():
    predicted, actual = np.array([2.0, 3.0, 1.0]), np.array([1.0, 3.0, 2.0])
    assert errors(predicted, actual) == pytest.approx({"num_rows": 3, "mae": 2 / 3, "mre": 0.5, "total_ratio": 1.0})
    assert errors(np.array([1.0, 1.0]), np.array([2.0, 6.0]))["total_ratio"] == pytest.approx(0.25)  # biased low
    table = error_table(predicted, actual, np.array([0.5, 0.9, 0.9]))
    assert table["by_threshold"]["0.5"]["mre"] == pytest.approx(1.0)
    assert table["by_threshold"]["0.9"]["mre"] == pytest.approx(0.25)


def test_aged_one_shot_keeps_one_step():
    np.testing.assert_array_equal(aged_one_shot(np.array([5.0, 5.0]), np.array([2, 7])), [3.0, 1.0])


def test_replay_ages_the_last_prediction_between_updates():
    ids = ["a"] * 4 + ["b"] * 2
    steps = np.array([0, 1, 2, 3, 0, 1])
    progress = np.array([0.0, 0.1, 0.2, 0.3, 0.0, 0.5])
    fresh = np.array([6.0, 4.0, 3.0, 1.0, 2.0, 1.0])
    estimates, num_updates = replay_policy(UpdatePolicy.parse("steps:2"), ids, steps, progress, fresh)
    # a updates at steps 0 and 2; b (a new request) updates at its first row only
    np.testing.assert_array_equal(estimates, [6.0, 5.0, 3.0, 2.0, 2.0, 1.0])
    assert num_updates == 3
    per_step, n = replay_policy(UpdatePolicy.parse("step"), ids, steps, progress, fresh)
    np.testing.assert_array_equal(per_step, fresh)
    assert n == 6


def test_choose_the_cheapest_within_tolerance():
    results = [
        {"granularity": "step", "mre": 0.10, "num_updates": 100, "relative_error_vs_per_step": 0.0},
        {"granularity": "steps:2", "mre": 0.104, "num_updates": 50, "relative_error_vs_per_step": 0.04},
        {"granularity": "steps:4", "mre": 0.2, "num_updates": 25, "relative_error_vs_per_step": 1.0},
    ]
    assert choose_granularity(results)["granularity"] == "steps:2"
    assert choose_granularity(results, tolerance=0.01)["granularity"] == "step"


def test_study_reports_choice_and_saved_cost():
    ids = ["a"] * 4
    steps, progress = np.arange(4), np.array([0.0, 0.25, 0.5, 0.75])
    actual = np.array([4.0, 3.0, 2.0, 1.0])
    study = granularity_study(ids, steps, progress, actual.copy(), actual, ("step", "steps:2", "oneshot"))
    assert study["chosen"] == "oneshot"  # exact predictions age perfectly: one update suffices
    assert study["relative_error_vs_per_step"] == 0.0
    assert study["cost_saved"] == pytest.approx(0.75)
