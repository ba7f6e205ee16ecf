"""The workload monitor: arrival events in, request classes with rates out.

Requests are classed by prompt-length and output-length buckets. A class's rate is its arrivals in
the last ``window_s`` seconds divided by the window (or by the time observed so far, while that is
shorter, but never less than ``min_window_s`` so that the first few arrivals do not read as a
burst), or, with ``peak_windows`` > 1, the highest such rate of the last ``peak_windows`` windows
(back to back, the newest first). Plans are made for the next period, and a bursty workload's next
burst is about as large as its last one: planned for the quiet spell alone, a cluster reshaped for
low latency (fewer, wider instances) meets the burst with a fraction of its throughput, and
switching back costs drains and start-ups just when the capacity is needed (on the Azure code
trace that cost DiLaServe up to 12 points of SLO attainment against baselines that never
reconfigure). The peak memory keeps such a plan until the workload has been quiet for
``peak_windows`` windows, and until the monitor has watched that long (``has_full_memory``) the
reconfigurator makes no plan for a gain alone, only to replace a shape that cannot serve the load. The safety buffer is not applied here: it travels in the ``Workload`` and Stage 1 applies it
to every rate (``Workload.planned_rate``), so it is applied exactly once.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from .latency import StepTable
from .spec import DEFAULT_BLOCK_LENGTH, DEFAULT_SAFETY_BUFFER, DEFAULT_THRESHOLDS, RequestClass, Workload


@dataclass(frozen=True)
class ArrivalEvent:
    """One request arrival, as the scheduler publishes it."""

    time_s: float  # arrival time on the monitor's clock
    prompt_tokens: int
    output_tokens: int  # requested generation length
    slo_s: float | None = None  # the request's latency SLO, when it has its own


@dataclass(frozen=True)
class LengthBuckets:
    """Upper edges (inclusive) of the length buckets; one more bucket above the last edge."""

    prompt_edges: tuple[int, ...] = (256, 1024)
    output_edges: tuple[int, ...] = (128, 512)

    def bucket_of(self, prompt_tokens: int, output_tokens: int) -> tuple[int, int]:
        return bisect.bisect_left(self.prompt_edges, prompt_tokens), bisect.bisect_left(
            self.output_edges, output_tokens
        )

    def name_of(self, bucket: tuple[int, int]) -> str:
        return f"p{_range_label(self.prompt_edges, bucket[0])},o{_range_label(self.output_edges, bucket[1])}"


def _range_label(edges: tuple[int, ...], index: int) -> str:
    if index == len(edges):
        return f">{edges[-1]}" if edges else "any"
    low = edges[index - 1] + 1 if index > 0 else 0
    return f"{low}-{edges[index]}"


@dataclass(frozen=True)
class MonitorSettings:
    window_s: float = 300.0  # sliding window of arrivals
    bin_s: float = 1.0  # arrivals are aggregated per bin: memory and snapshot cost do not grow with the rate
    min_window_s: float = 10.0  # rates are never computed over less than this
    peak_windows: int = 8  # a class's rate is the highest of its last this many windows (1: the window's)
    safety_buffer: float = DEFAULT_SAFETY_BUFFER
    buckets: LengthBuckets = field(default_factory=LengthBuckets)
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS
    block_length: int = DEFAULT_BLOCK_LENGTH
    kv_cache: bool = True
    slo_s: float | None = None  # default SLO for requests without one (None: the workload's factor rule)
    # the served model's measured steps per request (its calibration); None: counted from the canvas with
    # the default tokens-per-step table (``latency.py``)
    step_table: StepTable | None = None


@dataclass
class _BinTotals:
    """Arrivals of one class in one time bin."""

    count: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    min_slo_s: float | None = None  # the tightest SLO carried by an arrival, if any carried one

    def add(self, event: ArrivalEvent) -> None:
        self.count += 1
        self.prompt_tokens += event.prompt_tokens
        self.output_tokens += event.output_tokens
        if event.slo_s is not None:
            self.min_slo_s = event.slo_s if self.min_slo_s is None else min(self.min_slo_s, event.slo_s)

    def merge(self, other: _BinTotals) -> None:
        self.count += other.count
        self.prompt_tokens += other.prompt_tokens
        self.output_tokens += other.output_tokens
        if other.min_slo_s is not None:
            self.min_slo_s = (
                other.min_slo_s if self.min_slo_s is None else min(self.min_slo_s, other.min_slo_s)
            )


class WorkloadMonitor:
    """Tracks arrivals per class over a sliding window; ``snapshot()`` gives Stage 1's input.

    Arrivals are summed in bins of ``bin_s`` seconds; a bin counts while any part of it is inside
    the window, so a rate may include up to one bin more than the window (``bin_s / window_s``,
    0.3% with the defaults).
    """

    def __init__(self, clock: Callable[[], float], settings: MonitorSettings | None = None) -> None:
        self._clock = clock
        self._settings = settings or MonitorSettings()
        self._started_at = clock()
        # bin index -> (prompt bucket, output bucket) -> totals
        self._bins: dict[int, dict[tuple[int, int], _BinTotals]] = {}

    def observe(self, event: ArrivalEvent) -> None:
        """Record one arrival (a late event counts in the bin of its own time)."""
        bin_index = math.floor(event.time_s / self._settings.bin_s)
        bucket = self._settings.buckets.bucket_of(event.prompt_tokens, event.output_tokens)
        self._bins.setdefault(bin_index, {}).setdefault(bucket, _BinTotals()).add(event)

    def snapshot(self) -> Workload:
        """Classes seen in the window, with their rates and mean lengths, as of ``clock()``."""
        now = self._clock()
        s = self._settings
        num_windows = max(1, s.peak_windows)
        self._evict_before(now - s.window_s * num_windows)
        bucket_totals: dict[tuple[int, int], _BinTotals] = {}  # (prompt, output bucket) -> totals
        counts: dict[tuple[int, int], list[int]] = {}  # bucket -> arrivals per window, the newest first
        for bin_index, buckets in self._bins.items():
            start = bin_index * s.bin_s
            if start > now:
                continue
            # a bin counts in the window its end falls in (the newest: while any part of it is inside)
            k = min(num_windows - 1, max(0, math.floor((now - start - s.bin_s) / s.window_s)))
            for bucket, totals in buckets.items():
                bucket_totals.setdefault(bucket, _BinTotals()).merge(totals)
                counts.setdefault(bucket, [0] * num_windows)[k] += totals.count
        window_s = self._effective_window_s(now)
        classes = tuple(
            self._request_class(bucket, totals, self._peak_rate(counts[bucket], window_s))
            for bucket, totals in sorted(bucket_totals.items())
        )
        return Workload(
            classes=classes,
            thresholds=s.thresholds,
            safety_buffer=s.safety_buffer,
            block_length=s.block_length,
            kv_cache=s.kv_cache,
            slo_s=s.slo_s,
        )

    @property
    def memory_s(self) -> float:
        """How far back the planned rates look: ``peak_windows`` windows."""
        return self._settings.window_s * max(1, self._settings.peak_windows)

    def observed_s(self) -> float:
        return self._clock() - self._started_at

    def has_full_memory(self) -> bool:
        """Has the monitor watched arrivals for its whole peak memory (so a quiet start is not read
        as a quiet workload)?"""
        return self.observed_s() >= self.memory_s

    def _effective_window_s(self, now: float) -> float:
        observed_s = now - self._started_at
        return max(self._settings.min_window_s, min(self._settings.window_s, observed_s))

    def _peak_rate(self, counts: list[int], newest_window_s: float) -> float:
        """The highest rate among the windows (the newest measured over ``newest_window_s``; the older
        ones are whole windows, seen only once the monitor has run that long)."""
        rate = counts[0] / newest_window_s
        return max([rate] + [c / self._settings.window_s for c in counts[1:]])

    def _evict_before(self, cutoff: float) -> None:
        """Drop bins that end at or before ``cutoff``."""
        for bin_index in [i for i in self._bins if (i + 1) * self._settings.bin_s <= cutoff]:
            del self._bins[bin_index]

    def _request_class(self, bucket: tuple[int, int], totals: _BinTotals, rate: float) -> RequestClass:
        # Mean lengths stand for the class; the safety buffer on the rate absorbs the rest. The SLO is
        # the tightest any request of the class carried (conservative); None: the workload default.
        s = self._settings
        output_tokens = max(1, math.ceil(totals.output_tokens / totals.count))
        measured = {} if s.step_table is None else {
            t: s.step_table.steps(output_tokens, s.block_length, t, s.kv_cache) for t in s.thresholds}
        return RequestClass(
            name=s.buckets.name_of(bucket),
            prompt_tokens=math.ceil(totals.prompt_tokens / totals.count),
            output_tokens=output_tokens,
            rate=rate,
            slo_s=totals.min_slo_s,
            steps_by_threshold=measured,
        )
