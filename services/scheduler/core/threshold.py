"""Candidate thresholds, remaining-step estimates, and Algorithm 1 (SLO-aware threshold)."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from services.scheduler.core.request import CacheMode, Prediction, Request

DEFAULT_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
# threshold -> tokens committed per step, assumed where no prediction exists yet. Fast-dLLM measures
# ~3.25 tokens/step at 0.9 (LLaDA, GSM8K, block 32); lower thresholds commit more per step.
DEFAULT_FALLBACK_TOKENS_PER_STEP = {0.5: 6.0, 0.6: 5.0, 0.7: 4.2, 0.8: 3.6, 0.9: 3.2, 0.95: 2.6}


@dataclass(frozen=True)
class ModelFloors:
    """One served model's share of the candidate grid (several models, each with its own quality
    curve): the lowest threshold its requests may run at (the lowest of its own candidates within the
    quality budget: ``model_floors``), and the floor per canvas on its curves (``canvas_floors``)."""

    lowest: float  # no request of the model runs below it (an uncalibrated model: the highest candidate)
    canvas_floors: tuple[tuple[int, float], ...] = ()  # (canvas length, its floor), as ``canvas_floors`` gives


class ThresholdGrid:
    """The admin's candidate thresholds, ascending; requests use index ranges into it.

    ``canvas_floors`` maps a canvas length to the lowest threshold the quality budget allows on it
    (the function ``canvas_floors``): a request's range starts no lower than its canvas's floor, so
    a request on a canvas where the model is weaker keeps the budget there too. ``quality_floor``
    is the lowest threshold shadow decoding still allows (``core.quality_watch``; 0.0: any).

    Several models: the grid is the union of their candidates, and ``model_floors`` (model -> its
    ``ModelFloors``) bounds each model's requests by its own curve in place of ``canvas_floors``; a
    request of a model not named there has ``canvas_floors`` alone, as with one model."""

    def __init__(self, thresholds: Sequence[float], canvas_floors: Mapping[int, float] | None = None,
                 model_floors: Mapping[str, ModelFloors] | None = None) -> None:
        self.canvas_floors = {int(c): float(f) for c, f in (canvas_floors or {}).items()}
        self.model_floors = dict(model_floors or {})  # model -> its floors (several models)
        # model -> its canvas floors as a map (canvas length -> floor)
        self._model_canvas_floors = {m: dict(f.canvas_floors) for m, f in self.model_floors.items()}
        self.quality_floor = 0.0
        values = sorted(set(float(t) for t in thresholds))
        if not values or values[0] <= 0 or values[-1] > 1:
            raise ValueError(f"candidate thresholds must be in (0, 1]: {thresholds}")
        self.values = tuple(values)
        self.array = np.array(values)

    def __len__(self) -> int:
        return len(self.values)

    def floor_index(self, min_threshold: float) -> int:
        """First candidate at or above the floor (len(grid) when none is)."""
        return bisect.bisect_left(self.values, min_threshold - 1e-9)

    def ceil_index(self, max_threshold: float) -> int:
        """Last candidate at or below the ceiling (-1 when none is)."""
        return bisect.bisect_right(self.values, max_threshold + 1e-9) - 1

    def request_range(self, request: Request) -> tuple[int, int]:
        """(lowest, highest) allowed index for a request; lowest > highest when none is allowed. The
        floor is the request's own or its canvas's, whichever is higher (a canvas floor never above
        the highest candidate: it narrows a range, it cannot empty one)."""
        own = self.model_floors.get(request.model)
        if own is None:
            lowest = canvas_floor(self.canvas_floors, request.gen_len)
        else:
            lowest = max(own.lowest, canvas_floor(self._model_canvas_floors[request.model], request.gen_len))
        floor = min(max(lowest, self.quality_floor), self.values[-1])
        return self.floor_index(max(request.min_threshold, floor)), self.ceil_index(request.max_threshold)

    def lowest_of(self, model: str | None = None) -> float:
        """The lowest threshold a request (of ``model``, where it has floors of its own) may run at now,
        whatever its canvas: the quality floor, or the model's own lowest where higher."""
        own = self.model_floors.get(model) if model is not None else None
        return self.quality_floor if own is None else max(self.quality_floor, own.lowest)

    def withdraw_below(self, floor: float, model: str | None = None) -> None:
        """No request (of ``model`` alone, where it has floors of its own) runs below ``floor`` any more:
        shadow decoding found the candidates below it losing more than their curve promised."""
        own = self.model_floors.get(model) if model is not None else None
        if own is None:
            self.quality_floor = max(self.quality_floor, floor)
        else:
            self.model_floors[model] = replace(own, lowest=max(own.lowest, floor))

    def nearest_index(self, threshold: float, lo: int, hi: int) -> int:
        """The candidate closest to ``threshold`` inside [lo, hi] (ties: the higher one)."""
        i = min(max(bisect.bisect_left(self.values, threshold - 1e-9), lo), hi)
        if i > lo and abs(self.values[i - 1] - threshold) < abs(self.values[i] - threshold):
            return i - 1
        return i


