import msgspec
import pytest

from services.predictor.core.loading import predictor_dir
from shared.messages.predictor import PredictionQuery
from sim import experiments
from sim.predictors import PREDICTION_SOURCES, FallbackOnly
from sim.presets import PRESETS
from tests.unit.sim.sim_builders import make_trace

MODEL_DIR = "models/dls-tiny"
TRAINED = pytest.mark.skipif(not (predictor_dir(MODEL_DIR) / "model.txt").exists(), reason="no trained step predictor")


def _query():
    """A request right after its first step (3 of block 0's 8 positions committed), as the core asks."""
    return PredictionQuery(request_id="r1", num_steps_done=1, gen_length=16, prompt_length=70, block_length=8,
                           num_committed=3, block_committed=3, block_size=8, block_index=0,
                           confidence=(0.3, 0.4, 0.5, 0.5, 0.6), uses_cache=True, threshold=0.9)


def test_fallback_gives_no_predictions():
    assert FallbackOnly().predict([_query(), _query()]) == [None, None]


@TRAINED
def test_step_predictor_gives_scheduler_predictions_for_every_threshold():
    source = PREDICTION_SOURCES.get("predictor")(model_dir=MODEL_DIR, thresholds=(0.5, 0.7, 0.9))
    [prediction] = source.predict([_query()])
    assert prediction.made_at_step == 1  # counted from after the step that just ran
    assert set(prediction.threshold_to_steps) == {0.5, 0.7, 0.9}
    low, high = prediction.threshold_to_steps[0.5], prediction.threshold_to_steps[0.9]
    assert sum(low) <= sum(high) and all(v >= 0 for v in (*low, *high))


def test_auto_falls_back_without_a_predictor(tmp_path):
    assert isinstance(PREDICTION_SOURCES.get("auto")(model_dir=str(tmp_path)), FallbackOnly)


@TRAINED
def test_the_one_shot_source_answers_from_arrival_features_alone():
    """What ``dilaserve-oneshot`` plans on: the predictor's one-shot model, which reads a request's
    arrival (threshold and lengths) whatever its progress; the online model reads the progress."""
    thresholds = (0.7, 0.9)
    early, late = _query(), msgspec.structs.replace(_query(), num_committed=7, block_committed=7, confidence=(0.9, 0.92, 0.95, 0.95, 0.97))
    one_shot = PREDICTION_SOURCES.get("predictor")(model_dir=MODEL_DIR, thresholds=thresholds, one_shot=True)
    online = PREDICTION_SOURCES.get("predictor")(model_dir=MODEL_DIR, thresholds=thresholds)
    assert one_shot.predict([early]) == one_shot.predict([late])
    assert online.predict([early]) != online.predict([late])


def test_a_policy_planning_on_one_prediction_gets_the_one_shot_source(monkeypatch):
    setup = experiments.setup(PRESETS.get("tiny").quick(), trace=make_trace(), prediction="fallback")
    asked = []
    real = experiments.Setup.predictor
    monkeypatch.setattr(experiments.Setup, "predictor",
                        lambda self, one_shot=False: asked.append(one_shot) or real(self, one_shot))
    for label in ("dilaserve", "dilaserve-oneshot", "infaas"):
        experiments.run_point(setup, label, 0)
    assert asked == [False, True, False]
