"""Keeping the step predictor true while serving: the live error, and retraining on served requests.

The predictor service hands every finished request's labelled states (``core/served.py``) to a
``ServedWindow`` (the most recent requests, bounded by rows) and to a ``LiveError`` (the relative error
of the predictor that serves, on the most recent rows). On a schedule it calls ``retrain``: a new step
model is fitted on the window less its most recent requests, which are held out; the new model and the
serving predictor are both scored there (mean relative error of the remaining steps, as a model card's
``error.overall.mre``), and the new one replaces the serving one only where its error is lower.

Pure: no clock, no I/O; the service runs ``retrain`` in a thread (LightGBM releases the GIL) on a
``ServedWindow.snapshot`` taken on its event loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.predictor.core.evaluation import errors
from services.predictor.core.model import StepModel
from services.predictor.core.predictor import InProcessPredictor, Predictor
from services.predictor.core.served import LabelledState
from services.predictor.core.training import TrainParams, default_params, train_step_model

SERVED_FEATURE_SET = "progress_confidence"  # the online model's (``services/predictor/training.py`` SERVED)


@dataclass(frozen=True)
class RetrainConfig:
    """When a retrain may run and what it trains on."""

    window_rows: int = 20_000  # rows of the most recent requests kept (older requests leave whole)
    min_rows: int = 500  # rows in the window before the first retrain
    holdout_share: float = 0.2  # of the window's rows, the most recent requests' are held out for scoring
    params: TrainParams | None = None  # None: ``default_params`` of the served feature set

    def __post_init__(self) -> None:
        if self.window_rows < 1 or self.min_rows < 2:
            raise ValueError(f"window_rows ({self.window_rows}) must be >= 1 and min_rows ({self.min_rows}) >= 2")
        if not 0.0 < self.holdout_share < 1.0:
            raise ValueError(f"holdout_share must be in (0, 1), got {self.holdout_share}")


class ServedWindow:
    """The labelled states of the most recent finished requests, oldest first, at most ``max_rows`` rows
    (a request leaves whole; one request larger than the window is kept alone)."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._requests: deque[tuple[LabelledState, ...]] = deque()  # oldest first
        self.num_rows = 0
        self.num_added = 0  # requests added so far (monotone: a retrain notes where it was)

    def add(self, states: Sequence[LabelledState]) -> None:
        if not states:
            return
        self._requests.append(tuple(states))
        self.num_rows += len(states)
        self.num_added += 1
        while self.num_rows > self.max_rows and len(self._requests) > 1:
            self.num_rows -= len(self._requests.popleft())

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def snapshot(self) -> list[tuple[LabelledState, ...]]:
        """The requests now in the window, oldest first (a copy another thread may read)."""
        return list(self._requests)


def split(requests: Sequence[Sequence[LabelledState]], holdout_share: float
          ) -> tuple[list[LabelledState], list[LabelledState]]:
    """(train, holdout): the holdout is the most recent requests, whole, up to ``holdout_share`` of the rows
    (at least one request); the rest trains. Requests are in finish order, oldest first."""
    total = sum(len(r) for r in requests)
    holdout: list[LabelledState] = []
    cut = len(requests)
    while cut > 1 and (not holdout or len(holdout) + len(requests[cut - 1]) <= holdout_share * total):
        cut -= 1
        holdout[:0] = requests[cut]
    return [s for r in requests[:cut] for s in r], holdout


def predicted_totals(predictor: Predictor, states: Sequence[LabelledState]) -> np.ndarray:
    """The remaining steps ``predictor`` gives each state at the threshold its remaining steps ran at
    (one call per threshold, so no other threshold's prediction bends it)."""
    totals = np.empty(len(states), dtype=float)
    tau_to_indices: dict[float, list[int]] = {}  # threshold -> indices of the states that ran at it
    for i, state in enumerate(states):
        tau_to_indices.setdefault(state.threshold, []).append(i)
    for tau, indices in tau_to_indices.items():
        predictions = predictor.predict([states[i].query for i in indices], [tau])
        totals[indices] = [p.threshold_to_steps[float(tau)].total for p in predictions]
    return totals


