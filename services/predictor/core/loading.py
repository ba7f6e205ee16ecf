"""The trained predictors in an engine model's calibration bundle, loaded in process (the simulator, the
predictor service, tests).

    predictor = load_predictor("models/dls-tiny")               # online (progress + confidence)
    baseline = load_predictor("models/dls-tiny", one_shot=True)  # the one-shot ablation
    query = PredictionQuery.from_counts(request_id, steps_done, gen_len, prompt_len, block_len,
                                        num_committed, confidences, uses_cache, threshold)
    [prediction] = predictor.predict([query], candidate_thresholds)

``StepPrediction`` has the scheduler's ``Prediction`` fields (``threshold_to_steps`` with
``(recompute, cache)`` tuples, ``made_at_step``), so it can be used as one or copied into one.
"""

from __future__ import annotations

from pathlib import Path

from services.predictor.core.model import StepModel
from services.predictor.core.predictor import InProcessPredictor, OneShotPredictor, PredictionQuery, Predictor
from shared.calibration import ONE_SHOT as ONE_SHOT_DIR
from shared.calibration import PREDICTOR, bundle_dir

__all__ = ["ONE_SHOT_DIR", "PredictionQuery", "load_predictor", "predictor_dir"]


def predictor_dir(model_dir: str | Path, one_shot: bool = False) -> Path:
    """The predictor in the calibration bundle of an engine model (``shared.calibration``)."""
    directory = bundle_dir(model_dir) / PREDICTOR
    return directory / ONE_SHOT_DIR if one_shot else directory


def load_predictor(model_dir: str | Path, one_shot: bool = False) -> Predictor:
    """The trained predictor in an engine model's calibration bundle (raises ``ModelError`` if unusable)."""
    model = StepModel.load(predictor_dir(model_dir, one_shot))
    return OneShotPredictor(model) if one_shot else InProcessPredictor(model)
