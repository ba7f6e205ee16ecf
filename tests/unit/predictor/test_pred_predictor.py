import random

import pytest

from services.predictor.core.loading import load_predictor, predictor_dir
from services.predictor.core.policy import Granularity, UpdateMark, UpdatePolicy
from services.predictor.core.predictor import (
    InProcessPredictor,
    OneShotPredictor,
    PredictionQuery,
    RemainingSteps,
    StepPrediction,
)
from services.predictor.core.updater import PredictionUpdater
from shared.tasks import TaskGenerator
from tests.unit.predictor.pred_builders import FakeEngine, tiny_model

THRESHOLDS = (0.5, 0.7, 0.9)
CONF = (0.3, 0.4, 0.5, 0.5, 0.6)


def _query(request_id="a", steps=2, committed=6, uses_cache=True) -> PredictionQuery:
    return PredictionQuery(request_id, steps, 16, 30, 8, committed, committed % 8, 8, CONF, uses_cache)


def test_one_batched_call_equals_single_calls(tmp_path):
    predictor = InProcessPredictor(tiny_model(tmp_path))
    queries = [_query("a"), _query("b", 4, 10), PredictionQuery.arriving("c", 16, 12, 8)]
    batched = predictor.predict(queries, THRESHOLDS)
    assert [p.request_id for p in batched] == ["a", "b", "c"]
    for query, prediction in zip(queries, batched, strict=True):
        single = predictor.predict([query], THRESHOLDS)[0]
        assert prediction == single
        assert set(prediction.threshold_to_steps) == set(THRESHOLDS)
        assert prediction.made_at_step == query.num_steps_done
    assert predictor.predict([], THRESHOLDS) == []


def test_remaining_steps_split_and_tuple_shape(tmp_path):
    prediction = InProcessPredictor(tiny_model(tmp_path)).predict([_query()], THRESHOLDS)[0]
    for steps in prediction.threshold_to_steps.values():
        recompute, cache = steps  # the scheduler reads (recompute, cache) pairs
        assert recompute >= 0 and cache >= 0 and steps.total >= 1


def test_totals_never_fall_as_the_threshold_rises(tmp_path):
    thresholds = (0.95, 0.5, 0.8, 0.6, 0.9, 0.7)  # any order
    predictor = InProcessPredictor(tiny_model(tmp_path))
    queries = [_query("a", 0, 0), _query("b", 3, 9), PredictionQuery.arriving("c", 16, 40, 8)]
    for prediction in predictor.predict(queries, thresholds):
        totals = [prediction.threshold_to_steps[t].total for t in sorted(thresholds)]
        assert all(b >= a - 1e-9 for a, b in zip(totals, totals[1:], strict=False))


def test_without_cache_every_step_is_recompute(tmp_path):
    prediction = InProcessPredictor(tiny_model(tmp_path)).predict([_query(uses_cache=False)], THRESHOLDS)[0]
    assert all(s.cache_steps == 0 for s in prediction.threshold_to_steps.values())


def test_one_shot_ages_the_arrival_estimate(tmp_path):
    predictor = OneShotPredictor(tiny_model(tmp_path, "arrival"))
    at_arrival = predictor.predict([PredictionQuery.arriving("a", 16, 30, 8)], THRESHOLDS)[0]
    later = predictor.predict([_query("a", steps=2)], THRESHOLDS)[0]
    assert later.made_at_step == 2
    for tau in THRESHOLDS:
        expected = max(at_arrival.threshold_to_steps[tau].total - 2, 1.0)
        assert later.threshold_to_steps[tau].total == pytest.approx(expected)


class _RecordingPredictor:
    def __init__(self):
        self.calls = []

    def predict(self, queries, thresholds):
        self.calls.append(([q.request_id for q in queries], tuple(thresholds)))
        return [StepPrediction(q.request_id, q.num_steps_done, {t: RemainingSteps(1, 1) for t in thresholds})
                for q in queries]


def test_updater_batches_due_requests_into_one_call():
    recorder = _RecordingPredictor()
    updater = PredictionUpdater(recorder, UpdatePolicy(Granularity.STEPS, 2), THRESHOLDS)
    first = updater.update([_query("a", 0, 0), _query("b", 0, 0)])
    assert [p.request_id for p in first] == ["a", "b"]
    assert recorder.calls == [(["a", "b"], THRESHOLDS)]
    assert updater.update([_query("a", 1, 2), _query("b", 1, 2)]) == []  # not due: no call
    assert len(recorder.calls) == 1
    updater.update([_query("a", 2, 4), _query("b", 1, 3)])
    assert recorder.calls[-1] == (["a"], THRESHOLDS)
    assert updater.num_rows_predicted == 3 * len(THRESHOLDS)
    updater.forget("a")
    assert updater.due([_query("a", 3, 5)])  # forgotten: due again


