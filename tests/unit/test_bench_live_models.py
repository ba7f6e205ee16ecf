"""The pure parts of ``bench/live_models.py``: the flipping phases and their per-model arrivals, the
percentile and summary helpers, how long the slots took to follow, and the log lines it reads."""

from __future__ import annotations

import math
from datetime import datetime

import pytest

from bench.live_models import (
    Phase,
    boot_times,
    distribution,
    divisions,
    flip_phases,
    follow_delays,
    model_plans,
    model_summary,
    percentile,
    switches,
)
from loadgen.driver import PlannedRequest, Result

A, B = "dls-tiny", "dls-tiny-twin"


def test_flip_phases_go_80_20_then_20_80_then_back():
    phases = flip_phases([A, B], 100.0)
    assert [(p.start_s, p.end_s) for p in phases] == [(0.0, 100.0), (100.0, 200.0), (200.0, 300.0)]
    assert [p.shares[A] for p in phases] == pytest.approx([0.8, 0.2, 0.8])
    assert [p.heavy for p in phases] == [A, B, A]
    assert all(sum(p.shares.values()) == pytest.approx(1.0) for p in phases)


def test_model_plans_follow_each_phase_mix_and_repeat_with_the_seed():
    phases = flip_phases([A, B], 200.0)
    plans = model_plans(phases, 5.0, seed=3)
    assert plans == model_plans(phases, 5.0, seed=3)  # the static and the division run get the same arrivals
    assert plans != model_plans(phases, 5.0, seed=4)
    for model, plan in plans.items():
        times = [r.arrival_s for r in plan]
        assert times == sorted(times) and 0.0 <= times[0] and times[-1] < 600.0
        assert all(r.slo_ms is None for r in plan)  # the gateway's per-model default
        for phase in phases:
            count = sum(phase.start_s <= t < phase.end_s for t in times)
            expected = 5.0 * phase.shares[model] * phase.duration_s  # 800 or 200
            assert abs(count - expected) < 4 * math.sqrt(expected), (model, phase, count)
    assert model_plans(phases, 5.0, seed=3, slo_ms={A: 900.0})[A][0].slo_ms == 900.0


def test_percentile_and_distribution():
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, None], 50) == 2.0
    assert percentile(range(101), 99) == pytest.approx(99.0)
    assert distribution([]) == {"n": 0, "p50": None, "p99": None, "mean": None, "max": None}
    d = distribution([10.0, 12.0, 30.0])
    assert d["n"] == 3 and d["p50"] == 12.0 and d["max"] == 30.0 and 12.0 < d["p99"] < 30.0


def _result(arrival_s: float, status: int, latency_s: float, slo_ms: float = 1000.0) -> Result:
    return Result(PlannedRequest(arrival_s, None, slo_ms, 16, text="1+1="), status=status, latency_s=latency_s)


def test_model_summary_counts_lost_5xx_and_attainment_per_phase():
    phases = [Phase(0.0, 10.0, {A: 0.8, B: 0.2}), Phase(10.0, 10.0, {A: 0.2, B: 0.8})]
    results = [_result(1.0, 200, 0.5), _result(2.0, 200, 2.0), _result(11.0, 503, 0.1), _result(12.0, 0, math.nan),
               _result(13.0, 200, 0.9)]
    summary = model_summary(results, phases)
    assert (summary["sent"], summary["answered"], summary["lost"], summary["num_5xx"]) == (5, 3, 1, 1)
    assert summary["slo_met"] == 2 and summary["attainment"] == 0.4
    assert [p["sent"] for p in summary["per_phase"]] == [2, 3]
    assert [p["attainment"] for p in summary["per_phase"]] == [0.5, pytest.approx(0.3333, abs=1e-4)]


def test_follow_delays_in_periods():
    phases = flip_phases([A, B], 100.0)
    timeline = [{"t_s": 2.0, "ready": {A: 2, B: 2}}, {"t_s": 35.0, "ready": {A: 3, B: 1}},
                {"t_s": 110.0, "ready": {A: 3, B: 1}}, {"t_s": 150.0, "ready": {A: 2, B: 2}},
                {"t_s": 158.0, "ready": {A: 1, B: 3}}, {"t_s": 290.0, "ready": {A: 1, B: 3}}]
    follow = follow_delays(timeline, phases, period_s=30.0)
    assert [f["followed_after_s"] for f in follow] == [35.0, 58.0, None]
    assert follow[1]["periods"] == pytest.approx(58.0 / 30.0, abs=0.01) and follow[2]["periods"] is None


def test_log_lines_are_read_from_the_services_formats(tmp_path):
    agent = tmp_path / "node_agent.log"
    agent.write_text(
        "2026-01-01 10:00:00,000 dls.node_agent INFO started local-0 (dls-tiny, TP-1 on GPUs [0]) as pid 7 (log x)\n"
        "2026-01-01 10:00:12,500 dls.node_agent INFO local-0 (dls-tiny, TP-1 on GPUs [0]) is READY\n"
        "2026-01-01 10:01:00,000 dls.node_agent INFO switched local-1 (dls-tiny-twin, TP-1 on GPUs [1]) to local-4 "
        "(TP-1 on GPUs [1] of model 'dls-tiny'), made before break: READY 9.5 s after the plan, the old stopped "
        "1.2 s later (10.7 s in all)\n")
    assert boot_times(agent) == {"dls-tiny": [12.5]}
    since = datetime(2026, 1, 1, 10, 0, 0).timestamp()
    [switch] = switches(agent, since)
    assert switch == {"t_s": 60.0, "to_model": "dls-tiny", "gpus": "1", "ready_s": 9.5, "old_stopped_s": 10.7}
    reconf = tmp_path / "reconfigurator.log"
    reconf.write_text(
        "2026-01-01 10:00:30,000 dls.reconfigurator INFO plan plan-ab-1 divides the GPUs: dls-tiny 3 GPUs {1: 3}, "
        "dls-tiny-twin 1 GPUs {1: 1} (running: dls-tiny 2 GPUs {1: 2}, dls-tiny-twin 2 GPUs {1: 2})\n"
        "2026-01-01 10:00:45,000 dls.reconfigurator INFO plan plan-ab-1 answered by every node it changes: ok\n")
    [division] = divisions(reconf, since)
    assert division["gpus"] == {"dls-tiny": 3, "dls-tiny-twin": 1}
    assert (division["t_s"], division["done_s"]) == (30.0, 45.0)
