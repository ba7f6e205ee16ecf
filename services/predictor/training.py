"""Training and scoring step models from trace files: shared by `dls train-predictor` and the benchmark.

Three kinds of model, one per feature set (``shared.features.FEATURE_SETS``):

* ``arrival`` (the one-shot estimate): trained on arrival rows only (no step run yet); scored on
  every row as the arrival estimate aged by the steps run since (``evaluation.aged_one_shot``).
* ``progress``: threshold, lengths and progress, trained and scored on every row.
* ``progress_confidence``: all the features; the model the system serves.
"""

from __future__ import annotations

import numpy as np

from services.predictor.core.evaluation import aged_one_shot, error_table, grouped_errors
from services.predictor.core.model import StepModel
from services.predictor.core.training import TrainingError, TrainParams, train_step_model
from services.predictor.traces import TraceSet
from shared.features import FEATURE_NAMES, arrival_features

ONE_SHOT = "arrival"
SERVED = "progress_confidence"
OUTPUT_LENGTH, BLOCK_INDEX = FEATURE_NAMES.index("output_length"), FEATURE_NAMES.index("block_index")


def fit(traces: TraceSet, feature_set: str = SERVED, params: TrainParams | None = None) -> StepModel:
    """Train a model of ``feature_set`` on ``traces``; the card records the training data."""
    rows = traces.take(traces.steps == 0) if feature_set == ONE_SHOT else traces
    if len(rows) == 0:
        raise TrainingError(f"{traces.path}: no usable rows for the {feature_set} model")
    card = {
        "training": {
            "traces": traces.path,
            "num_requests": rows.num_requests,
            "num_rows": len(rows),
            "seeds": list(traces.seeds),
            "thresholds": sorted({float(t) for t in np.unique(rows.thresholds)}),
        }
    }
    return train_step_model(rows.features, rows.remaining_steps, rows.remaining_recompute, feature_set, params, card)


def predict_remaining(model: StepModel, traces: TraceSet) -> tuple[np.ndarray, np.ndarray]:
    """(total, recompute) remaining steps the model gives at every trace row."""
    if model.feature_set != ONE_SHOT:
        return model.predict(traces.features)
    arrival = np.array([arrival_features(*row[:4]) for row in traces.features], dtype=float)
    total, recompute = model.predict(arrival)
    aged = aged_one_shot(total, traces.steps)
    return aged, np.minimum(recompute, aged)


def evaluate(model: StepModel, traces: TraceSet) -> dict:
    """Error tables of total and recompute remaining steps on ``traces`` (by threshold, after switches)."""
    total, recompute = predict_remaining(model, traces)
    table = error_table(total, traces.remaining_steps, traces.thresholds)
    switched = traces.switched
    table["after_switch"] = error_table(total[switched], traces.remaining_steps[switched],
                                        traces.thresholds[switched])["overall"]
    gap = np.abs(recompute - traces.remaining_recompute)
    table["recompute_mae"] = float(gap.mean())
    # where the error is: per task family, per canvas (output length), per block index decoded last
    if traces.families:
        table["by_family"] = grouped_errors(total, traces.remaining_steps, traces.families)
    table["by_canvas"] = grouped_errors(total, traces.remaining_steps, traces.features[:, OUTPUT_LENGTH])
    table["by_block_index"] = grouped_errors(total, traces.remaining_steps, traces.features[:, BLOCK_INDEX])
    table["traces"] = traces.path
    return table
