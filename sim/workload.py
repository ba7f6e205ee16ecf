"""Workloads: arrival processes, length distributions, SLO classes; the requests a run replays.

Arrivals (registry ``ARRIVALS``): ``poisson``, ``gamma`` (coefficient of variation ``cv``; vLLM's
``burstiness`` is ``1/cv^2``), ``trace`` (a production trace, BurstGPT, Azure or Mooncake layout, read
by ``shared.request_traces``: its timestamps scaled so that the replayed window's mean rate is the
run's rate, or divided by an explicit ``time_scale``) and ``burstgpt-like`` (no file: a rate that moves
between quiet periods and peaks, with Gamma(shape 0.5) gaps inside each minute, BurstGPT's burstiness).

Lengths (registry ``LENGTHS``): ``fixed`` (``num_shots`` few-shot examples, the model's generation
length) and ``sharegpt-like`` (prompt and output lengths log-normal with means 140 and 264, as in the
paper's Table 2, mapped onto the task generator: prompt tokens -> few-shot count at 28 tokens per
example (140 -> 5 shots, clipped to 0..8); output tokens -> generation length in whole blocks
(264 -> 16 tokens, 8 to 32); 8-token generations get arithmetic problems, whose answers fit one block).

Each request carries its task problem (drawn from the held-out split with the workload's seed), so the
model-in-the-loop engine decodes it and the replay engine looks up its family and length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from shared.request_traces import TraceReplay, read_trace
from shared.tasks import Family, Problem, Split, TaskGenerator
from sim.registry import Registry

SHAREGPT_PROMPT_MEAN = 140.0
SHAREGPT_OUTPUT_MEAN = 264.0
TOKENS_PER_SHOT = SHAREGPT_PROMPT_MEAN / 5  # 140 nominal prompt tokens <-> the paper's 5-shot prompts
MAX_SHOTS = 8
DEFAULT_MODEL = "default"  # the one model of a run: every request names it, every instance serves it


@dataclass(frozen=True)
class SloClass:
    name: str
    slo_factor: float  # SLO = factor x the isolated TP-1 latency at threshold 0.9
    priority: int = 0
    weight: float = 1.0  # share of requests
    min_threshold: float = 0.0  # quality floor


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload, before it reaches the simulator."""

    request_id: str
    arrival_s: float
    problem: Problem
    gen_len: int
    block_len: int
    slo_s: float
    priority: int = 0
    slo_class: str = "standard"
    min_threshold: float = 0.0
    max_threshold: float = 1.0  # its ceiling (the multi-model preset's frozen thresholds pin both)
    nominal_prompt_tokens: int = 0  # ShareGPT-like length the request stands for (0: none)
    nominal_output_tokens: int = 0
    model: str = DEFAULT_MODEL  # the model it names: it runs only on instances of it (ClusterSpec.model)


@dataclass(frozen=True)
class WorkloadConfig:
    arrival: str = "poisson"  # ARRIVALS name
    num_requests: int = 1000  # cap (the trace may end sooner)
    duration_s: float | None = None  # cap on the arrival window (None: num_requests decides)
    cv: float = 2.0  # gamma arrivals
    trace_path: str | None = None  # trace: the file (shared.request_traces.LAYOUTS)
    trace_layout: str | None = None  # trace: None detects it from the file
    # trace: None scales the timestamps to the run's rate (mean over the replayed window); a number
    # replaces that rate: seconds = (timestamp - first) / time_scale
    time_scale: float | None = None
    trace_models: tuple[str, ...] = ()  # trace: keep only BurstGPT rows of these models (empty: all)
    trace_keep_failures: bool = False  # trace: keep failed rows (0 output tokens) too
    peak_to_mean: float = 2.5  # burstgpt-like: peak rate / mean rate
    period_s: float = 600.0  # burstgpt-like: length of one quiet-peak-quiet cycle
    lengths: str = "fixed"  # LENGTHS name
    num_shots: int = 5
    gen_len: int = 16
    block_len: int = 8
    slo_classes: tuple[SloClass, ...] = (SloClass("standard", 5.0),)
    family: str | None = None  # restrict problems to one task family
    seed: int = 0


