"""A built-in, modelled LLaDA-8B-like H100 step-latency profile for examples, tests and the benchmark
when ``profiles/llada-8b-h100.json`` is not there.

Shape (not measurements): at batch 1, TP-2 steps are 25% and TP-4 steps 55% faster than TP-1 (the
paper's Figure 4a); TP-8 68%. Throughput per GPU falls as TP grows, since the speed-up is below the
GPU count. Recompute steps (full forward over 512 tokens) are compute-bound and grow ~linearly with
batch; cache steps (one 32-token block) start memory-bound and grow slowly.
"""

from __future__ import annotations

from shared.profiles import LatencyProfile

EXAMPLE_PROFILE_PATH = "profiles/llada-8b-h100.json"

# tp degree -> step latency relative to TP-1 (same factor at every batch)
_TP_LATENCY_FACTOR = {1: 1.0, 2: 0.75, 4: 0.45, 8: 0.32}
_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def _recompute_ms_tp1(batch: int) -> float:
    return 8.0 + 16.0 * batch


def _cache_ms_tp1(batch: int) -> float:
    return 5.5 + 1.0 * batch


def example_profile_dict() -> dict:
    tp = {}
    for degree, factor in _TP_LATENCY_FACTOR.items():
        tp[str(degree)] = {
            "recompute_ms": {str(b): round(_recompute_ms_tp1(b) * factor, 3) for b in _BATCH_SIZES},
            "cache_ms": {str(b): round(_cache_ms_tp1(b) * factor, 3) for b in _BATCH_SIZES},
        }
    return {
        "model": "llada-8b-example",
        "device": "H100 (modelled)",
        "measured": False,
        "context_tokens": 512,
        "block_length": 32,
        "tp": tp,
        "notes": "built-in example profile of services.reconfigurator (modelled, not measured)",
    }


def example_profile() -> LatencyProfile:
    return LatencyProfile.from_dict(example_profile_dict(), source="built-in example profile")
