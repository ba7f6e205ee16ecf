"""Online updates: which requests are due for a prediction, asked for in one batched call.

The service runs this off the step path (the paper's asynchronous thread): after a round of steps it
passes every running request's query; the due ones go to the predictor together, for every
candidate threshold, and the predictions return to the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.predictor.core.policy import UpdateMark, UpdatePolicy
from services.predictor.core.predictor import PredictionQuery, Predictor, StepPrediction


class PredictionUpdater:
    """Keeps each request's last update mark and batches the due ones into one predictor call."""

    def __init__(self, predictor: Predictor, policy: UpdatePolicy, thresholds: Sequence[float]) -> None:
        if not thresholds:
            raise ValueError("no candidate thresholds")
        self.predictor = predictor
        self.policy = policy
        self.thresholds = tuple(float(t) for t in thresholds)
        self._marks: dict[str, UpdateMark] = {}  # request id -> where its last prediction was made
        self.num_rows_predicted = 0  # (request, threshold) rows sent to the predictor so far

    def due(self, queries: Sequence[PredictionQuery]) -> list[PredictionQuery]:
        return [q for q in queries if self.policy.is_due(self._marks.get(q.request_id), q.num_steps_done, q.progress)]

    def update(self, queries: Sequence[PredictionQuery]) -> list[StepPrediction]:
        """Fresh predictions for the due queries among ``queries`` (one predictor call, or none)."""
        due = self.due(queries)
        if not due:
            return []
        predictions = self.predictor.predict(due, self.thresholds)
        for query, prediction in zip(due, predictions, strict=True):
            mark = UpdateMark(query.num_steps_done, query.progress, _steps_at(prediction, query.threshold))
            self._marks[query.request_id] = mark
        self.num_rows_predicted += len(due) * len(self.thresholds)
        return predictions

    def forget(self, request_id: str) -> None:
        """The request finished or was cancelled."""
        self._marks.pop(request_id, None)


def _steps_at(prediction: StepPrediction, threshold: float | None) -> float | None:
    """Predicted remaining steps at the candidate nearest the request's threshold (None if unknown)."""
    if threshold is None or not prediction.threshold_to_steps:
        return None
    nearest = min(prediction.threshold_to_steps, key=lambda t: abs(t - threshold))
    return prediction.threshold_to_steps[nearest].total
