import numpy as np
import pytest

from services.predictor.core.model import CARD_FILE, RECOMPUTE_FILE, TOTAL_FILE, ModelError, StepModel
from services.predictor.core.training import (
    TrainingError,
    TrainParams,
    _weights,
    arrival_rows,
    train_step_model,
)
from shared.features import arrival_features, step_features
from tests.unit.predictor.pred_builders import FAST, fake_traces, tiny_model


def test_save_load_round_trip_predicts_the_same(tmp_path):
    model = tiny_model(tmp_path)
    traces = fake_traces(tmp_path, "heldout.csv", 10, seed=9)
    directory = model.save(tmp_path / "predictor")
    assert {p.name for p in directory.iterdir()} == {TOTAL_FILE, RECOMPUTE_FILE, CARD_FILE}
    loaded = StepModel.load(directory)
    assert loaded.feature_set == "progress_confidence"
    assert loaded.card["training"]["num_requests"] == 60
    for a, b in zip(model.predict(traces.features), loaded.predict(traces.features), strict=True):
        np.testing.assert_allclose(a, b)


def test_predictions_are_bounded(tmp_path):
    model = tiny_model(tmp_path)
    traces = fake_traces(tmp_path, "heldout.csv", 10, seed=9)
    total, recompute = model.predict(traces.features)
    assert np.all(total >= 1) and np.all((recompute >= 0) & (recompute <= total))


def test_l2_objective_can_carry_the_monotone_constraint(tmp_path):
    traces = fake_traces(tmp_path)
    params = TrainParams(num_rounds=20, min_data_in_leaf=3, objective="l2", monotone_in_threshold=True)
    model = train_step_model(traces.features, traces.remaining_steps, traces.remaining_recompute, params=params)
    rows = np.array([arrival_features(t, 16, 30, 8) for t in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)])
    low_to_high, _ = model.predict(rows)
    assert np.all(np.diff(low_to_high) >= -1e-9)


def test_arrival_rows_are_the_rows_before_any_step():
    arrival = arrival_features(0.9, 16, 30, 8)
    stepped = step_features(0.9, 16, 30, 8, 3, 3, (0.5, 0.6, 0.7, 0.7, 0.8), block_index=0, predicted_end=12)
    nothing_committed = step_features(0.9, 16, 30, 8, 0, 0, (0.1, 0.2, 0.3, 0.3, 0.4))
    assert arrival_rows(np.array([arrival, stepped, nothing_committed])).tolist() == [True, False, False]


def test_arrival_rows_weigh_by_their_steps_and_the_others_by_their_own_power():
    labels, arrival = np.array([4.0, 4.0, 0.0]), np.array([True, False, True])
    np.testing.assert_allclose(_weights(labels, arrival, TrainParams()), [0.5, 1.0, 1.0])  # 1 / sqrt(4); 0 as 1
    np.testing.assert_allclose(_weights(labels, arrival, TrainParams(weight_power=1.0)), [0.5, 0.25, 1.0])
    assert _weights(labels, arrival, TrainParams(arrival_weight_power=0.0)) is None  # the median everywhere


def test_arrival_model_reads_only_arrival_features(tmp_path):
    model = tiny_model(tmp_path, "arrival")
    row = np.array([arrival_features(0.9, 16, 30, 8)])
    moved = row.copy()
    moved[0, 4:] = [0.5, 0.5, 3.0, 4.0, 0.2, 0.3, 0.4, 0.5, 0.6, 1.0]
    np.testing.assert_allclose(model.predict(row)[0], model.predict(moved)[0])


def test_wrong_row_shape(tmp_path):
    with pytest.raises(ValueError, match="14 features"):
        tiny_model(tmp_path).predict(np.zeros((2, 6)))


def test_corrupt_model_file_names_the_file(tmp_path):
    directory = tiny_model(tmp_path).save(tmp_path / "predictor")
    (directory / TOTAL_FILE).write_text("this is not a booster\n")
    with pytest.raises(ModelError, match=f"{TOTAL_FILE}: not a LightGBM text model"):
        StepModel.load(directory)


def test_missing_or_bad_card(tmp_path):
    with pytest.raises(ModelError, match="no model card"):
        StepModel.load(tmp_path)
    (tmp_path / CARD_FILE).write_text("{nope")
    with pytest.raises(ModelError, match="not valid JSON"):
        StepModel.load(tmp_path)


def test_training_rejects_empty_and_bad_labels():
    with pytest.raises(TrainingError, match="no training rows"):
        train_step_model(np.zeros((0, 14)), np.zeros(0), np.zeros(0), params=FAST)
    with pytest.raises(TrainingError, match="non-negative"):
        train_step_model(np.zeros((3, 14)), np.array([1.0, -1.0, 2.0]), np.zeros(3), params=FAST)
    with pytest.raises(TrainingError, match="unknown feature set"):
        train_step_model(np.zeros((3, 14)), np.ones(3), np.zeros(3), "everything", FAST)
