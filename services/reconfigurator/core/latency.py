"""Predicted steps and latency of a request class: the numbers Stage 1 precomputes outside the ILP.

Step prediction (defaults, overridable per workload and per class):

- recompute steps = number of blocks, ``ceil(output_tokens / block_length)``: with an approximate KV
  cache each block starts with one full forward that refreshes the cache (and commits tokens too);
- total steps per block = ``ceil(block_tokens / tokens_per_step(threshold))``, at least 1;
- cache steps = total steps - recompute steps. Without a KV cache every step is a recompute step.

``DEFAULT_TOKENS_PER_STEP`` is the class-level predictor table (average tokens committed per step).
Its shape follows the paper's LLaDA/GSM8K measurement: lowering the threshold from 0.9 to 0.7 cuts
the steps by about 38%. Thresholds between table entries are interpolated linearly.

Counted from the canvas, the defaults take every block to the canvas's end, where an answer stops at
the block that completes its EOS: on the bundled model's short answers (a canvas of 16 in blocks of 8)
they counted 6 steps at 0.7 where the engine takes 2.4, and so planned twice the GPUs a load needs.
A ``StepTable`` (the served model's measured steps per request, by canvas, block and threshold: its
calibration) replaces them where it is given (``MonitorSettings.step_table``).

Latency of a request at TP degree d, batch b: ``n_recompute * alpha_d(b) * context_scale +
n_cache * beta_d(b)``. ``context_scale`` = (prompt + output tokens) / the profile's context length
(recompute steps run over the whole sequence, so they scale with it; cache steps run over one block).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from shared.profiles import LatencyProfile

from .spec import RequestClass, StepCounts, Workload

# threshold -> average tokens committed per step (block of 32, LLaDA-like model)
DEFAULT_TOKENS_PER_STEP: dict[float, float] = {0.5: 5.0, 0.6: 4.3, 0.7: 3.6, 0.8: 2.9, 0.9: 2.2, 1.0: 1.0}


def _bracket(keys: list[float], x: float) -> tuple[float, float, float]:
    """(lo, hi, weight of hi) for linear interpolation at ``x`` among sorted ``keys``, clamped at their ends."""
    if x <= keys[0]:
        return keys[0], keys[0], 0.0
    if x >= keys[-1]:
        return keys[-1], keys[-1], 0.0
    i = bisect.bisect_left(keys, x)
    lo, hi = keys[i - 1], keys[i]
    return lo, hi, (x - lo) / (hi - lo)


def tokens_per_step(table: dict[float, float], threshold: float) -> float:
    """Linear interpolation in ``table``; clamped at its ends; never below 1."""
    lo, hi, w = _bracket(sorted(table), threshold)
    return max(1.0, table[lo] + (table[hi] - table[lo]) * w)


def default_step_counts(
    output_tokens: int, block_length: int, tokens_per_step_: float, kv_cache: bool
) -> StepCounts:
    num_full_blocks, last_block_tokens = divmod(output_tokens, block_length)
    blocks = [block_length] * num_full_blocks + ([last_block_tokens] if last_block_tokens else [])
    total_steps = sum(max(1, math.ceil(tokens / tokens_per_step_)) for tokens in blocks)
    if not kv_cache:
        return StepCounts(recompute=float(total_steps), cache=0.0)
    return StepCounts(recompute=float(len(blocks)), cache=float(total_steps - len(blocks)))


def predicted_steps(workload: Workload, request_class: RequestClass, threshold: float) -> StepCounts:
    """The class's own table entry if it has one, else the default predictor."""
    if threshold in request_class.steps_by_threshold:
        return request_class.steps_by_threshold[threshold]
    table = workload.tokens_per_step or DEFAULT_TOKENS_PER_STEP
    return default_step_counts(
        request_class.output_tokens,
        workload.block_length,
        tokens_per_step(table, threshold),
        workload.kv_cache,
    )


def context_scale(profile: LatencyProfile, request_class: RequestClass) -> float:
    if profile.context_tokens <= 0:
        return 1.0
    return max(1, request_class.prompt_tokens + request_class.output_tokens) / profile.context_tokens


def request_latency_s(
    profile: LatencyProfile, request_class: RequestClass, steps: StepCounts, tp: int, batch: int
) -> float:
    """Seconds one request of the class takes on an instance of degree ``tp`` running ``batch`` requests."""
    recompute_s = steps.recompute * profile.alpha(tp, batch) * context_scale(profile, request_class)
    return recompute_s + steps.cache * profile.beta(tp, batch)


def class_slo_s(profile: LatencyProfile, workload: Workload, request_class: RequestClass) -> float:
    """The class's SLO: its own, else the workload's, else ``slo_factor`` x isolated TP-1 latency."""
    if request_class.slo_s is not None:
        return request_class.slo_s
    if workload.slo_s is not None:
        return workload.slo_s
    smallest_tp = profile.tp_degrees[0]
    steps = predicted_steps(workload, request_class, max(workload.thresholds))
    return workload.slo_factor * request_latency_s(profile, request_class, steps, smallest_tp, 1)


@dataclass(frozen=True)
class MeasuredSteps:
    """Mean steps per request of a model at each threshold, measured on requests of one canvas and block."""

    canvas_tokens: int  # the generation length of the requests measured
    block_length: int
    steps: dict[float, StepCounts]  # threshold -> mean (recompute, cache) steps per request
    kv_cache: bool = False  # False: measured without a cache (every step counted as a recompute step)


@dataclass(frozen=True)
class StepTable:
    """A model's measured steps per request (its calibration), for Stage 1 in place of the defaults.

    ``steps`` answers for a class of ``output_tokens`` in blocks of ``block_length``: the measurement of
    the same block length if there is one (else any), of the canvas nearest the class's (by ratio),
    scaled by the class's canvas over the measured one; thresholds between measured ones interpolated
    linearly, outside them clamped to the nearest. Without a cache every step is a recompute step; with
    one, a measurement without a cache splits its steps as the default rule does (one recompute step per
    block, at most all of them).
    """

    entries: tuple[MeasuredSteps, ...]

    def __post_init__(self) -> None:
        if not self.entries or any(not e.steps or e.canvas_tokens < 1 or e.block_length < 1 for e in self.entries):
            raise ValueError("a step table needs at least one measurement, each with a canvas, a block and steps")

    def steps(self, output_tokens: int, block_length: int, threshold: float, kv_cache: bool) -> StepCounts:
        same_block = [e for e in self.entries if e.block_length == block_length] or list(self.entries)
        entry = min(same_block, key=lambda e: (abs(math.log(max(1, output_tokens) / e.canvas_tokens)), e.canvas_tokens))
        scale = max(1, output_tokens) / entry.canvas_tokens
        measured = _interpolated(entry.steps, threshold)
        total = measured.total * scale
        if not kv_cache:
            return StepCounts(recompute=total, cache=0.0)
        if entry.kv_cache:
            recompute = measured.recompute * scale
        else:
            recompute = min(total, float(math.ceil(max(1, output_tokens) / block_length)))
        return StepCounts(recompute=recompute, cache=max(0.0, total - recompute))


def _interpolated(steps: dict[float, StepCounts], threshold: float) -> StepCounts:
    lo, hi, w = _bracket(sorted(steps), threshold)
    a, b = steps[lo], steps[hi]
    return StepCounts(recompute=a.recompute + (b.recompute - a.recompute) * w, cache=a.cache + (b.cache - a.cache) * w)