def relative_errors(predictor: Predictor, states: Sequence[LabelledState]) -> np.ndarray:
    """``|predicted - actual| / actual`` remaining steps per state."""
    if not states:
        return np.empty(0)
    actual = np.array([s.remaining_steps for s in states], dtype=float)
    return np.abs(predicted_totals(predictor, states) - actual) / actual


def error_of(predictor: Predictor, states: Sequence[LabelledState]) -> dict:
    """``evaluation.errors`` of ``predictor`` on ``states`` (``mre``: a card's ``error.overall.mre``)."""
    actual = np.array([s.remaining_steps for s in states], dtype=float)
    return errors(predicted_totals(predictor, states), actual)


class LiveError:
    """The mean relative error of the serving predictor on the most recent ``max_rows`` rows served (each
    scored when its request finished, by the predictor serving then)."""

    def __init__(self, max_rows: int) -> None:
        self._errors: deque[float] = deque(maxlen=max_rows)

    def observe(self, row_errors: Sequence[float]) -> None:
        self._errors.extend(float(e) for e in row_errors)

    @property
    def num_rows(self) -> int:
        return len(self._errors)

    @property
    def mre(self) -> float | None:
        return float(np.mean(self._errors)) if self._errors else None


@dataclass(frozen=True)
class RetrainOutcome:
    """What one retrain did."""

    num_requests: int  # requests in the snapshot
    num_train_rows: int
    num_holdout_rows: int  # the most recent requests' rows, scored
    old_error: float  # the serving predictor's mean relative error on the holdout
    new_error: float  # the new model's
    swapped: bool  # the new model is better: it serves from now on
    model: StepModel  # the new model (its card says how it was made and scored)

    @property
    def num_rows(self) -> int:
        return self.num_train_rows + self.num_holdout_rows


def not_ready(window: ServedWindow, config: RetrainConfig, num_added_at_last: int) -> str | None:
    """Why no retrain should run now (None: one may): too few rows, or nothing new since the last."""
    if window.num_rows < config.min_rows:
        return f"{window.num_rows} rows of served requests, {config.min_rows} needed"
    if window.num_requests < 2:
        return "one request in the window: nothing to hold out"
    if window.num_added == num_added_at_last:
        return "no request finished since the last retrain"
    return None


def retrain(requests: Sequence[Sequence[LabelledState]], current: Predictor, config: RetrainConfig,
            card: dict | None = None) -> RetrainOutcome:
    """Fit a new step model on ``requests`` less the held-out most recent ones and score both it and
    ``current`` there; ``swapped`` where the new one's mean relative error is lower. ``card`` adds to
    the new model's card (e.g. where and when it was made)."""
    train, holdout = split(requests, config.holdout_share)
    params = config.params or default_params(SERVED_FEATURE_SET)
    training = {"source": "served requests", "num_requests": len(requests), "num_rows": len(train),
                "num_holdout_rows": len(holdout), "thresholds": sorted({s.threshold for s in train})}
    model = train_step_model(
        np.array([s.features for s in train], dtype=float), np.array([s.remaining_steps for s in train], dtype=float),
        np.array([s.remaining_recompute for s in train], dtype=float), SERVED_FEATURE_SET, params,
        {**(card or {}), "training": training},
    )
    old, new = error_of(current, holdout), error_of(InProcessPredictor(model), holdout)
    swapped = new["mre"] < old["mre"]
    model.card.update(error={"overall": new, "holdout": "the most recent served requests"},
                      replaced={"mre": old["mre"], "swapped": swapped})
    return RetrainOutcome(len(requests), len(train), len(holdout), old["mre"], new["mre"], swapped, model)

