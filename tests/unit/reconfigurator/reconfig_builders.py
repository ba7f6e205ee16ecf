"""Builders for the reconfigurator tests (a uniquely named module: test files import it directly,
which a shared name like ``conftest`` would make ambiguous across test directories)."""

from __future__ import annotations

from services.reconfigurator.core.spec import RequestClass, Workload

# tp degree -> step latency relative to TP-1 (TP-2 25% and TP-4 55% faster at every batch)
TP_FACTOR = {1: 1.0, 2: 0.75, 4: 0.45}
BATCHES = (1, 2, 4, 8, 16)


def profile_dict(tp_factor: dict[int, float] = TP_FACTOR) -> dict:
    """Recompute steps 10 + 12 b ms, cache steps 4 + 1 b ms at TP-1; scaled per degree."""
    return {
        "model": "test-dlm",
        "device": "test-gpu",
        "context_tokens": 512,
        "block_length": 32,
        "tp": {
            str(d): {
                "recompute_ms": {str(b): (10 + 12 * b) * f for b in BATCHES},
                "cache_ms": {str(b): (4 + 1 * b) * f for b in BATCHES},
            }
            for d, f in tp_factor.items()
        },
    }


def make_workload(total_rate: float, slo_s: float = 4.0) -> Workload:
    """Two classes (short and long answers) sharing ``total_rate`` 2:1."""
    classes = (
        RequestClass("short", 256, 128, total_rate * 2 / 3),
        RequestClass("long", 256, 256, total_rate / 3),
    )
    return Workload(classes=classes, slo_s=slo_s, safety_buffer=0.2)
