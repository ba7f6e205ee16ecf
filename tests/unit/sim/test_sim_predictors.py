from pathlib import Path

import pytest

from shared.messages.predictor import PredictionQuery
from sim.predictors import PREDICTION_SOURCES, FallbackOnly

MODEL_DIR = "models/dls-tiny"


def _query():
    """A request right after its first step (3 of block 0's 8 positions committed), as the core asks."""
    return PredictionQuery(request_id="r1", num_steps_done=1, gen_length=16, prompt_length=70, block_length=8,
                           num_committed=3, block_committed=3, block_size=8, block_index=0,
                           confidence=(0.3, 0.4, 0.5, 0.5, 0.6), uses_cache=True, threshold=0.9)


def test_fallback_gives_no_predictions():
    assert FallbackOnly().predict([_query(), _query()]) == [None, None]


@pytest.mark.skipif(not (Path(MODEL_DIR) / "predictor").is_dir(), reason="no trained step predictor")
def test_step_predictor_gives_scheduler_predictions_for_every_threshold():
    source = PREDICTION_SOURCES.get("predictor")(model_dir=MODEL_DIR, thresholds=(0.5, 0.7, 0.9))
    [prediction] = source.predict([_query()])
    assert prediction.made_at_step == 1  # counted from after the step that just ran
    assert set(prediction.threshold_to_steps) == {0.5, 0.7, 0.9}
    low, high = prediction.threshold_to_steps[0.5], prediction.threshold_to_steps[0.9]
    assert sum(low) <= sum(high) and all(v >= 0 for v in (*low, *high))


def test_auto_falls_back_without_a_predictor(tmp_path):
    assert isinstance(PREDICTION_SOURCES.get("auto")(model_dir=str(tmp_path)), FallbackOnly)