def test_one_shot_policy_predicts_only_at_arrival():
    policy = UpdatePolicy.parse("oneshot")
    assert policy.is_due(None, 0, 0.0)
    assert not policy.is_due(UpdateMark(0, 0.0), 10, 0.9)


@pytest.mark.parametrize(
    ("text", "last", "steps", "progress", "due"),
    [
        ("step", UpdateMark(3, 0.2), 3, 0.2, False),
        ("step", UpdateMark(3, 0.2), 4, 0.2, True),
        ("steps:4", UpdateMark(3, 0.2), 6, 0.9, False),
        ("steps:4", UpdateMark(3, 0.2), 7, 0.2, True),
        ("progress:0.25", UpdateMark(3, 0.2), 9, 0.4, False),
        ("progress:0.25", UpdateMark(3, 0.2), 4, 0.45, True),
    ],
)
def test_policy_is_due(text, last, steps, progress, due):
    assert UpdatePolicy.parse(text).is_due(last, steps, progress) is due


def test_final_skips_one_update_when_one_step_is_predicted():
    policy = UpdatePolicy.parse("step+final")
    settled = UpdateMark(3, 0.5, predicted_steps=2.0)
    assert not policy.is_due(settled, 4, 0.6)  # aged estimate: 1 step
    assert policy.is_due(settled, 5, 0.7)  # at most one update is skipped
    assert policy.is_due(UpdateMark(3, 0.5, predicted_steps=3.0), 4, 0.6)
    assert policy.is_due(UpdateMark(3, 0.5), 4, 0.6)  # no predicted steps known: plain per-step


def test_updater_marks_the_prediction_at_the_running_threshold():
    class Fixed(_RecordingPredictor):
        def predict(self, queries, thresholds):
            super().predict(queries, thresholds)
            return [StepPrediction(q.request_id, q.num_steps_done, {0.5: RemainingSteps(1, 0), 0.9: RemainingSteps(1, 4)})
                    for q in queries]

    updater = PredictionUpdater(Fixed(), UpdatePolicy.parse("step+final"), (0.5, 0.9))
    fast, slow = PredictionQuery("f", 0, 16, 10, 8, threshold=0.55), PredictionQuery("s", 0, 16, 10, 8, threshold=0.9)
    updater.update([fast, slow])
    later = [PredictionQuery("f", 1, 16, 10, 8, 3, threshold=0.55), PredictionQuery("s", 1, 16, 10, 8, 1, threshold=0.9)]
    assert [q.request_id for q in updater.due(later)] == ["s"]


def test_policy_names_round_trip_and_bad_values():
    for text in ("step", "steps:3", "progress:0.1", "oneshot", "step+final", "progress:0.2+final"):
        assert UpdatePolicy.parse(text).name == text
    for bad in ("steps:0", "steps:1.5", "progress:0", "progress:2", "hourly", "step+later"):
        with pytest.raises(ValueError):
            UpdatePolicy.parse(bad)


def test_counts_give_the_same_features_as_the_canvas():
    """The scheduler's counters and the engine's canvas describe a request the same way."""
    engine = FakeEngine()
    states = [engine.new_request(f"r{i}", engine.encode(p.prompt), block_length=random.Random(i).choice([4, 5, 8]))
              for i, p in enumerate(TaskGenerator(4).problems(12, 8))]
    while any(not s.finished for s in states):
        active = [s for s in states if not s.finished]
        for state, result in zip(active, engine.step([(s, 0.7) for s in active]), strict=True):
            if result.finished:
                continue
            c = result.confidence
            from_counts = PredictionQuery.from_counts(
                state.request_id, result.num_steps, state.gen_length, len(state.prompt_ids), state.block_length,
                state.gen_length - result.num_masked, (c.min, c.q25, c.median, c.mean, c.q75),
            )
            assert from_counts.features(0.8) == PredictionQuery.after_step(state, result, engine.mask_id).features(0.8)
    arriving = PredictionQuery.from_counts("a", 0, 16, 20, 8, 0, None)
    assert arriving.features(0.9)[:6] == PredictionQuery.arriving("a", 16, 20, 8).features(0.9)[:6]


def test_load_predictor_from_a_model_directory(tmp_path):
    tiny_model(tmp_path).save(predictor_dir(tmp_path / "engine"))
    tiny_model(tmp_path, "arrival").save(predictor_dir(tmp_path / "engine", one_shot=True))
    assert isinstance(load_predictor(tmp_path / "engine"), InProcessPredictor)
    assert isinstance(load_predictor(tmp_path / "engine", one_shot=True), OneShotPredictor)


def test_no_thresholds_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no candidate thresholds"):
        InProcessPredictor(tiny_model(tmp_path)).predict([_query()], ())
