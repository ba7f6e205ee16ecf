"""The ``Predictor`` port and its in-process implementations.

A call predicts, for many requests at once, the remaining (recompute, cache) steps at every candidate
threshold: all (request, threshold) rows go to the boosters in one batch, which is what keeps the
per-row cost small (``bench.predictor`` measures it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from services.predictor.core.model import StepModel
from shared.features import (
    THRESHOLD_INDEX,
    StateLike,
    StepResultLike,
    arrival_features,
    confidence_values,
    step_features,
)


class RemainingSteps(NamedTuple):
    """Predicted steps left; a tuple so it fits the scheduler's ``(recompute, cache)`` pairs."""

    recompute_steps: float
    cache_steps: float

    @property
    def total(self) -> float:
        return self.recompute_steps + self.cache_steps


@dataclass(frozen=True, slots=True)
class PredictionQuery:
    """A request's state between steps: everything the features need except the threshold."""

    request_id: str
    num_steps_done: int
    gen_length: int
    prompt_length: int
    block_length: int
    num_committed: int = 0
    block_committed: int = 0  # committed positions of the block the last step decoded
    block_size: int | None = None  # that block's size (the last block may be short)
    confidence: tuple[float, ...] | None = None  # (min, q25, median, mean, q75); None before any step
    uses_cache: bool = True  # False: every step is a full forward (cache mode none)
    threshold: float | None = None  # the one it runs at now (lets ``+final`` update policies skip it)
    block_index: int = 0  # the block the last step decoded
    predicted_end: int | None = None  # where the engine expects the EOS (``shared.features``); None: not known
    model: str = ""  # the request's model: whose predictor answers (the service's); "": its first served model

    @property
    def progress(self) -> float:
        return self.num_committed / self.gen_length

    def features(self, threshold: float) -> list[float]:
        return step_features(
            threshold, self.gen_length, self.prompt_length, self.block_length, self.num_committed,
            self.block_committed, self.confidence, self.block_size, self.block_index, self.predicted_end,
        )

    def arrival_features(self, threshold: float) -> list[float]:
        return arrival_features(threshold, self.gen_length, self.prompt_length, self.block_length)

    @classmethod
    def arriving(cls, request_id: str, gen_length: int, prompt_length: int, block_length: int,
                 uses_cache: bool = True) -> PredictionQuery:
        return cls(request_id, 0, gen_length, prompt_length, block_length, uses_cache=uses_cache)

    @classmethod
    def from_counts(
        cls,
        request_id: str,
        num_steps_done: int,
        gen_length: int,
        prompt_length: int,
        block_length: int,
        num_committed: int,
        confidence: Sequence[float] | None,
        uses_cache: bool = True,
        threshold: float | None = None,
        predicted_end: int | None = None,
    ) -> PredictionQuery:
        """The query from counters alone (the scheduler's and simulator's view of a request).

        Blocks are decoded in order, so the block the last step decoded is the one holding the last
        committed position, and everything before it is committed; this gives the same block
        progress as :meth:`after_step` reads from the canvas.
        """
        if num_committed <= 0:  # no step yet (every step commits at least one position)
            return cls(request_id, num_steps_done, gen_length, prompt_length, block_length, uses_cache=uses_cache,
                       threshold=threshold)
        start = (num_committed - 1) // block_length * block_length
        return cls(
            request_id, num_steps_done, gen_length, prompt_length, block_length, num_committed,
            num_committed - start, min(block_length, gen_length - start),
            None if confidence is None else tuple(confidence_values(confidence)), uses_cache, threshold,
            block_index=start // block_length, predicted_end=predicted_end,
        )

    @classmethod
    def after_step(cls, state: StateLike, result: StepResultLike, mask_id: int) -> PredictionQuery:
        """The query for an engine request right after ``result`` (``state`` already updated)."""
        start, end = state.block_bounds(result.block_index)
        return cls(
            state.request_id, result.num_steps, state.gen_length, len(state.prompt_ids), state.block_length,
            state.gen_length - result.num_masked, sum(1 for t in state.canvas[start:end] if t != mask_id),
            end - start, tuple(confidence_values(result.confidence)), state.cache_mode != "none",
            block_index=result.block_index, predicted_end=result.predicted_end,
        )


@dataclass(frozen=True, slots=True)
class StepPrediction:
    """Remaining steps per candidate threshold, counted from step ``made_at_step``."""

    request_id: str
    made_at_step: int
    threshold_to_steps: dict[float, RemainingSteps]  # threshold -> remaining steps from made_at_step


