"""What a load run sends: arrival times, prompts, lengths and SLO classes, as ``PlannedRequest``s.

The simulator's workload code (``sim.workload``) makes the requests, so a load run and ``dls sim``
with the same settings and seed get the same arrivals and the same task problems: Poisson, Gamma
(vLLM's ``burstiness`` = 1/cv^2) and trace replay (BurstGPT and Azure CSV, Mooncake JSONL, read by
``shared.request_traces``; model and failure filters; timestamps at their own pace, divided by
``time_scale``, or scaled so that the mean rate is ``target_rate_rps``) come from there, and so do
the lengths ``fixed`` (few-shot count, generation length) and ``sharegpt-like`` (synthetic log-normal
lengths with ShareGPT's means, or a trace's own). Added here: ``constant`` (evenly spaced) and
``ramp`` (a Poisson process whose rate moves linearly from ``ramp_start_rps`` to ``ramp_end_rps``)
arrivals, and ``sharegpt``: prompts from a ShareGPT JSON file (free text, so no answer check).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadgen.driver import PlannedRequest
from shared.request_traces import TraceError
from sim.workload import SloClass, WorkloadConfig, generate

ARRIVALS = ("poisson", "gamma", "constant", "ramp", "trace")
LENGTHS = ("fixed", "sharegpt-like", "sharegpt")
CHARS_PER_TOKEN = 4.0  # ShareGPT output lengths, estimated without the served model's tokenizer


class WorkloadError(ValueError):
    """A load setting that cannot be used; the message names the option."""


@dataclass(frozen=True)
class LoadSpec:
    arrival: str = "poisson"  # one of ARRIVALS
    rate_rps: float = 1.0  # mean arrivals per second (poisson, gamma, constant)
    num_requests: int = 100  # cap (a trace or a duration may end sooner)
    duration_s: float | None = None  # cap on the arrival window
    burstiness: float = 1.0  # gamma: shape of the inter-arrival gaps (1: Poisson; < 1 burstier)
    ramp_start_rps: float = 1.0
    ramp_end_rps: float = 10.0
    trace_path: str | None = None  # a trace file (arrival "trace"): BurstGPT, Azure or Mooncake layout
    time_scale: float | None = None  # trace: seconds = (timestamp - first) / time_scale (None: 1)
    target_rate_rps: float | None = None  # trace: scale the timestamps to this mean rate instead
    trace_models: tuple[str, ...] = ()  # trace: keep only these BurstGPT models (empty: all)
    keep_failures: bool = False  # trace: replay failed rows (0 output tokens) too
    lengths: str = "fixed"  # one of LENGTHS
    sharegpt_path: str | None = None  # ShareGPT JSON (lengths "sharegpt")
    num_shots: int = 5  # fixed: few-shot examples per task prompt
    gen_len: int = 16  # max_tokens (fixed), the mean output (sharegpt-like), the cap (sharegpt)
    block_len: int = 8
    family: str | None = None  # restrict task prompts to one family (add, words)
    slo_ms: float | None = None  # None: the gateway's default SLO per request
    slo_classes: tuple[SloClass, ...] = (SloClass("standard", 1.0),)  # factors multiply slo_ms
    seed: int = 0


def parse_slo_class(text: str) -> SloClass:
    """``name:factor[:priority[:weight[:min_threshold]]]`` -> ``SloClass``."""
    parts = text.split(":")
    if not 2 <= len(parts) <= 5 or not parts[0]:
        raise WorkloadError(f"--slo-class {text!r}: expected name:factor[:priority[:weight[:min_threshold]]]")
    try:
        factor = float(parts[1])
        priority = int(parts[2]) if len(parts) > 2 else 0
        weight = float(parts[3]) if len(parts) > 3 else 1.0
        floor = float(parts[4]) if len(parts) > 4 else 0.0
    except ValueError:
        raise WorkloadError(f"--slo-class {text!r}: factor, weight and min_threshold are numbers, "
                            "priority an integer") from None
    if factor <= 0 or weight <= 0 or not 0 <= floor <= 1:
        raise WorkloadError(f"--slo-class {text!r}: factor and weight must be positive, min_threshold in 0..1")
    return SloClass(parts[0], factor, priority, weight, floor)


@dataclass(frozen=True)
class LoadPlan:
    requests: list[PlannedRequest]  # by arrival time
    rate_rps: float | None = None  # a trace: the mean rate replayed (native x scale)
    trace_native_rps: float | None = None  # a trace: its replayed rows' mean rate at their own timestamps
    scale: float | None = None  # a trace: seconds = trace seconds / scale


def build_plan(spec: LoadSpec) -> list[PlannedRequest]:
    """The requests of one run, by arrival time. Same spec: the same plan."""
    return plan_load(spec).requests


def plan_load(spec: LoadSpec) -> LoadPlan:
    """The requests of one run and, for a trace, the rate it is replayed at and the scale used."""
    _check(spec)
    sim_arrival = spec.arrival if spec.arrival in ("poisson", "gamma", "trace") else "poisson"
    scaled = spec.arrival == "trace" and spec.target_rate_rps is not None
    config = WorkloadConfig(
        arrival=sim_arrival, num_requests=spec.num_requests,
        duration_s=spec.duration_s if spec.arrival in ("poisson", "gamma") else None,
        cv=1.0 / math.sqrt(spec.burstiness), trace_path=spec.trace_path,
        time_scale=None if scaled else (spec.time_scale or 1.0),
        trace_models=spec.trace_models, trace_keep_failures=spec.keep_failures,
        lengths="fixed" if spec.lengths == "sharegpt" else spec.lengths, num_shots=spec.num_shots,
        gen_len=spec.gen_len, block_len=spec.block_len, slo_classes=spec.slo_classes, family=spec.family,
        seed=spec.seed,
    )
    rate = spec.target_rate_rps if scaled else spec.rate_rps
    try:
        workload = generate(config, rate, (spec.slo_ms or 1000.0) / 1000.0)
    except TraceError as exc:
        raise WorkloadError(f"--trace: {exc}") from None
    requests = workload.requests
    if spec.arrival in ("constant", "ramp"):
        times = _constant(spec) if spec.arrival == "constant" else _ramp(spec)
        requests = [dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(requests, times, strict=False)]
    texts = _sharegpt(spec, len(requests)) if spec.lengths == "sharegpt" else None
    plan = []
    for i, r in enumerate(requests):
        planned = PlannedRequest(
            arrival_s=r.arrival_s, problem=r.problem, slo_ms=r.slo_s * 1000.0 if spec.slo_ms else None,
            max_tokens=r.gen_len, block_length=r.block_len, priority=r.priority,
            min_threshold=r.min_threshold or None, slo_class=r.slo_class,
        )
        if texts is not None:
            prompt, max_tokens = texts[i]
            planned = dataclasses.replace(planned, problem=None, text=prompt, max_tokens=max_tokens,
                                          block_length=min(spec.block_len, max_tokens))
        plan.append(planned)
    if workload.scale is None:
        return LoadPlan(plan)
    return LoadPlan(plan, workload.rate_rps, workload.trace_native_rps, workload.scale)


def _check(spec: LoadSpec) -> None:
    if spec.arrival not in ARRIVALS:
        raise WorkloadError(f"--arrival: unknown {spec.arrival!r}; known: {', '.join(ARRIVALS)}")
    if spec.lengths not in LENGTHS:
        raise WorkloadError(f"--lengths: unknown {spec.lengths!r}; known: {', '.join(LENGTHS)}")
    if spec.num_requests < 1:
        raise WorkloadError("--num-requests: must be at least 1")
    if spec.arrival in ("poisson", "gamma", "constant") and not spec.rate_rps > 0:
        raise WorkloadError("--rate: must be positive")
    if spec.arrival == "gamma" and not spec.burstiness > 0:
        raise WorkloadError("--burstiness: must be positive")
    if spec.arrival == "ramp" and not (spec.ramp_start_rps > 0 and spec.ramp_end_rps > 0):
        raise WorkloadError("--ramp-start-rps and --ramp-end-rps: must be positive")
    if spec.arrival == "trace" and not spec.trace_path:
        raise WorkloadError("--trace: a trace file is needed for arrival 'trace'")
    if spec.time_scale is not None and not spec.time_scale > 0:
        raise WorkloadError("--time-scale: must be positive")
    if spec.target_rate_rps is not None:
        if spec.arrival != "trace":
            raise WorkloadError("--target-rate: scales a --trace; use --rate for generated arrivals")
        if spec.time_scale is not None:
            raise WorkloadError("--target-rate and --time-scale: give one (each sets the trace's pace)")
        if not spec.target_rate_rps > 0:
            raise WorkloadError("--target-rate: must be positive")
    if spec.lengths == "sharegpt" and not spec.sharegpt_path:
        raise WorkloadError("--sharegpt: a ShareGPT JSON file is needed for lengths 'sharegpt'")
    if spec.slo_ms is None and any(c.slo_factor != 1.0 for c in spec.slo_classes):
        raise WorkloadError("--slo-class: SLO factors multiply --slo-ms; give --slo-ms too")
    if spec.slo_ms is not None and not spec.slo_ms > 0:
        raise WorkloadError("--slo-ms: must be positive")


def _constant(spec: LoadSpec) -> np.ndarray:
    times = np.arange(spec.num_requests) / spec.rate_rps
    return times[times < spec.duration_s] if spec.duration_s is not None else times


def _ramp(spec: LoadSpec) -> np.ndarray:
    """Poisson with a rate moving linearly from start to end over the run (time rescaling).

    The run lasts T = 2n / (r0 + r1) (so n arrivals are expected); the expected count by t is
    r0 t + (r1 - r0) t^2 / 2T, inverted at the unit-rate Poisson process's event times.
    """
    n, r0, r1 = spec.num_requests, spec.ramp_start_rps, spec.ramp_end_rps
    total = spec.duration_s or 2.0 * n / (r0 + r1)
    rng = np.random.default_rng([spec.seed, 17])
    counts = np.cumsum(rng.exponential(1.0, n))
    a = (r1 - r0) / (2.0 * total)
    if abs(a) < 1e-12:
        times = counts / r0
    else:
        times = (-r0 + np.sqrt(np.maximum(r0 * r0 + 4.0 * a * counts, 0.0))) / (2.0 * a)
    times = times[np.isfinite(times)]
    return times[times < total] if spec.duration_s is not None else times


def read_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, answer) pairs: the first two turns of each conversation with at least two."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise WorkloadError(f"--sharegpt: file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"--sharegpt: {path} is not JSON ({exc})") from None
    if not isinstance(data, list):
        raise WorkloadError(f"--sharegpt: {path} must hold a list of conversations")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if isinstance(first, dict) and isinstance(second, dict) and first.get("value") and second.get("value"):
            pairs.append((str(first["value"]), str(second["value"])))
    return pairs


def _sharegpt(spec: LoadSpec, n: int) -> list[tuple[str, int]]:
    """n (prompt, max_tokens) by seeded shuffle, with vLLM's filters on the estimated token counts
    (prompt and output at least 4, prompt at most 1024, together at most 2048); max_tokens is the
    answer's estimated length in whole blocks, capped at ``gen_len``."""
    pairs = read_sharegpt(spec.sharegpt_path)
    rng = np.random.default_rng([spec.seed, 23])
    order = rng.permutation(len(pairs))
    out = []
    for i in order:
        prompt, answer = pairs[i]
        p_tokens, o_tokens = len(prompt) / CHARS_PER_TOKEN, len(answer) / CHARS_PER_TOKEN
        if p_tokens < 4 or o_tokens < 4 or p_tokens > 1024 or p_tokens + o_tokens > 2048:
            continue
        blocks = max(1, math.ceil(min(o_tokens, spec.gen_len) / spec.block_len))
        out.append((prompt, min(blocks * spec.block_len, max(spec.gen_len, spec.block_len))))
        if len(out) == n:
            break
    if not out:
        raise WorkloadError(f"--sharegpt: no usable conversation in {spec.sharegpt_path}")
    while len(out) < n:  # fewer conversations than requests: go round again
        out.append(out[len(out) % max(len(out), 1)])
    return out


def write_burstgpt(plan: list[PlannedRequest], path: str | Path, model: str = "dls-tiny") -> None:
    """The plan's arrivals as a BurstGPT CSV (``dls sim --trace F --time-scale 1`` replays them as sent)."""
    lines = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"]
    for p in plan:
        prompt = len(p.prompt)
        lines.append(f"{p.arrival_s:.6f},{model},{prompt},{p.max_tokens},{prompt + p.max_tokens},API log")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")
