"""``loadgen.workload``: arrival processes, BurstGPT replay with filters and scaling, SLO classes,
ShareGPT prompts; and the report's metric names (no server)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from loadgen.driver import Result
from loadgen.report import build_report
from loadgen.workload import LoadSpec, WorkloadError, build_plan, parse_slo_class, write_burstgpt
from sim.workload import WorkloadConfig, generate

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "burstgpt_sample.csv"


def test_burstgpt_sample_replay_scaled_and_filtered():
    plan = build_plan(LoadSpec(arrival="burstgpt", trace_path=str(SAMPLE), time_scale=4.0))
    assert [p.arrival_s for p in plan] == [0.0, 1.0, 2.25, 3.5, 4.0, 6.25, 7.0, 7.75]  # failed rows dropped
    gpt4 = build_plan(LoadSpec(arrival="burstgpt", trace_path=str(SAMPLE), trace_models=("GPT-4",)))
    assert [p.arrival_s for p in gpt4] == [0.0, 10.0, 21.0]
    everything = build_plan(LoadSpec(arrival="burstgpt", trace_path=str(SAMPLE), keep_failures=True))
    assert len(everything) == 10
    with pytest.raises(WorkloadError, match="no successful requests of model"):
        build_plan(LoadSpec(arrival="burstgpt", trace_path=str(SAMPLE), trace_models=("Claude",)))


def test_burstgpt_session_layout(tmp_path):
    path = tmp_path / "b3.csv"
    path.write_text("Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "10,s1,0,ChatGPT,5,7,12,API log\n12,s1,2,ChatGPT,5,7,12,API log\n")
    assert [p.arrival_s for p in build_plan(LoadSpec(arrival="burstgpt", trace_path=str(path), time_scale=2))] == [0, 1]


def test_same_requests_as_the_simulator():
    spec = LoadSpec(rate_rps=3.0, num_requests=20, slo_ms=6500.0, seed=4)
    sim = generate(WorkloadConfig(num_requests=20, seed=4), 3.0, 6.5).requests
    plan = build_plan(spec)
    assert [p.arrival_s for p in plan] == [r.arrival_s for r in sim]
    assert [p.prompt for p in plan] == [r.problem.prompt for r in sim]
    assert all(p.slo_ms == pytest.approx(6500.0) and p.max_tokens == 16 for p in plan)


def test_arrival_processes():
    constant = build_plan(LoadSpec(arrival="constant", rate_rps=4.0, num_requests=5))
    assert [p.arrival_s for p in constant] == [0.0, 0.25, 0.5, 0.75, 1.0]
    ramp = np.array([p.arrival_s for p in build_plan(LoadSpec(arrival="ramp", ramp_start_rps=1, ramp_end_rps=20,
                                                                num_requests=400))])
    assert np.all(np.diff(ramp) >= 0)
    half = ramp[-1] / 2  # the rate rises: far more arrivals in the second half
    assert (ramp >= half).sum() > 2 * (ramp < half).sum()
    bursty = np.diff([p.arrival_s for p in build_plan(LoadSpec(arrival="gamma", burstiness=0.25, rate_rps=5,
                                                                 num_requests=2000))])
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(2.0, rel=0.15)  # cv = 1/sqrt(burstiness)


def test_slo_classes_and_errors():
    classes = (parse_slo_class("fast:1:2:1"), parse_slo_class("slow:4:0:3:0.8"))
    plan = build_plan(LoadSpec(num_requests=400, slo_ms=1000.0, slo_classes=classes))
    fast = [p for p in plan if p.slo_class == "fast"]
    slow = [p for p in plan if p.slo_class == "slow"]
    assert {p.slo_ms for p in fast} == {1000.0} and {p.slo_ms for p in slow} == {4000.0}
    assert {p.priority for p in fast} == {2} and {p.min_threshold for p in slow} == {0.8}
    assert 0.15 < len(fast) / len(plan) < 0.35
    assert plan[0].body("dls-tiny", None, True)["stream"] is True
    with pytest.raises(WorkloadError, match="--slo-ms"):
        build_plan(LoadSpec(slo_classes=classes))
    with pytest.raises(WorkloadError, match="--slo-class"):
        parse_slo_class("nofactor")
    with pytest.raises(WorkloadError, match="--arrival"):
        build_plan(LoadSpec(arrival="zipf"))


def test_sharegpt_prompts(tmp_path):
    path = tmp_path / "sharegpt.json"
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"question number {i} " * 3},
                                              {"from": "gpt", "value": "an answer " * (i + 2)}]} for i in range(5)]
    convs.append({"id": "short", "conversations": [{"from": "human", "value": "hi"}]})  # one turn: skipped
    path.write_text(json.dumps(convs))
    plan = build_plan(LoadSpec(lengths="sharegpt", sharegpt_path=str(path), num_requests=5, gen_len=16))
    assert all(p.problem is None and p.text.startswith("question number") for p in plan)
    assert all(p.max_tokens in (8, 16) and p.max_tokens % p.block_length == 0 for p in plan)


def test_write_burstgpt_round_trip(tmp_path):
    plan = build_plan(LoadSpec(rate_rps=2.0, num_requests=6))
    write_burstgpt(plan, tmp_path / "arrivals.csv")
    again = build_plan(LoadSpec(arrival="burstgpt", trace_path=str(tmp_path / "arrivals.csv")))
    first = plan[0].arrival_s
    assert [p.arrival_s for p in again] == pytest.approx([p.arrival_s - first for p in plan], abs=1e-6)


def test_report_names_and_values():
    plan = build_plan(LoadSpec(num_requests=3, slo_ms=1000.0))
    good = Result(plan[0], status=200, latency_s=0.5, text=plan[0].problem.answer, ttft_s=0.2,
                  chunk_times_s=[0.2, 0.5], usage={"steps": 4, "thresholds": [0.9, 0.9, 0.7, 0.7],
                                                   "completion_tokens": 4, "prompt_tokens": 10})
    late = Result(plan[1], status=200, latency_s=2.0, text="wrong", ttft_s=1.0, chunk_times_s=[1.0],
                  usage={"steps": 2, "thresholds": [0.9, 0.9], "completion_tokens": 2, "prompt_tokens": 10})
    failed = Result(plan[2], status=429, latency_s=0.01, error="busy")
    report = build_report([good, late, failed], 2.0)
    assert report["completed"] == 2 and report["failed"] == 1 and report["failed_statuses"] == {"429": 1}
    assert report["slo_attainment"] == pytest.approx(1 / 3) and report["request_goodput"] == 0.5
    assert report["accuracy"] == 0.5 and report["mean_steps"] == 3.0
    assert report["mean_ttft_ms"] == pytest.approx(600.0) and report["median_e2el_ms"] == pytest.approx(1250.0)
    assert report["thresholds_used"] == {"0.7": 2, "0.9": 4} and report["mean_itl_ms"] == pytest.approx(300.0)
    assert math.isclose(report["request_throughput"], 1.0) and len(report["requests"]) == 3
