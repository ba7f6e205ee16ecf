"""``dls loadgen`` against the real gateway, scheduler and workers: it replays the BurstGPT sample
shipped with the tests at its scaled arrival times, and its report has the metrics the issue names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli import main
from shared.request_traces import read_trace
from tests.integration.served import served_stack

pytestmark = pytest.mark.integration

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "burstgpt_sample.csv"
NAMED_METRICS = ("completed", "failed", "slo_attainment", "accuracy", "request_throughput", "mean_ttft_ms",
                 "median_e2el_ms", "p99_e2el_ms", "mean_steps", "request_goodput", "median_ttft_ms",
                 "p99_ttft_ms", "mean_e2el_ms", "thresholds_used", "mean_threshold")


def test_loadgen_replays_the_burstgpt_sample_and_reports(nats_server, redis_server, unique_prefix, tmp_path):
    expected = [r.arrival_s / 10.0 for r in read_trace(SAMPLE).rows]  # failures dropped, timestamps / 10
    with served_stack(nats_server.url, redis_server.url, unique_prefix, num_workers=2) as url:
        trace_json = tmp_path / "trace.json"
        assert main(["loadgen", "--url", url, "--trace", str(SAMPLE), "--time-scale", "10", "--cache", "dual",
                     "--slo-ms", "30000", "--json", str(trace_json), "--plot", str(tmp_path / "trace.png"),
                     "--no-progress"]) == 0
        poisson_json = tmp_path / "poisson.json"
        assert main(["loadgen", "--url", url, "--rate", "4", "--num-requests", "4", "--max-concurrency", "2", "--no-stream",
                     "--json", str(poisson_json), "--no-progress"]) == 0
        sweep_json = tmp_path / "sweep.json"
        assert main(["loadgen", "--url", url, "--endpoint", "chat", "--rates", "2,4", "--num-requests", "3",
                     "--goodput", "ttft:600000", "tpot:600000", "e2el:600000", "--json", str(sweep_json),
                     "--no-progress"]) == 0

    report = json.loads(trace_json.read_text())
    rows = report["requests"]
    assert [r["arrival_s"] for r in rows] == pytest.approx(expected)
    assert all(r["sent_s"] >= r["arrival_s"] - 1e-3 for r in rows)  # open loop: nothing goes out early
    for name in NAMED_METRICS:
        assert name in report, name
    assert report["completed"] == len(expected) and report["failed"] == 0
    assert 0.0 <= report["slo_attainment"] <= 1.0 and 0.0 <= report["accuracy"] <= 1.0
    assert report["mean_ttft_ms"] <= report["mean_e2el_ms"]  # the first block comes before the end
    assert report["mean_steps"] >= 2 and sum(report["thresholds_used"].values()) >= report["completed"]
    assert (tmp_path / "trace.png").stat().st_size > 0

    poisson = json.loads(poisson_json.read_text())
    assert poisson["completed"] + poisson["failed"] == 4 and poisson["config"]["rate"] == 4
    assert all(poisson[name] is not None for name in ("slo_attainment", "request_throughput", "median_e2el_ms"))

    sweep = json.loads(sweep_json.read_text())
    assert sweep["endpoint"] == "chat" and sweep["rates"] == [2.0, 4.0] and len(sweep["sweep"]) == 2
    assert sweep["goodput_constraints_ms"] == {"ttft": 600000.0, "tpot": 600000.0, "e2el": 600000.0}
    for run, rate in zip(sweep["sweep"], (2.0, 4.0), strict=True):
        assert run["rate_rps"] == rate and run["endpoint"] == "chat" and run["completed"] == 3, run["errors"]
        assert run["goodput"] == run["request_goodput"] == pytest.approx(3 / run["duration"])  # all within
        assert run["accuracy"] is not None and run["mean_ttft_ms"] is not None  # chat answers checked, streamed
    assert sweep["goodput"] == [run["goodput"] for run in sweep["sweep"]]
    assert poisson["endpoint"] == "completions" and poisson["goodput_constraints_ms"] is None
