"""scripts/gpu-check.sh, dry-run on a CPU (GPU_CHECK_DRY_RUN=1): every step of the GPU check runs (the gpu
tests collected, the bench with its calibrated head and floor, the acceptance script, the profile through
`dls calibrate --only profile` on a random-weight model directory) on a tiny random model, so the script a
lent GPU runs once is known to run. Its figures are a CPU's: not checked."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_gpu_check_runs_end_to_end_as_a_dry_run(tmp_path):
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", OUT_DIR=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(["bash", "scripts/gpu-check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    log = (tmp_path / "gpu-check.log").read_text()
    assert done.returncode == 0, log[-3000:]
    assert "gpu-check: passed" in log and "dry run on a CPU" in log
    assert "tests/unit/worker/test_gpu_engine.py: " in log  # the gpu tests collected (they need CUDA to run)
    figures = json.loads((tmp_path / "bench-engine-speed-llada-tiny-dryrun.json").read_text())
    assert {"floor_ms_by_batch", "engine_over_floor", "lm_head_scale", "tokens_per_step_by_batch"} <= set(figures)
    for check in ("engine cache step <= 1.3x the floor at batch 1", "engine batch 8 >= 5x batch 1",
                  "several tokens per step"):
        assert check in log  # the acceptance ran (its verdicts are a CPU's, not checked)
    profile = json.loads((tmp_path / "llada-tiny-dryrun-measured.json").read_text())
    assert profile["measured"] and profile["batch_monotone"] == "min-over-larger"
    assert "measured by `dls calibrate`" in profile["notes"]  # the command a user calibrates with
    assert list(profile["tp"]["1"]["cache_ms"]) == ["1", "2", "4", "8"]
