"""bench.drift's reading of the predictor's metrics: errors between two scrapes, the jump at the shift,
the recovery time, the retrains seen (no stack: scrapes made by hand)."""

from __future__ import annotations

import argparse

import pytest

from bench.drift import analyse, error_between, parse_metrics, retrains
from shared.metrics import PredictorMetrics, render


def sample(t_s: float, total: float, rows: float, live: float | None = None, swapped: float = 0.0,
           kept: float = 0.0) -> dict:
    return {"t_s": t_s, "sum": total, "count": rows, "live_error": live, "swapped": swapped, "kept": kept,
            "failed": 0.0, "old_error": 0.5, "new_error": 0.1, "window_rows": None}


def test_the_metrics_page_of_the_predictor_is_read():
    metrics = PredictorMetrics()
    for error in (0.1, 0.3):
        metrics.served_error.observe(error)
    metrics.live_error.set(0.2)
    metrics.retrains.labels(outcome="swapped").inc()
    metrics.retrain_error.labels(model="old").set(0.7)
    metrics.retrain_error.labels(model="new").set(0.3)
    figures = parse_metrics(render(metrics.registry).decode())
    assert figures["count"] == 2 and figures["sum"] == pytest.approx(0.4) and figures["live_error"] == 0.2
    assert (figures["swapped"], figures["kept"], figures["old_error"], figures["new_error"]) == (1, 0, 0.7, 0.3)


def test_errors_jump_at_the_shift_and_the_recovery_is_timed():
    # 10 rows a second; error 0.1 a row before the shift at 30 s, 1.0 until 50 s, 0.11 after (within 1.2x)
    samples, total, rows = [], 0.0, 0
    for t in range(0, 91):
        samples.append(sample(float(t), total, rows, live=0.1, swapped=float(t >= 45)))
        per_row = 0.1 if t < 30 else 1.0 if t < 50 else 0.11
        total, rows = total + 10 * per_row, rows + 10
    assert error_between(samples, 10, 30) == (pytest.approx(0.1), 200)
    args = argparse.Namespace(phase_s=30.0, shift_phase_s=60.0, before_window_s=20.0, bin_s=10.0, min_bin_rows=5)
    figures = analyse(samples, args)
    assert figures["before"] == pytest.approx(0.1) and figures["at_shift"] == pytest.approx(1.0)
    assert figures["recovery_limit"] == pytest.approx(0.12)
    assert figures["recovery_s"] == 30.0  # the bin 50-60 s is the first back within 1.2x
    assert figures["bins_within_limit_after_recovery"] == "4/4"
    assert [r["t_s"] for r in retrains(samples, 30.0)] == [45.0]
