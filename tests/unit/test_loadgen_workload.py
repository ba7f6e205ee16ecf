"""``loadgen.workload`` and ``dls loadgen --dry-run``: arrival processes, trace replay (BurstGPT,
Azure, Mooncake) with filters, scaling and target rates, SLO classes, ShareGPT prompts; and the
report's metric names (no server)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from loadgen.driver import Result
from loadgen.report import GoodputError, build_report, parse_goodput
from loadgen.workload import LoadSpec, WorkloadError, build_plan, parse_slo_class, plan_load, write_burstgpt
from services.cli import main
from sim.workload import WorkloadConfig, generate

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "burstgpt_sample.csv"
AZURE = Path(__file__).resolve().parents[1] / "data" / "AzureLLMInferenceTrace_conv_first10min.csv"


def test_burstgpt_sample_replay_scaled_and_filtered():
    plan = build_plan(LoadSpec(arrival="trace", trace_path=str(SAMPLE), time_scale=4.0))
    assert [p.arrival_s for p in plan] == [0.0, 1.0, 2.25, 3.5, 4.0, 6.25, 7.0, 7.75]  # failed rows dropped
    gpt4 = build_plan(LoadSpec(arrival="trace", trace_path=str(SAMPLE), trace_models=("GPT-4",)))
    assert [p.arrival_s for p in gpt4] == [0.0, 10.0, 21.0]
    everything = build_plan(LoadSpec(arrival="trace", trace_path=str(SAMPLE), keep_failures=True))
    assert len(everything) == 10
    with pytest.raises(WorkloadError, match="no successful requests of model"):
        build_plan(LoadSpec(arrival="trace", trace_path=str(SAMPLE), trace_models=("Claude",)))


def test_burstgpt_session_layout(tmp_path):
    path = tmp_path / "b3.csv"
    path.write_text("Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "10,s1,0,ChatGPT,5,7,12,API log\n12,s1,2,ChatGPT,5,7,12,API log\n")
    assert [p.arrival_s for p in build_plan(LoadSpec(arrival="trace", trace_path=str(path), time_scale=2))] == [0, 1]


def test_target_rate_scales_the_trace_and_records_it():
    load = plan_load(LoadSpec(arrival="trace", trace_path=str(SAMPLE), target_rate_rps=2.0))
    times = [p.arrival_s for p in load.requests]
    assert (len(times) - 1) / times[-1] == pytest.approx(2.0)  # 7 gaps in 31 trace seconds, now in 3.5 s
    assert load.trace_native_rps == pytest.approx(7 / 31) and load.scale == pytest.approx(2.0 * 31 / 7)
    assert times == pytest.approx([t / load.scale for t in (0, 4, 9, 14, 16, 25, 28, 31)])
    native = plan_load(LoadSpec(arrival="trace", trace_path=str(SAMPLE)))
    assert native.scale == 1.0 and native.rate_rps == pytest.approx(7 / 31)
    assert plan_load(LoadSpec(rate_rps=2.0, num_requests=5)).scale is None
    with pytest.raises(WorkloadError, match="--target-rate and --time-scale: give one"):
        plan_load(LoadSpec(arrival="trace", trace_path=str(SAMPLE), target_rate_rps=2.0, time_scale=3.0))
    with pytest.raises(WorkloadError, match="--target-rate: scales a --trace"):
        plan_load(LoadSpec(target_rate_rps=2.0))


def _dry_run(capsys, *argv: str, stderr: list | None = None) -> list[dict]:
    assert main(["loadgen", "--dry-run", *argv]) == 0
    captured = capsys.readouterr()
    if stderr is not None:
        stderr.append(captured.err)
    return json.loads(captured.out)


def test_cli_replays_each_trace_layout(tmp_path, capsys):
    burstgpt = _dry_run(capsys, "--trace", str(SAMPLE), "--time-scale", "2")
    assert [p["arrival_s"] for p in burstgpt] == [0, 2, 4.5, 7, 8, 12.5, 14, 15.5]
    azure = _dry_run(capsys, "--trace", str(AZURE), "--num-requests", "300", "--target-rate", "3")
    times = [p["arrival_s"] for p in azure]
    assert len(times) == 300 and 299 / times[-1] == pytest.approx(3.0)
    mooncake = tmp_path / "conv.jsonl"
    mooncake.write_text("".join(json.dumps({"timestamp": ms, "input_length": 500, "output_length": 40,
                                            "hash_ids": [0]}) + "\n" for ms in (0, 250, 1000)))
    assert [p["arrival_s"] for p in _dry_run(capsys, "--trace", str(mooncake))] == [0.0, 0.25, 1.0]


def test_cli_trace_line_names_rate_and_scale(capsys):
    err = []
    _dry_run(capsys, "--trace", str(SAMPLE), "--target-rate", "1", stderr=err)
    assert "8 requests, native 0.2258 req/s x scale 4.429 = 1 req/s replayed" in err[0]


@pytest.mark.parametrize("name,text,message", [
    ("bad_azure.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n"
                      "2023-11-16 18:15:47.1,374,many\n", r"bad_azure\.csv:3: GeneratedTokens: not a whole number"),
    ("bad_burstgpt.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                         "5,ChatGPT,472,18,490,Conversation log\n9,GPT-4,1087\n", r"bad_burstgpt\.csv:3: expected 6 fields"),
    ("bad_mooncake.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 7}\n{"timestamp": 9, "input_le\n',
     r"bad_mooncake\.jsonl:2: not a JSON object"),
])
def test_cli_malformed_trace_rows_name_the_line(tmp_path, capsys, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SystemExit):
        main(["loadgen", "--dry-run", "--trace", str(path)])
    assert re.search("error: --trace: .*" + message, capsys.readouterr().err)


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
    again = build_plan(LoadSpec(arrival="trace", trace_path=str(tmp_path / "arrivals.csv")))
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


def test_goodput_counts_the_requests_within_every_constraint_as_vllm_does():
    plan = build_plan(LoadSpec(num_requests=3, slo_ms=1000.0))
    fast = Result(plan[0], status=200, latency_s=0.5, ttft_s=0.1, usage={"completion_tokens": 5})  # TPOT 100 ms
    slow_tokens = Result(plan[1], status=200, latency_s=0.9, ttft_s=0.1, usage={"completion_tokens": 3})  # TPOT 400
    failed = Result(plan[2], status=500, latency_s=0.1, error="x")
    results = [fast, slow_tokens, failed]
    assert build_report(results, 1.0)["goodput"] == 2.0  # no constraints: the requests' own SLO (1 s)
    report = build_report(results, 1.0, goodput=parse_goodput(["ttft:200", "tpot:150"]), endpoint="chat")
    assert report["goodput"] == report["request_goodput"] == 1.0 and report["slo_goodput"] == 2.0
    assert report["goodput_constraints_ms"] == {"ttft": 200.0, "tpot": 150.0} and report["endpoint"] == "chat"
    assert build_report(results, 1.0, goodput={"e2el": 600.0})["goodput"] == 1.0
    assert build_report([Result(plan[0], status=200, latency_s=0.5, usage={"completion_tokens": 5})], 1.0,
                        goodput={"ttft": 1e6})["goodput"] == 0.0  # not streamed: no TTFT, not good
    for bad in (["ttfb:100"], ["ttft"], ["ttft:fast"], ["e2el:0"]):
        with pytest.raises(GoodputError, match="--goodput"):
            parse_goodput(bad)


def test_chat_bodies_and_streams_ask_for_the_usage_chunk():
    planned = build_plan(LoadSpec(num_requests=1, slo_ms=1000.0))[0]
    chat = planned.body("dls-tiny", "dual", stream=True, endpoint="chat")
    assert chat["messages"] == [{"role": "user", "content": planned.prompt}] and "prompt" not in chat
    assert chat["max_completion_tokens"] == planned.max_tokens and chat["stream_options"] == {"include_usage": True}
    plain = planned.body("dls-tiny", None, stream=False)
    assert plain["prompt"] == planned.prompt and "stream_options" not in plain and "cache" not in plain


@pytest.mark.parametrize("argv, message", [
    (["--rates", "1,x"], "--rates '1,x': expected"), (["--rates", "1,0"], "every rate must be positive"),
    (["--no-stream", "--goodput", "ttft:100"], "drop --no-stream"), (["--goodput", "itl:5"], "KEY:MILLISECONDS"),
])
def test_cli_refuses_bad_rates_and_constraints_it_cannot_measure(capsys, argv, message):
    with pytest.raises(SystemExit):
        main(["loadgen", "--dry-run", *argv])
    assert message in capsys.readouterr().err


def test_cli_sweep_plans_one_run_per_rate(capsys):
    assert main(["loadgen", "--dry-run", "--rates", "1,4", "--duration", "5", "--goodput", "e2el:900"]) == 0
    plans = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(plans) == 2 and len(plans[1]) > len(plans[0])  # four times the rate: more arrivals in 5 s
