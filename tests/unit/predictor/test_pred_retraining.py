"""Retraining on served requests: states rebuilt from stored steps are collection's rows, the window is
bounded, the holdout is the most recent requests, and a new model replaces the serving one only where
it is better on them (real LightGBM)."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from services.predictor.core.predictor import BoundPredictor, RemainingSteps, StepPrediction
from services.predictor.core.retraining import (
    LiveError,
    RetrainConfig,
    ServedWindow,
    error_of,
    not_ready,
    relative_errors,
    retrain,
    split,
)
from services.predictor.core.served import UnusableSteps, states_from_steps
from services.predictor.core.training import TrainParams
from services.predictor.traces import trace_row
from shared.state import RequestStatus
from tests.unit.predictor.served_builders import served_run, served_states

FAST = RetrainConfig(window_rows=10_000, min_rows=20, holdout_share=0.25,
                     params=TrainParams(num_rounds=30, min_data_in_leaf=3))


class ConstantPredictor:
    """Every request has ``steps`` steps left, whatever its state (a model for another workload)."""

    def __init__(self, steps: float) -> None:
        self.steps = steps
        self.asked_ids: set[str] = set()  # request ids it was asked about

    def predict(self, queries, thresholds):
        self.asked_ids.update(q.request_id for q in queries)
        return [StepPrediction(q.request_id, q.num_steps_done,
                               {float(t): RemainingSteps(0.0, self.steps) for t in thresholds}) for q in queries]


class Oracle:
    """Knows the steps that remained at every state: no new model can beat it."""

    def __init__(self, requests) -> None:
        # (request id, steps done, threshold) -> steps that remained
        self.key_to_steps = {(s.query.request_id, s.query.num_steps_done, s.threshold): s.remaining_steps
                             for states in requests for s in states}

    def predict(self, queries, thresholds):
        return [StepPrediction(q.request_id, q.num_steps_done, {float(t): RemainingSteps(
            0.0, float(self.key_to_steps[q.request_id, q.num_steps_done, t])) for t in thresholds}) for q in queries]


def _nan_free(row: dict) -> dict:
    return {k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}


# --- states from stored steps ----------------------------------------------------------------------


@pytest.mark.parametrize("switch_fraction", [0.0, 0.6])
def test_states_from_stored_steps_are_the_rows_collection_writes(switch_fraction):
    engine, rows = served_run(30, switch_fraction=switch_fraction)
    rid_to_rows: dict[str, list[dict]] = {}  # request id -> its trace rows
    for row in rows:
        rid_to_rows.setdefault(row["request_id"], []).append(row)
    assert any(r["switched"] for r in rows) == (switch_fraction > 0)
    assert any(not math.isnan(r["end_blocks_left"]) for r in rows)  # predicted_end came through the records
    for rid, expected in rid_to_rows.items():
        meta = expected[0]
        states = states_from_steps(engine.record(rid), engine.rid_to_steps[rid])
        rebuilt = [trace_row(s, meta["seed"], meta["family"], meta["num_shots"], meta["cache_mode"]) for s in states]
        assert [_nan_free(r) for r in rebuilt] == [_nan_free(r) for r in expected], rid


def test_steps_that_do_not_describe_a_finished_run_are_refused():
    engine, rows = served_run(3)
    rid = rows[0]["request_id"]
    record, steps = engine.record(rid), engine.rid_to_steps[rid]
    with pytest.raises(UnusableSteps, match="not finished"):
        states_from_steps(msgspec.structs.replace(record, status=RequestStatus.RUNNING), steps)
    with pytest.raises(UnusableSteps, match="do not match"):
        states_from_steps(record, steps[:-1])
    with pytest.raises(UnusableSteps, match="do not match"):
        states_from_steps(record, [*steps, steps[-1]])
    assert states_from_steps(record, list(reversed(steps))) == states_from_steps(record, steps)  # order as stored


# --- window, holdout, readiness ----------------------------------------------------------------------


def test_window_keeps_the_most_recent_requests_whole_within_its_rows():
    requests = served_states(40)
    window = ServedWindow(max_rows=60)
    for states in requests:
        window.add(states)
        assert window.num_rows <= 60 or window.num_requests == 1
    kept = window.snapshot()
    assert kept == [tuple(s) for s in requests[-len(kept):]]  # the newest, in order
    assert window.num_rows == sum(len(r) for r in kept) and window.num_added == 40
    assert sum(len(r) for r in requests[-len(kept) - 1:]) > 60  # one more would not fit
    window.add([])  # a request with no labelled state adds nothing
    assert window.num_added == 40
    big = ServedWindow(max_rows=2)
    big.add(requests[0] * 3)
    assert big.num_requests == 1  # a request larger than the window is kept alone


def test_holdout_is_the_most_recent_requests():
    requests = served_states(40)
    train, holdout = split(requests, 0.25)
    total = sum(len(r) for r in requests)
    assert len(train) + len(holdout) == total and 0 < len(holdout) <= 0.25 * total
    holdout_ids = [s.query.request_id for s in holdout]
    newest = [s.query.request_id for r in requests[-len(set(holdout_ids)):] for s in r]
    assert holdout_ids == newest
    assert not set(holdout_ids) & {s.query.request_id for s in train}
    _, one = split(requests[:2], 0.01)  # at least one request is held out, at least one trains
    assert {s.query.request_id for s in one} == {requests[1][0].query.request_id}


def test_a_retrain_waits_for_rows_and_for_new_requests():
    requests = served_states(20)
    window = ServedWindow(10_000)
    assert "0 rows" in not_ready(window, FAST, 0)
    for states in requests:
        window.add(states)
    assert not_ready(window, FAST, 0) is None
    assert "no request finished" in not_ready(window, FAST, window.num_added)
    assert "rows" in not_ready(window, RetrainConfig(min_rows=10 ** 6), 0)
    with pytest.raises(ValueError, match="holdout_share"):
        RetrainConfig(holdout_share=1.0)


# --- the retrain decision -----------------------------------------------------------------------------


def test_a_better_model_replaces_the_serving_one_scored_on_the_holdout():
    requests = served_states(60)
    serving = ConstantPredictor(40.0)  # a model of another workload: far too many steps
    outcome = retrain(requests, serving, FAST, card={"made_at": 1.0})
    _, holdout = split(requests, FAST.holdout_share)
    assert serving.asked_ids == {s.query.request_id for s in holdout}  # scored on the most recent only
    assert (outcome.num_holdout_rows, outcome.num_rows) == (len(holdout), sum(len(r) for r in requests))
    assert outcome.swapped and outcome.new_error < outcome.old_error
    assert outcome.old_error == pytest.approx(error_of(ConstantPredictor(40.0), holdout)["mre"])
    card = outcome.model.card
    assert card["error"]["overall"]["mre"] == outcome.new_error and card["made_at"] == 1.0
    assert card["training"]["num_rows"] == outcome.num_train_rows
    assert card["replaced"] == {"mre": outcome.old_error, "swapped": True}


def test_the_serving_model_stays_where_the_new_one_is_not_better():
    requests = served_states(60)
    outcome = retrain(requests, Oracle(requests), FAST)
    assert outcome.old_error == 0.0 and outcome.new_error > 0.0 and not outcome.swapped


def test_the_bound_of_an_uncalibrated_model_is_replaced_by_the_first_model_that_beats_it():
    requests = served_states(60, thresholds=(0.5, 0.6))  # low thresholds: several positions a step
    outcome = retrain(requests, BoundPredictor(), FAST)
    assert outcome.swapped and outcome.new_error < outcome.old_error


def test_live_error_is_the_mean_over_the_most_recent_rows():
    requests = served_states(10)
    live = LiveError(max_rows=3)
    assert live.mre is None
    errors = relative_errors(ConstantPredictor(1.0), requests[0])
    actual = np.array([s.remaining_steps for s in requests[0]], dtype=float)
    np.testing.assert_allclose(errors, np.abs(1.0 - actual) / actual)
    live.observe([0.5, 0.5, 0.5, 0.1, 0.2])
    assert live.num_rows == 3 and live.mre == pytest.approx((0.5 + 0.1 + 0.2) / 3)  # the last three