# --- arrivals ----------------------------------------------------------------------------------

ArrivalFn = Callable[[WorkloadConfig, float, np.random.Generator], np.ndarray]
ARRIVALS: Registry[ArrivalFn] = Registry("arrival process")


def _cap(times: np.ndarray, config: WorkloadConfig) -> np.ndarray:
    if config.duration_s is not None:
        times = times[times < config.duration_s]
    return times[: config.num_requests]


def poisson_arrivals(config: WorkloadConfig, rate: float, rng: np.random.Generator) -> np.ndarray:
    n = _count_for(config, rate)
    return _cap(np.cumsum(rng.exponential(1.0 / rate, n)), config)


def gamma_arrivals(config: WorkloadConfig, rate: float, rng: np.random.Generator) -> np.ndarray:
    shape = 1.0 / config.cv**2
    n = _count_for(config, rate)
    return _cap(np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), n)), config)


def burstgpt_like_arrivals(config: WorkloadConfig, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Mean ``rate``; per-minute rates follow quiet-peak cycles with log-normal noise; Gamma(0.5) gaps."""
    duration = config.duration_s or config.num_requests / rate
    minute = min(60.0, config.period_s / 8)
    num_bins = max(1, math.ceil(duration / minute))
    centres = (np.arange(num_bins) + 0.5) * minute
    shape = 0.5 - 0.5 * np.cos(2 * np.pi * centres / config.period_s)  # 0 quiet .. 1 peak
    relative = 0.1 + shape**2 * (config.peak_to_mean - 0.1) * rng.lognormal(0.0, 0.15, num_bins)
    per_bin = rate * relative / relative.mean()
    times = []
    for i, bin_rate in enumerate(per_bin):
        gaps = rng.gamma(0.5, 1.0 / (bin_rate * 0.5), int(bin_rate * minute * 3) + 8)
        t = i * minute + np.cumsum(gaps)
        times.append(t[t < (i + 1) * minute])
    return _cap(np.concatenate(times), config)


def trace_replay(config: WorkloadConfig, rate: float) -> TraceReplay:
    """The trace's window at ``rate`` (or at ``config.time_scale`` when one is set), capped as the config says."""
    trace = read_trace(config.trace_path, layout=config.trace_layout, models=config.trace_models,
                       keep_failures=config.trace_keep_failures)
    scaled = {"time_scale": config.time_scale} if config.time_scale is not None else {"rate_rps": rate}
    return trace.replay(num_requests=config.num_requests, duration_s=config.duration_s, **scaled)


def trace_arrivals(config: WorkloadConfig, rate: float, rng: np.random.Generator) -> np.ndarray:
    return np.array(trace_replay(config, rate).times)


def _count_for(config: WorkloadConfig, rate: float) -> int:
    if config.duration_s is None:
        return config.num_requests
    return min(config.num_requests, int(config.duration_s * rate * 1.5) + 16)


ARRIVALS.register("poisson", poisson_arrivals)
ARRIVALS.register("gamma", gamma_arrivals)
ARRIVALS.register("burstgpt-like", burstgpt_like_arrivals)
ARRIVALS.register("trace", trace_arrivals)


# --- lengths -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What one request asks for, on the task generator's scale."""

    num_shots: int
    gen_len: int
    family: Family | None = None
    nominal_prompt_tokens: int = 0
    nominal_output_tokens: int = 0


LengthFn = Callable[[WorkloadConfig, int, np.random.Generator, list | None], list[Shape]]
LENGTHS: Registry[LengthFn] = Registry("length distribution")


def _family(config: WorkloadConfig) -> Family | None:
    return Family(config.family) if config.family else None


def fixed_lengths(config: WorkloadConfig, n: int, rng: np.random.Generator, trace_rows) -> list[Shape]:
    return [Shape(config.num_shots, config.gen_len, _family(config)) for _ in range(n)]


def sharegpt_like_lengths(config: WorkloadConfig, n: int, rng: np.random.Generator, trace_rows) -> list[Shape]:
    """Log-normal prompt/output lengths with ShareGPT's means (or a trace's own lengths)."""
    if trace_rows is not None:
        prompts = np.array([r[1] for r in trace_rows[:n]], dtype=float)
        outputs = np.array([r[2] for r in trace_rows[:n]], dtype=float)
    else:
        prompts = _lognormal_with_mean(rng, SHAREGPT_PROMPT_MEAN, 0.9, n)
        outputs = _lognormal_with_mean(rng, SHAREGPT_OUTPUT_MEAN, 0.8, n)
    return [_shape_of(int(p), int(o), config) for p, o in zip(prompts, outputs, strict=True)]


def _lognormal_with_mean(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    return np.clip(rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, n), 4, 2048)


def _shape_of(prompt_tokens: int, output_tokens: int, config: WorkloadConfig) -> Shape:
    shots = int(np.clip(round(prompt_tokens / TOKENS_PER_SHOT), 0, MAX_SHOTS))
    blocks_per_mean = config.gen_len / config.block_len  # the mean output maps to the model's length
    num_blocks = int(np.clip(round(output_tokens / SHAREGPT_OUTPUT_MEAN * blocks_per_mean), 1, 4))
    family = Family.ADD if num_blocks == 1 else _family(config)
    return Shape(shots, num_blocks * config.block_len, family, prompt_tokens, output_tokens)


LENGTHS.register("fixed", fixed_lengths)
LENGTHS.register("sharegpt-like", sharegpt_like_lengths)


# --- the workload ------------------------------------------------------------------------------


@dataclass
class Workload:
    config: WorkloadConfig
    rate_rps: float  # the mean rate asked of a generator, or the rate a trace is replayed at
    requests: list[RequestSpec] = field(default_factory=list)
    trace_native_rps: float | None = None  # trace: the replayed window's rate at its own timestamps
    scale: float | None = None  # trace: replay seconds = trace seconds / scale (rate_rps = native x scale)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0


def generate(config: WorkloadConfig, rate_rps: float, base_latency_s: float) -> Workload:
    """The requests of one run: arrivals at ``rate_rps`` (mean), shapes, problems and SLOs.

    A trace is replayed at ``rate_rps`` unless ``config.time_scale`` replaces it; the workload's
    ``rate_rps`` is the rate replayed, and it records the trace's native rate and the scale used.

    ``base_latency_s`` is the isolated TP-1 latency at threshold 0.9; each SLO class scales it.
    Same config, rate and base latency: the same requests.
    """
    rng = np.random.default_rng([config.seed, int(round(rate_rps * 1000))])
    replay = trace_replay(config, rate_rps) if config.arrival == "trace" else None
    times = np.array(replay.times) if replay else ARRIVALS.get(config.arrival)(config, rate_rps, rng)
    trace_rows = list(replay.rows) if replay else None
    shapes = LENGTHS.get(config.lengths)(config, len(times), rng, trace_rows)
    classes = config.slo_classes
    weights = np.array([c.weight for c in classes], dtype=float)
    class_index = rng.choice(len(classes), size=len(times), p=weights / weights.sum())
    tasks = TaskGenerator(seed=config.seed)
    requests = []
    for i, (t, shape, k) in enumerate(zip(times.tolist(), shapes, class_index.tolist(), strict=True)):
        slo_class = classes[k]
        problem = tasks.problem(shape.num_shots, Split.HELD_OUT, shape.family)
        requests.append(
            RequestSpec(
                request_id=f"r{i:06d}",
                arrival_s=float(t),
                problem=problem,
                gen_len=shape.gen_len,
                block_len=config.block_len,
                slo_s=slo_class.slo_factor * base_latency_s,
                priority=slo_class.priority,
                slo_class=slo_class.name,
                min_threshold=slo_class.min_threshold,
                nominal_prompt_tokens=shape.nominal_prompt_tokens,
                nominal_output_tokens=shape.nominal_output_tokens,
            )
        )
    if replay:
        return Workload(config, replay.rate_rps, requests, replay.native_rps, replay.scale)
    return Workload(config, rate_rps, requests)