def within_quality_budget(
    thresholds: Sequence[float], accuracy: Mapping[float, float], budget_pp: float
) -> tuple[float, ...]:
    """The candidates an accuracy budget allows: from the highest threshold down, those whose
    measured accuracy (0 to 1) is at most ``budget_pp`` points below the highest's, stopping at the
    first that is not (a lower threshold never commits fewer tokens per step, so whatever lies below
    a threshold that loses too much is not wanted either).

    How an operator turns "at most 1 point of accuracy" into DiLaServe's admin set: the paper's
    candidates 0.5-0.9 cost LLaDA under 1% on GSM8K; another model's curve calls for another set.
    """
    if budget_pp < 0:
        raise ValueError(f"quality budget must be >= 0 points, got {budget_pp}")
    ordered = sorted(set(float(t) for t in thresholds), reverse=True)
    missing = [t for t in ordered if t not in accuracy]
    if missing:
        raise ValueError(f"no measured accuracy for threshold(s) {missing} (measured: {sorted(accuracy)})")
    reference = accuracy[ordered[0]]
    kept = []
    for t in ordered:
        if accuracy[t] < reference - budget_pp / 100.0 - 1e-12:
            break
        kept.append(t)
    return tuple(sorted(kept))


def within_quality_budgets(
    thresholds: Sequence[float], curves: Sequence[Mapping[float, float]], budget_pp: float
) -> tuple[float, ...]:
    """The candidates within the budget on every curve (one per task family, say): no family the
    model serves loses more than ``budget_pp`` points to a lower threshold."""
    kept = set(float(t) for t in thresholds)
    for curve in curves:
        kept &= set(within_quality_budget(thresholds, curve, budget_pp))
    return tuple(sorted(kept))


def quality_curves(data: Mapping, keys: Sequence[str] = ()) -> list[dict[float, float]]:
    """The accuracy curves of a model's ``quality.json`` that bound the candidates.

    ``keys`` names them: a top-level curve (``accuracy``: the short families' mix without a cache,
    ``accuracy_dual_cache``, ``accuracy@<canvas>``: the mix on one canvas) or a task family under
    ``families`` (``<family>@<block>``: at one block length). None named: the mix and every
    family, as a server that does not know what its requests ask must assume. An unknown name is an
    error naming the curves there are.
    """
    families = data.get("families", {})
    if not keys:
        return [_curve(data["accuracy"]), *(_curve(c) for c in families.values())]
    curves = []
    for key in keys:
        curve = families.get(key) if key in families else data.get(key) if key.startswith("accuracy") else None
        if not isinstance(curve, Mapping):
            known = [k for k in data if k.startswith("accuracy")] + list(families)
            raise ValueError(f"no accuracy curve {key!r} in quality.json (there are: {', '.join(known)})")
        curves.append(_curve(curve))
    return curves


def _curve(curve: Mapping) -> dict[float, float]:
    return {float(t): float(a) for t, a in curve.items()}


def quality_curve_key(data: Mapping, *, family: str | None, gen_len: int, block_len: int,
                      no_cache: bool) -> str:
    """The curve of a model's ``quality.json`` that requests of one shape follow: a task family at
    that block length (``<family>@<block>``), else the family; for the short families' mix, the mix
    on that canvas (``accuracy@<canvas>``, written from the engine bench's ``by_canvas``: the model
    can be weaker on a tight canvas than on its default one), else the mix for the cache mode. The
    one rule the simulator's presets and the live benches name their curve by."""
    families = data.get("families", {})
    if family:
        if f"{family}@{block_len}" in families:
            return f"{family}@{block_len}"
        if family in families:
            return family
    if f"accuracy@{gen_len}" in data:
        return f"accuracy@{gen_len}"
    return "accuracy" if no_cache else "accuracy_dual_cache"


