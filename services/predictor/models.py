"""The models a predictor service serves: each one's predictors, live error and retraining window.

``DLS_PREDICTOR_MODEL_DIRS`` (else ``DLS_PREDICTOR_MODEL_DIR`` alone) names the served models; a model's
name is its directory's basename, as requests name it (``shared.served``). Each model is answered by the
predictors of its own calibration bundle (``shared.calibration``; ``DLS_CALIBRATION_DIR`` is the first
model's, ``shared.served``), refused when made for other weights; an uncalibrated one gets
``BoundPredictor``, said for that model alone. A query names its request's model
(``PredictionQuery.model``); "" is the first served model. With one model served, every query is
answered by it whatever it names, as before a cluster served several (a name that differs is logged
once): only several models make the name decide.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.predictor.core.loading import ONE_SHOT_DIR
from services.predictor.core.model import RECOMPUTE_FILE, TOTAL_FILE, StepModel
from services.predictor.core.predictor import BoundPredictor, InProcessPredictor, OneShotPredictor, Predictor
from services.predictor.core.retraining import LiveError, RetrainOutcome, ServedWindow
from shared.calibration import Calibration, uncalibrated_message
from shared.served import served_models_of
from shared.settings import PredictorSettings

logger = logging.getLogger("dls.predictor")


@dataclass(frozen=True)
class LoadedPredictor:
    """A core predictor and the version string its replies carry."""

    predictor: Predictor
    version: str  # "<feature set>:<hash of the booster files>"


def load(directory: str | Path, one_shot: bool) -> LoadedPredictor:
    """The predictor trained in ``directory`` (``ModelError`` if unusable)."""
    model = StepModel.load(directory)
    predictor = OneShotPredictor(model) if one_shot else InProcessPredictor(model)
    return LoadedPredictor(predictor, model_version(directory, model))


def model_version(directory: str | Path, model: StepModel) -> str:
    digest = hashlib.sha256()
    for name in (TOTAL_FILE, RECOMPUTE_FILE):
        digest.update((Path(directory) / name).read_bytes())
    return f"{model.feature_set}:{digest.hexdigest()[:12]}"


def trained_version(model: StepModel) -> str:
    """The version of a model trained in this process (the same form: a hash of its boosters' text)."""
    digest = hashlib.sha256()
    for booster in (model.total, model.recompute):
        digest.update(booster.model_to_string().encode())
    return f"{model.feature_set}:{digest.hexdigest()[:12]}"


class UnknownModelError(ValueError):
    """A query or a finished request named a model this predictor does not serve."""

    def __init__(self, name: str, served: Sequence[str]) -> None:
        super().__init__(f"model {name!r} is not served by this predictor (served: {', '.join(served)}; "
                         "DLS_PREDICTOR_MODEL_DIRS)")
        self.name = name
        self.served = list(served)


@dataclass
class ServedPredictor:
    """One served model: its calibration's predictors (each loaded when first needed), the live error of the
    one serving, and the window of its finished requests it retrains on."""

    name: str  # the model's name (its directory's basename), as queries and request records name it
    model_dir: str
    calibration: Calibration | None  # None: uncalibrated (``BoundPredictor`` answers)
    window: ServedWindow  # its finished requests' states to retrain on
    live: LiveError  # the serving predictor's error on its most recent rows
    loaded: dict[bool, LoadedPredictor] = field(default_factory=dict)  # one_shot -> predictor
    retrain_outcomes: list[RetrainOutcome] = field(default_factory=list)  # its retrains so far, in order
    num_added_at_retrain: int = 0  # ``window.num_added`` when its last retrain took its snapshot

    def predictor(self, one_shot: bool) -> LoadedPredictor:
        """Its online or one-shot predictor, loaded the first time it is asked for."""
        if one_shot not in self.loaded and self.calibration is None:
            self.loaded[one_shot] = LoadedPredictor(BoundPredictor(), BoundPredictor.version)
            logger.info("%s: predicting the most steps a request can take (no trained predictor)", self.name)
        if one_shot not in self.loaded:
            directory = self.calibration.predictor_dir
            directory = directory / ONE_SHOT_DIR if one_shot else directory
            self.loaded[one_shot] = load(directory, one_shot)
            logger.info("%s: loaded the %s predictor from %s (%s)", self.name, "one-shot" if one_shot else "online",
                        directory, self.loaded[one_shot].version)
        return self.loaded[one_shot]


def served_predictors(settings: PredictorSettings) -> dict[str, ServedPredictor]:
    """Every model the settings serve, first first (model name -> its predictors): each with its own
    calibration (``CalibrationMismatch`` naming what differs when one was made for other weights); an
    uncalibrated one is said, naming it. Two directories with one basename are refused
    (``shared.served.DuplicateModelName``)."""
    served: dict[str, ServedPredictor] = {}
    for model in served_models_of(settings, "DLS_PREDICTOR_MODEL_DIRS"):
        calibration = model.calibration()
        if calibration is None:
            logger.warning(uncalibrated_message(model.directory))
        served[model.name] = ServedPredictor(model.name, model.directory, calibration,
                                             ServedWindow(settings.retrain_window_rows),
                                             LiveError(max(settings.live_error_rows, 1)))
    return served
