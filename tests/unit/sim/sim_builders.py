"""Builders for the simulator's tests: a hand-made replay trace (no model needed)."""

from __future__ import annotations

from sim.engines import ReplayTrace

THRESHOLDS = (0.5, 0.7, 0.9)
# threshold -> tokens committed per step in a fresh block of 8
_RATE = {0.5: 4, 0.7: 2, 0.9: 1}


def make_trace() -> ReplayTrace:
    """Two blocks of 8; 'add' answers end in block 0, 'words' in block 1; deterministic commits."""
    counts = {}
    for family in ("add", "words"):
        for block in (0, 1):
            for masked in range(1, 9):
                for tau in THRESHOLDS:
                    counts[f"{family}|{block}|{masked}|{tau:.2f}"] = {min(_RATE[tau], masked): 10}
    steps = {f"{t:.2f}": 1.5 * 8 / _RATE[t] for t in THRESHOLDS}
    return ReplayTrace(
        model_key="test",
        gen_len=16,
        block_len=8,
        thresholds=THRESHOLDS,
        commit_counts=counts,
        blocks_run={"add": [1], "words": [2]},
        accuracy={f: {f"{t:.2f}": a for t, a in zip(THRESHOLDS, (0.5, 0.8, 1.0), strict=True)} for f in ("add", "words")},
        mean_steps=steps,
        mean_recompute_steps={f"{t:.2f}": 1.5 for t in THRESHOLDS},
        mean_context_tokens=80.0,
        num_requests=10,
    )
