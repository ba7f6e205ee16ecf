"""The step predictor's pure core: model wrapper, predictor port, update policy, evaluation."""

from services.predictor.core.model import ModelError, StepModel
from services.predictor.core.policy import Granularity, UpdateMark, UpdatePolicy
from services.predictor.core.predictor import (
    InProcessPredictor,
    OneShotPredictor,
    PredictionQuery,
    Predictor,
    RemainingSteps,
    StepPrediction,
)
from services.predictor.core.training import TrainingError, TrainParams, train_step_model
from services.predictor.core.updater import PredictionUpdater

__all__ = [
    "Granularity",
    "InProcessPredictor",
    "ModelError",
    "OneShotPredictor",
    "PredictionQuery",
    "PredictionUpdater",
    "Predictor",
    "RemainingSteps",
    "StepModel",
    "StepPrediction",
    "TrainParams",
    "TrainingError",
    "UpdateMark",
    "UpdatePolicy",
    "train_step_model",
]
