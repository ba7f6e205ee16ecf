from pathlib import Path

import pytest

from services.scheduler.core import CacheMode, Request
from sim.engines import EngineOutcome
from sim.predictors import PREDICTION_SOURCES, FallbackOnly

MODEL_DIR = "models/dls-tiny"


def _item():
    request = Request("r1", 0.0, prompt_len=70, gen_len=16, slo_s=5.0, block_len=8, cache_mode=CacheMode.DUAL)
    outcome = EngineOutcome("r1", 3, False, False, True, 0.9, 13, (0.3, 0.4, 0.5, 0.5, 0.6))
    return request, outcome


def test_fallback_gives_no_predictions():
    assert FallbackOnly().predict([_item(), _item()]) == [None, None]


@pytest.mark.skipif(not (Path(MODEL_DIR) / "predictor").is_dir(), reason="no trained step predictor")
def test_step_predictor_gives_scheduler_predictions_for_every_threshold():
    source = PREDICTION_SOURCES.get("predictor")(model_dir=MODEL_DIR, thresholds=(0.5, 0.7, 0.9))
    [prediction] = source.predict([_item()])
    assert prediction.made_at_step == 1  # counted from after the step that just ran
    assert set(prediction.threshold_to_steps) == {0.5, 0.7, 0.9}
    low, high = prediction.threshold_to_steps[0.5], prediction.threshold_to_steps[0.9]
    assert sum(low) <= sum(high) and all(v >= 0 for v in (*low, *high))


def test_auto_falls_back_without_a_predictor(tmp_path):
    assert isinstance(PREDICTION_SOURCES.get("auto")(model_dir=str(tmp_path)), FallbackOnly)
