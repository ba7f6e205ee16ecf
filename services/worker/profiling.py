"""Step latency per step kind and batch size on this device, in the profile format (``shared/profiles.py``):
what `dls profile` and `dls calibrate` (``calibrate/profile.py``, every TP degree, resumable) measure.

Each measurement builds ``batch`` fresh requests whose prompt plus generation is ``context_tokens``
long, runs their first step (a recompute step: full forward that fills the dual cache) and then a
cache step (threshold 1.0, so the block stays open), and takes the median over ``repeats``.
A step without cache (``full_ms``) is a full forward too, measured with cache mode ``none``.

Batch sizes double from 1 up to the largest asked (``batch_sizes``); on a GPU the largest is also
bounded by memory: ``measure_batches`` stops doubling at the first batch that runs out of it and says
so (``Curves.bounded_by_memory``).
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.worker.engine.engine import DLMEngine
from services.worker.kv.pages import KVBudgetExceeded
from shared.messages.base import CacheMode, StepKind

KINDS = ("recompute_ms", "cache_ms", "full_ms")


def _requests(engine: DLMEngine, batch: int, context_tokens: int, mode: CacheMode, rng: random.Random, tag: str):
    gen_length = engine.default_gen_length
    prompt_length = max(1, context_tokens - gen_length)
    vocab = range(3, engine.model.config.vocab_size)
    return [
        engine.new_request(f"{tag}{i}", [rng.choice(vocab) for _ in range(prompt_length)], gen_length, None, mode)
        for i in range(batch)
    ]


def _timed_step(engine: DLMEngine, states, expected: StepKind) -> float:
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)
    started = time.perf_counter()
    results = engine.step([(s, 1.0) for s in states])
    elapsed = time.perf_counter() - started  # the step reads its commits back: the device is done
    assert all(r.kind is expected for r in results), "profiling measured the wrong step kind"
    return elapsed


def measure(engine: DLMEngine, batch: int, context_tokens: int, repeats: int, seed: int = 0) -> dict[str, float]:
    """Median milliseconds of a recompute, a cache and a no-cache step at this batch size (the requests
    are dropped afterwards, also when a step fails, e.g. out of device memory)."""
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}  # kind -> ms
    for round_ in range(repeats + 1):  # the first round warms up and is discarded
        created = []
        try:
            dual = _requests(engine, batch, context_tokens, CacheMode.DUAL, rng, f"p{round_}-")
            created += dual
            recompute = _timed_step(engine, dual, StepKind.RECOMPUTE)
            cache = _timed_step(engine, dual, StepKind.CACHE)
            full_states = _requests(engine, batch, context_tokens, CacheMode.NONE, rng, f"f{round_}-")
            created += full_states
            full = _timed_step(engine, full_states, StepKind.RECOMPUTE)
        finally:
            for s in created:
                engine.drop(s.request_id)
        for key, value in (("recompute_ms", recompute), ("cache_ms", cache), ("full_ms", full)):
            samples[key].append(value * 1000)
    return {key: round(statistics.median(values[1:]), 3) for key, values in samples.items()}


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch`` (``max_batch`` itself last where it is no power of two)."""
    if max_batch < 1:
        raise ValueError(f"the largest batch must be at least 1, got {max_batch}")
    sizes, batch = [], 1
    while batch < max_batch:
        sizes.append(batch)
        batch *= 2
    return [*sizes, max_batch]


def out_of_memory(exc: BaseException) -> bool:
    """A step that did not fit in device memory (the allocator's error, or the KV pool's budget)."""
    return isinstance(exc, torch.OutOfMemoryError | KVBudgetExceeded) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


@dataclass
class Curves:
    """Step times of one engine: kind -> batch (as a string, the profile's keys) -> ms."""

    ms: dict[str, dict[str, float]] = field(default_factory=lambda: {kind: {} for kind in KINDS})
    bounded_by_memory: int | None = None  # the first batch that did not fit (None: every batch asked fit)

    @property
    def batches(self) -> list[int]:
        return sorted(int(b) for b in self.ms["recompute_ms"])


def measure_batches(engine: DLMEngine, sizes: Sequence[int], context_tokens: int, repeats: int,
                    curves: Curves | None = None,
                    on_batch: Callable[[int, Curves], None] | None = None) -> Curves:
    """Measure every batch of ``sizes`` that ``curves`` does not hold yet (a resumed run passes what it
    measured before), in order, calling ``on_batch`` after each; stop at the first batch that runs out of
    device memory (``Curves.bounded_by_memory``)."""
    curves = curves or Curves()
    for batch in sizes:
        if str(batch) in curves.ms["recompute_ms"]:
            continue
        try:
            ms = measure(engine, batch, context_tokens, repeats)
        except Exception as exc:
            if not out_of_memory(exc):
                raise
            if engine.model.device.type == "cuda":
                torch.cuda.empty_cache()
            curves.bounded_by_memory = batch
            break
        for kind, value in ms.items():
            curves.ms[kind][str(batch)] = value
        if on_batch is not None:
            on_batch(batch, curves)
    return curves


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def profile_document(engine: DLMEngine, model_name: str, device: str, context_tokens: int,
                     curves_by_tp: dict[int, Curves], kv_bytes_per_token: int, notes: str) -> dict:
    """The profile file's contents (``shared/profiles.py``) for curves measured with ``engine`` (any TP
    degree's: its lengths, dtype and attention backend are every degree's)."""
    return {
        "model": model_name,
        "device": device_name(device),
        "device_slug": device.split(":")[0],
        "measured": True,
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "context_tokens": context_tokens,
        "block_length": engine.default_block_length,
        "gen_length": engine.default_gen_length,
        "kv_bytes_per_token": kv_bytes_per_token,
        "attention": engine.attention.value,
        "cuda_graphs": engine.runner.graphs_enabled,
        "tp": {str(tp): curves.ms for tp, curves in sorted(curves_by_tp.items())},
        "batch_monotone": "min-over-larger",  # a noisy dip at some batch is smoothed, and said (shared/profiles.py)
        "notes": notes,
    }


def profile_model(model_dir: str, device: str, sizes: list[int], context_tokens: int, repeats: int) -> dict:
    """`dls profile`: TP 1 at ``sizes``, one line per batch on stdout."""
    engine = DLMEngine.from_pretrained(model_dir, device=device)

    def show(batch: int, curves: Curves) -> None:
        print(f"batch {batch}: " + ", ".join(f"{k} {v[str(batch)]}" for k, v in curves.ms.items()), flush=True)

    curves = measure_batches(engine, sizes, context_tokens, repeats, on_batch=show)
    notes = f"measured by `dls profile` with torch {torch.__version__}, median of {repeats} repeats"
    if curves.bounded_by_memory:
        notes += f"; batch {curves.bounded_by_memory} and larger did not fit in device memory"
    return profile_document(engine, Path(model_dir).name, device, context_tokens, {1: curves},
                            engine.kv_memory().bytes_per_token, notes)
