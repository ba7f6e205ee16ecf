"""`dls profile`: step latency per step kind and batch size on this device, in the profile format.

Each measurement builds ``batch`` fresh requests whose prompt plus generation is ``context_tokens``
long, runs their first step (a recompute step: full forward that fills the dual cache) and then a
cache step (threshold 1.0, so the block stays open), and takes the median over ``repeats``.
A step without cache (``full_ms``) is a full forward too, measured with cache mode ``none``.
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from pathlib import Path

import torch

from services.worker.engine import CacheMode, DLMEngine, StepKind


def _requests(engine: DLMEngine, batch: int, context_tokens: int, mode: CacheMode, rng: random.Random):
    gen_length = engine.default_gen_length
    prompt_length = max(1, context_tokens - gen_length)
    vocab = range(3, engine.model.config.vocab_size)
    return [
        engine.new_request(f"p{i}", [rng.choice(vocab) for _ in range(prompt_length)], gen_length, None, mode)
        for i in range(batch)
    ]


def _timed_step(engine: DLMEngine, states, expected: StepKind) -> float:
    started = time.perf_counter()
    results = engine.step([(s, 1.0) for s in states])
    elapsed = time.perf_counter() - started
    assert all(r.kind is expected for r in results), "profiling measured the wrong step kind"
    return elapsed


def measure(engine: DLMEngine, batch: int, context_tokens: int, repeats: int, seed: int = 0) -> dict[str, float]:
    """Median milliseconds of a recompute, a cache and a no-cache step at this batch size."""
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {"recompute_ms": [], "cache_ms": [], "full_ms": []}  # kind -> ms
    for _ in range(repeats + 1):  # the first round warms up and is discarded
        dual = _requests(engine, batch, context_tokens, CacheMode.DUAL, rng)
        recompute = _timed_step(engine, dual, StepKind.RECOMPUTE)
        cache = _timed_step(engine, dual, StepKind.CACHE)
        full = _timed_step(engine, _requests(engine, batch, context_tokens, CacheMode.NONE, rng), StepKind.RECOMPUTE)
        for s in dual:
            engine.drop(s.request_id)
        for key, value in (("recompute_ms", recompute), ("cache_ms", cache), ("full_ms", full)):
            samples[key].append(value * 1000)
    return {key: round(statistics.median(values[1:]), 3) for key, values in samples.items()}


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def profile_model(model_dir: str, device: str, batch_sizes: list[int], context_tokens: int, repeats: int) -> dict:
    engine = DLMEngine.from_pretrained(model_dir, device=device)
    by_kind: dict[str, dict[str, float]] = {"recompute_ms": {}, "cache_ms": {}, "full_ms": {}}
    for batch in batch_sizes:
        for kind, ms in measure(engine, batch, context_tokens, repeats).items():
            by_kind[kind][str(batch)] = ms
        print(f"batch {batch}: " + ", ".join(f"{k} {v[str(batch)]}" for k, v in by_kind.items()), flush=True)
    return {
        "model": Path(model_dir).name,
        "device": device_name(device),
        "device_slug": device.split(":")[0],
        "measured": True,
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "context_tokens": context_tokens,
        "block_length": engine.default_block_length,
        "gen_length": engine.default_gen_length,
        "kv_bytes_per_token": engine.kv_cache.bytes_per_token,
        "tp": {"1": by_kind},
        "batch_monotone": "min-over-larger",  # a noisy dip at some batch is smoothed, and said (shared/profiles.py)
        "notes": f"measured by `dls profile` with torch {torch.__version__}, median of {repeats} repeats",
    }