class Predictor(Protocol):
    """The step predictor port (in-process here; a remote client has the same shape)."""

    def predict(self, queries: Sequence[PredictionQuery], thresholds: Sequence[float]) -> list[StepPrediction]:
        """One prediction per query, for every threshold, in one batch."""
        ...


class InProcessPredictor:
    """Online predictions from a progress (+ confidence) model, batched across requests and thresholds."""

    def __init__(self, model: StepModel) -> None:
        self.model = model

    def predict(self, queries: Sequence[PredictionQuery], thresholds: Sequence[float]) -> list[StepPrediction]:
        if not queries:
            return []
        rows = _threshold_rows([q.features(0.0) for q in queries], thresholds)
        total, recompute = self.model.predict(rows)
        return _assemble(queries, thresholds, total, recompute, [q.num_steps_done for q in queries])


class OneShotPredictor:
    """The ablation: the estimate a request gets at arrival, aged by the steps it has run since.

    Reads only arrival features (threshold and lengths) whatever the query's progress, so asking it
    mid-request gives ``max(arrival estimate - steps done, 1)``; the recompute part is the arrival
    estimate's, capped by that total.
    """

    def __init__(self, model: StepModel) -> None:
        self.model = model

    def predict(self, queries: Sequence[PredictionQuery], thresholds: Sequence[float]) -> list[StepPrediction]:
        if not queries:
            return []
        rows = _threshold_rows([q.arrival_features(0.0) for q in queries], thresholds)
        total, recompute = self.model.predict(rows)
        done = np.repeat([q.num_steps_done for q in queries], len(thresholds))
        aged = np.maximum(total - done, 1.0)
        return _assemble(queries, thresholds, aged, np.minimum(recompute, aged), [q.num_steps_done for q in queries])


class BoundPredictor:
    """For a model with no trained predictor (uncalibrated, ``shared.calibration``): the most steps a
    request can still take, whatever the threshold. Every step commits at least one position, so the
    masked positions left bound the steps; with a cache, each block left starts with a recompute step.
    It plans nobody optimistically; a predictor trained on the model's traces replaces it."""

    version = "uncalibrated:bound"

    def predict(self, queries: Sequence[PredictionQuery], thresholds: Sequence[float]) -> list[StepPrediction]:
        if not len(thresholds):
            raise ValueError("no candidate thresholds to predict for")
        out = []
        for q in queries:
            left = max(q.gen_length - q.num_committed, 1)
            if not q.uses_cache:
                steps = RemainingSteps(float(left), 0.0)
            else:
                done_blocks = q.num_committed // q.block_length  # whole blocks committed
                blocks = max(-(-q.gen_length // q.block_length) - done_blocks, 1)
                in_block = q.num_committed % q.block_length  # the open block started: no recompute for it
                recompute = blocks - (1 if in_block else 0)
                steps = RemainingSteps(float(recompute), float(left - recompute))
            out.append(StepPrediction(q.request_id, q.num_steps_done, {float(tau): steps for tau in thresholds}))
        return out


def _threshold_rows(base_rows: list[list[float]], thresholds: Sequence[float]) -> np.ndarray:
    """Each base row repeated once per threshold, with the threshold column set (query-major)."""
    if not len(thresholds):
        raise ValueError("no candidate thresholds to predict for")
    rows = np.repeat(np.asarray(base_rows, dtype=np.float64), len(thresholds), axis=0)
    rows[:, THRESHOLD_INDEX] = np.tile(np.asarray(thresholds, dtype=np.float64), len(base_rows))
    return rows


def _assemble(queries, thresholds, total, recompute, made_at_steps) -> list[StepPrediction]:
    """Per-query predictions from query-major arrays; totals made non-decreasing in the threshold."""
    num = len(thresholds)
    order = np.argsort(thresholds, kind="stable")
    total = total.reshape(-1, num).copy()
    total[:, order] = np.maximum.accumulate(total[:, order], axis=1)  # higher threshold, never fewer steps
    recompute = np.minimum(recompute.reshape(-1, num), total)
    no_cache = np.array([not q.uses_cache for q in queries])
    recompute[no_cache] = total[no_cache]  # without a cache every step is a full forward
    keys = [float(tau) for tau in thresholds]
    out = []
    for query, made_at, t, r in zip(queries, made_at_steps, total.tolist(), recompute.tolist(), strict=True):
        steps = {tau: RemainingSteps(r[j], t[j] - r[j]) for j, tau in enumerate(keys)}
        out.append(StepPrediction(query.request_id, int(made_at), steps))
    return out
