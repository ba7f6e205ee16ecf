"""Error measures and the update-granularity study (pure numpy; ``bench.predictor`` drives them).

Rows are (request, steps done) points of unfinished requests, so the true remaining steps are >= 1
and the relative error ``|predicted - actual| / actual`` is always defined.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.predictor.core.policy import Granularity, UpdateMark, UpdatePolicy

DEFAULT_GRANULARITIES = (
    "step", "steps:2", "steps:3", "steps:4", "steps:6", "steps:8",
    "progress:0.1", "progress:0.2", "progress:0.25", "progress:0.34", "progress:0.5", "oneshot",
    "step+final", "steps:2+final", "progress:0.1+final", "progress:0.2+final",
)
TOLERANCE = 0.05  # within 5% (relative) of per-step updates' mean relative error


def errors(predicted: np.ndarray, actual: np.ndarray) -> dict:
    """Mean absolute and mean relative error of remaining steps, and ``total_ratio``: the predicted
    steps summed over the actual ones (below 1: the estimates are biased low, which the scheduler
    reads as slack that is not there)."""
    predicted, actual = np.asarray(predicted, dtype=float), np.asarray(actual, dtype=float)
    if len(actual) == 0:
        return {"num_rows": 0, "mae": None, "mre": None, "total_ratio": None}
    gap = np.abs(predicted - actual)
    return {"num_rows": int(len(actual)), "mae": float(gap.mean()), "mre": float((gap / actual).mean()),
            "total_ratio": float(predicted.sum() / actual.sum())}


def error_table(predicted: np.ndarray, actual: np.ndarray, thresholds: np.ndarray) -> dict:
    """Overall errors and errors per threshold (keys formatted with ``:g``)."""
    thresholds = np.asarray(thresholds, dtype=float)
    by_threshold = {
        f"{tau:g}": errors(predicted[thresholds == tau], actual[thresholds == tau]) for tau in np.unique(thresholds)
    }
    return {"overall": errors(predicted, actual), "by_threshold": by_threshold}


def grouped_errors(predicted: np.ndarray, actual: np.ndarray, groups: Sequence) -> dict:
    """``errors`` per group value (keys as strings, integral floats without a decimal point)."""
    groups = np.asarray(groups)
    out = {}
    for value in sorted(set(groups.tolist())):
        key = f"{value:g}" if isinstance(value, float) else str(value)
        out[key] = errors(predicted[groups == value], actual[groups == value])
    return out


def aged_one_shot(arrival_total: np.ndarray, num_steps_done: np.ndarray) -> np.ndarray:
    """The arrival estimate turned into a remaining count after some steps (at least one step)."""
    return np.maximum(np.asarray(arrival_total, dtype=float) - np.asarray(num_steps_done, dtype=float), 1.0)


def replay_policy(
    policy: UpdatePolicy,
    request_ids: Sequence[str],
    steps: np.ndarray,
    progress: np.ndarray,
    predicted: np.ndarray,
) -> tuple[np.ndarray, int]:
    """(estimate in force at every row, number of updates) when predictions refresh per ``policy``.

    ``predicted`` is the fresh prediction at each row; between updates the last one is aged by the
    steps run since. Rows must be grouped by request, in step order; a request's first row always
    updates (arrival, or the first state with a known future threshold).
    """
    estimates = np.empty(len(steps), dtype=float)
    num_updates = 0
    last: UpdateMark | None = None
    last_value = 0.0
    for i in range(len(steps)):
        if i == 0 or request_ids[i] != request_ids[i - 1]:
            last = None
        if policy.is_due(last, int(steps[i]), float(progress[i])):
            last, last_value = UpdateMark(int(steps[i]), float(progress[i]), float(predicted[i])), float(predicted[i])
            num_updates += 1
        estimates[i] = max(last_value - (steps[i] - last.num_steps_done), 1.0)
    return estimates, num_updates


def granularity_study(
    request_ids: Sequence[str],
    steps: np.ndarray,
    progress: np.ndarray,
    predicted: np.ndarray,
    actual: np.ndarray,
    granularities: Sequence[str] = DEFAULT_GRANULARITIES,
    tolerance: float = TOLERANCE,
) -> dict:
    """Error and cost per granularity, and the coarsest one within ``tolerance`` of per-step updates.

    Cost is counted in predictor updates (each one row per candidate threshold); ``cost_fraction``
    is relative to per-step updates, ``cost_saved`` is one minus it.
    """
    num_requests = len(set(request_ids))
    results = []
    for name in granularities:
        estimates, num_updates = replay_policy(UpdatePolicy.parse(name), request_ids, steps, progress, predicted)
        results.append({"granularity": name, **errors(estimates, actual), "num_updates": num_updates,
                        "updates_per_request": num_updates / max(num_requests, 1)})
    base = next(r for r in results if r["granularity"] == Granularity.STEP.value)
    for r in results:
        r["relative_error_vs_per_step"] = r["mre"] / base["mre"] - 1.0 if base["mre"] else 0.0
        r["cost_fraction"] = r["num_updates"] / base["num_updates"]
        r["cost_saved"] = 1.0 - r["cost_fraction"]
    chosen = choose_granularity(results, tolerance)
    return {
        "tolerance": tolerance,
        "chosen": chosen["granularity"],
        "relative_error_vs_per_step": chosen["relative_error_vs_per_step"],
        "cost_saved": chosen["cost_saved"],
        "per_step_mre": base["mre"],
        "table": results,
    }


def choose_granularity(results: Sequence[dict], tolerance: float = TOLERANCE) -> dict:
    """The cheapest (fewest updates) result whose error is within ``tolerance`` of per-step's.

    Ties go to the lower error. Per-step updates always qualify, so there is always a choice.
    """
    fitting = [r for r in results if r["relative_error_vs_per_step"] <= tolerance + 1e-12]
    return min(fitting, key=lambda r: (r["num_updates"], r["mre"]))
