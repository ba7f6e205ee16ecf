"""``bench.gpu_stack``'s report: the worker's step time and tokens per forward over each load run are the
differences of its histograms between the scrapes around that run."""

from __future__ import annotations

import json

from bench import gpu_stack


def metrics(step_sum: float, steps: int, tokens_sum: float, forwards: int) -> str:
    """The node agent's /metrics with one worker's histograms (other families left out)."""
    return "\n".join([
        "# HELP dls_worker_step_seconds step time", "# TYPE dls_worker_step_seconds histogram",
        f'dls_worker_step_seconds_bucket{{instance="w",le="+Inf"}} {steps}',
        f'dls_worker_step_seconds_sum{{instance="w"}} {step_sum}', f'dls_worker_step_seconds_count{{instance="w"}} {steps}',
        "# HELP dls_tokens_per_forward tokens", "# TYPE dls_tokens_per_forward histogram",
        f'dls_tokens_per_forward_bucket{{instance="w",le="+Inf",model_name="m"}} {forwards}',
        f'dls_tokens_per_forward_sum{{instance="w",model_name="m"}} {tokens_sum}',
        f'dls_tokens_per_forward_count{{instance="w",model_name="m"}} {forwards}', ""])


def load(rate: float, failed: int = 0) -> dict:
    return {"config": {"rate": rate}, "completed": 10 - failed, "failed": failed, "slo_attainment": 0.9,
            "accuracy": 1.0, "mean_ttft_ms": 50.0, "p99_ttft_ms": 90.0, "mean_itl_ms": 20.0, "p99_itl_ms": 30.0,
            "mean_e2el_ms": 300.0, "mean_tokens_per_step": 1.5, "mean_threshold": 0.85,
            "control_plane": {"mean_forward_ms": 11.0, "mean_ms": 2.0}}


def test_each_run_gets_the_worker_figures_of_its_own_interval(tmp_path):
    (tmp_path / "metrics-0.txt").write_text(metrics(0.5, 10, 12.0, 10))  # warm-up and the SDK checks
    (tmp_path / "metrics-1.txt").write_text(metrics(1.5, 60, 72.0, 50))
    (tmp_path / "metrics-2.txt").write_text(metrics(5.5, 160, 272.0, 150))
    (tmp_path / "load-1.json").write_text(json.dumps(load(2)))
    (tmp_path / "load-2.json").write_text(json.dumps(load(4)))
    (tmp_path / "sdk.json").write_text(json.dumps({"num_failed": 0, "num_checks": 3, "threshold": 0.9,
                                                   "first_request_s": 0.2, "checks": []}))
    report = gpu_stack.build_report(tmp_path)
    first, second = report["loads"]
    assert (first["rate_rps"], first["worker_steps"], first["worker_mean_step_ms"]) == (2, 50, 20.0)  # 1.0 s / 50
    assert first["worker_tokens_per_forward"] == 1.5  # 60 tokens / 40 forwards
    assert (second["worker_steps"], second["worker_mean_step_ms"], second["worker_tokens_per_forward"]) == (100, 40.0, 2.0)
    assert report["ok"] and "| 4 | 10 / 0 | 90.0 | 100.0 | 50.0 / 90.0 |" in gpu_stack.render_markdown(report)
    (tmp_path / "load-2.json").write_text(json.dumps(load(4, failed=1)))
    assert not gpu_stack.build_report(tmp_path)["ok"]  # a failed request fails the check