def canvas_floors(thresholds: Sequence[float], data: Mapping, budget_pp: float) -> dict[int, float]:
    """Canvas length -> the lowest of ``thresholds`` within ``budget_pp`` points on the short mix's
    curve at that canvas (``accuracy@<canvas>`` in a model's ``quality.json``); empty when the model
    has no such curves. What bounds each request by the canvas it runs on (``ThresholdGrid``)."""
    floors = {}
    for key, curve in data.items():
        canvas = key.removeprefix("accuracy@")
        if canvas != key and canvas.isdigit() and isinstance(curve, Mapping):
            kept = within_quality_budget(thresholds, _curve(curve), budget_pp)
            if kept:
                floors[int(canvas)] = min(kept)
    return floors


def canvas_floor(floors: Mapping[int, float], gen_len: int) -> float:
    """The floor for a canvas of ``gen_len``: that of the longest measured canvas not above it (the
    nearest tighter one, where the model is no better), else of the shortest measured; 0 if none."""
    if not floors:
        return 0.0
    below = [c for c in floors if c <= gen_len]
    return floors[max(below)] if below else floors[min(floors)]


def candidates_from_quality(thresholds: Sequence[float], data: Mapping, budget_pp: float,
                            keys: Sequence[str] = ()) -> tuple[float, ...]:
    """DiLaServe's candidate thresholds on a model: ``thresholds`` within ``budget_pp`` points on
    each curve ``keys`` names (``quality_curves``). The one rule the live scheduler and the simulator
    share."""
    return within_quality_budgets(thresholds, quality_curves(data, keys), budget_pp)


class PredictionMode(StrEnum):
    ONLINE = "online"  # the latest prediction (step predictor updated as the request runs)
    ONESHOT = "oneshot"  # only the prediction made at arrival, scaled by token progress


class StepEstimator:
    """Remaining (recompute, cache) steps per candidate threshold for a request.

    Sources, in order: the latest prediction (ONLINE) or the first one (ONESHOT); for thresholds a
    prediction lacks, or requests with no prediction yet, the fallback: remaining tokens divided by
    an assumed tokens-per-step at that threshold (every canvas position, one recompute step per
    block not started: an upper bound, since answers stop at their EOS block). With a cache, the
    recompute steps left are the prediction's, kept within what the counters allow (at most one per
    block not started, at least one when the next step starts a block); the rest of the total is cache
    steps. Without a cache every step is a full step and is counted as a recompute step.
    """

    def __init__(
        self,
        grid: ThresholdGrid,
        fallback_tokens_per_step: Mapping[float, float],
        mode: PredictionMode = PredictionMode.ONLINE,
    ) -> None:
        self.grid = grid
        self.mode = mode
        self.rates = np.array([self._fallback_rate(fallback_tokens_per_step, t) for t in grid.values])

    def estimate(self, request: Request) -> tuple[np.ndarray, np.ndarray]:
        """(recompute steps, cache steps), one entry per candidate threshold."""
        recompute, cache = self.estimate_many([request])
        return recompute[0], cache[0]

    def estimate_many(self, requests: Sequence[Request]) -> tuple[np.ndarray, np.ndarray]:
        """(recompute, cache) steps, each (len(requests), num_thresholds).

        Totals are made non-decreasing in the threshold (a higher threshold never needs fewer
        steps), which noisy predictions can violate and the load controller relies on.
        """
        upper = np.array([r.max_remaining_recompute_steps for r in requests], dtype=float)[:, None]
        lower = np.array([r.min_remaining_recompute_steps for r in requests], dtype=float)[:, None]
        totals = self._fallback_totals(requests, upper)
        recompute = np.broadcast_to(upper, totals.shape).copy()  # the fallback's: every block left
        self._apply_predictions(requests, totals, recompute)
        totals = np.maximum.accumulate(totals, axis=1)
        no_cache = np.array([r.cache_mode == CacheMode.NONE for r in requests])
        recompute = np.minimum(np.clip(recompute, lower, upper), totals)
        recompute = np.where(no_cache[:, None], totals, recompute)
        return recompute, totals - recompute

    def _fallback_totals(self, requests: Sequence[Request], blocks_left: np.ndarray) -> np.ndarray:
        """Remaining tokens / tokens-per-step, at least one step per block not yet started."""
        remaining = np.array([r.num_remaining_tokens for r in requests], dtype=float)
        totals = np.ceil(remaining[:, None] / self.rates[None, :])
        return np.where(remaining[:, None] > 0, np.maximum(totals, blocks_left), 0.0)

    def _apply_predictions(self, requests: Sequence[Request], totals: np.ndarray, recompute: np.ndarray) -> None:
        """Overwrite fallback totals and recompute steps (in place) where a usable prediction exists."""
        online = self.mode == PredictionMode.ONLINE
        indexed = [(i, r, r.prediction if online else r.first_prediction) for i, r in enumerate(requests)]
        indexed = [(i, r, p) for i, r, p in indexed if p is not None]
        if not indexed:
            return
        missing = (np.nan, np.nan)
        split = np.array(
            [[p.threshold_to_steps.get(t, missing) for t in self.grid.values] for _, _, p in indexed], dtype=float
        )  # (requests, thresholds, [recompute, cache])
        rows = [i for i, _, _ in indexed]
        scale, elapsed = np.array([self._staleness(r, p) for _, r, p in indexed]).T
        floor = np.array([1.0 if r.num_remaining_tokens else 0.0 for _, r, _ in indexed])  # one step at least
        predicted = np.maximum(scale[:, None] * split.sum(axis=2) - elapsed[:, None], floor[:, None])
        totals[rows] = np.where(np.isnan(predicted), totals[rows], predicted)
        # a block started since the prediction was made is at most one recompute too many: the
        # counters' bounds (estimate_many) keep it within what is left
        predicted_recompute = scale[:, None] * split[:, :, 0]
        recompute[rows] = np.where(np.isnan(predicted_recompute), recompute[rows], predicted_recompute)

    def _staleness(self, request: Request, prediction: Prediction) -> tuple[float, float]:
        """(scale, steps to subtract) turning a past prediction into a remaining count now."""
        if self.mode == PredictionMode.ONESHOT:
            return request.num_remaining_tokens / max(request.gen_len, 1), 0.0
        return 1.0, float(max(request.num_steps_done - prediction.made_at_step, 0))

    @staticmethod
    def _fallback_rate(rates: Mapping[float, float], threshold: float) -> float:
        """Tokens per step at ``threshold``: exact key, else linear between neighbours."""
        points = sorted((float(t), float(r)) for t, r in rates.items())
        xs = [x for x, _ in points]
        i = bisect.bisect_left(xs, threshold - 1e-9)
        if i < len(xs) and abs(xs[i] - threshold) < 1e-9:
            return points[i][1]
        if i == 0 or i == len(xs):
            return points[min(i, len(xs) - 1)][1]
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        return y0 + (y1 - y0) * (threshold - x0) / (x1 - x0)


