"""``scripts/gpu-stack-check.sh``'s dry run: the same flow as on a GPU (the CPU engine's answers, ``dls up
--workers 1``, the official SDK against them, ``dls loadgen`` with the worker's metrics scraped around it,
the report) with the worker on the CPU, redis-server through the script's wrapper; and a machine without
CUDA refused before anything starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu-stack-check.sh"


def run_check(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), "--out", str(out), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_dry_run_on_cpu_checks_answers_and_reports_every_figure(tmp_path):
    redis = shutil.which("redis-server")
    done = run_check(tmp_path, "--device", "cpu", "--rates", "3", "--requests", "6", "--redis-server", redis)
    log = (tmp_path / "check.log").read_text() if (tmp_path / "check.log").exists() else ""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:] + log[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] and report["status"]["device"] == "cpu" and report["status"]["ready_s"] > 0
    sdk = report["sdk"]
    assert sdk["num_failed"] == 0 and {c["kind"] for c in sdk["checks"]} == {"completion", "chat", "stream"}
    expected = json.loads((tmp_path / "expected.json").read_text())["answers"]
    assert sdk["num_checks"] == 2 * len(expected) + 1 and all(c["got"] == c["expected"] for c in sdk["checks"])
    [load] = report["loads"]
    assert load["rate_rps"] == 3 and load["completed"] == 6 and load["failed"] == 0
    assert load["worker_steps"] > 0 and load["worker_mean_step_ms"] > 0 and load["mean_forward_ms"] > 0
    assert load["worker_tokens_per_forward"] >= 1 and load["mean_tokens_per_step"] >= 1
    assert load["mean_ttft_ms"] > 0 and 0 <= load["slo_attainment"] <= 1
    assert "Verdict: passed" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "bin" / "redis-server").exists()  # the wrapper the stack ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_on_a_machine_without_cuda_the_check_refuses_before_starting_anything(tmp_path):
    done = run_check(tmp_path, "--device", "cuda")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--device cuda: torch" in done.stdout and "sees no CUDA device" in done.stdout
    assert not (tmp_path / "stack.log").exists() and not (tmp_path / "expected.json").exists()