@dataclass(frozen=True, slots=True)
class ThresholdChoice:
    index: int
    estimated_s: float  # remaining latency at that threshold
    fits: bool  # the estimate fits the remaining budget


class ThresholdController:
    """Algorithm 1: the highest allowed threshold whose remaining-latency estimate fits the budget.

    ``est(tau) = n_rec(tau) * alpha_d(b) + n_cache(tau) * beta_d(b)`` at the batch ``b`` the
    instance will run; if no allowed threshold fits, the lowest allowed one (fastest).
    """

    @staticmethod
    def choose(
        recompute: Sequence[float],
        cache: Sequence[float],
        alpha_s: float,
        beta_s: float,
        budget_s: float,
        lo: int,
        hi: int,
    ) -> ThresholdChoice:
        index, estimate, fits = ThresholdController.choose_many(
            np.asarray([recompute], dtype=float),
            np.asarray([cache], dtype=float),
            np.array([alpha_s]),
            np.array([beta_s]),
            np.array([budget_s]),
            np.array([lo]),
            np.array([hi]),
        )
        return ThresholdChoice(int(index[0]), float(estimate[0]), bool(fits[0]))

    @staticmethod
    def choose_many(recompute, cache, alpha_s, beta_s, budget_s, lo, hi) -> tuple[np.ndarray, ...]:
        """Row-wise ``choose`` over arrays: (index, estimate at it, fits) per request."""
        estimate = recompute * alpha_s[:, None] + cache * beta_s[:, None]
        cols = np.arange(estimate.shape[1])
        allowed = (cols >= lo[:, None]) & (cols <= hi[:, None])
        feasible = allowed & (estimate <= budget_s[:, None])
        fits = feasible.any(axis=1)
        highest = estimate.shape[1] - 1 - np.argmax(feasible[:, ::-1], axis=1)
        index = np.where(fits, highest, lo)
        rows = np.arange(len(index))
        return index, estimate[rows, index], fits
