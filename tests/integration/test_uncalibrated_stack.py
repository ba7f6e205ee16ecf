"""A checkpoint served without a calibration, as a new user serves theirs: ``dls up`` and ``/v1/models``
say it is uncalibrated and how to calibrate it, the workers plan with the step times they measure,
and under overload no request runs below the highest candidate threshold; a calibration made for
other weights is refused before anything starts, naming what differs."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from shared.runtime import free_port
from tests.integration.conftest import dls_up, post_json

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "models" / "dls-tiny"


def uncalibrated_copy(tmp_path: Path, name: str = "uncal") -> Path:
    """The bundled model's weights, config and tokenizer, with no calibration bundle."""
    copy = tmp_path / name
    shutil.copytree(BUNDLED, copy, ignore=shutil.ignore_patterns("calibration", "replay", "MODEL_CARD.md"))
    return copy


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.loads(reply.read())


def _env() -> dict[str, str]:
    return dict(os.environ, DLS_NATS_URL=f"nats://127.0.0.1:{free_port()}",
                DLS_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")


def test_an_uncalibrated_model_is_said_so_and_never_served_below_the_highest_threshold(tmp_path):
    model = uncalibrated_copy(tmp_path)
    with dls_up(tmp_path / "stack", "--model", str(model)) as stack:
        url, said = stack.url, stack.said
        assert "calibration: NONE" in said and "dls calibrate --model" in said and "UNCALIBRATED" in said, said
        [card] = _get(f"{url}/v1/models")["data"]
        assert card["id"] == "uncal" and card["calibration"]["calibrated"] is False
        assert "dls calibrate --model" in card["calibration"]["how_to"]
        cluster = _get(f"{url}/v1/cluster")  # the dashboard's data: it shows a banner from it
        assert cluster["calibration"]["uncal"]["calibrated"] is False
        assert {i["profile"] for i in cluster["instances"]} == {"measured by its worker"}

        replies = overload(url, "uncal")
        served = [answer for status, answer in replies if status == 200]
        assert served, replies[:3]
        missed = [answer for answer in served if not answer["usage"]["slo_met"]]
        assert missed or len(served) < len(replies), "not overloaded: the check proves nothing"
        thresholds = {t for answer in served for t in answer["usage"]["thresholds"]}
        assert thresholds == {0.9}, thresholds  # quality first: no lowering without a measured curve
        assert all(status in (200, 429, 503) for status, _ in replies), [s for s, _ in replies]
    logs = tmp_path / "stack" / "logs"
    assert "is uncalibrated" in (logs / "scheduler.log").read_text()
    assert "most steps a request can take" in (logs / "predictor.log").read_text()
    workers = [p.read_text() for p in logs.glob("*.log") if "measured the step times" in p.read_text()]
    assert len(workers) == 2  # each worker measured its own step times for the scheduler


def overload(url: str, model: str) -> list[tuple[int, dict]]:
    """Far more requests than two CPU workers serve within a 300 ms SLO, all at once: word lists (about 11
    steps each at 0.9) on a 64-token canvas."""
    from shared.tasks import Family, Split, TaskGenerator

    problems = TaskGenerator(3, family_weights={Family.WORDS: 1.0}).problems(96, 2, split=Split.HELD_OUT)
    bodies = [{"model": model, "prompt": p.prompt, "max_tokens": 64, "slo_ms": 300} for p in problems]
    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        return list(pool.map(lambda body: post_json(f"{url}/v1/completions", body), bodies))


def test_a_calibration_made_for_other_weights_is_refused_before_anything_starts(tmp_path):
    model = uncalibrated_copy(tmp_path, "other")
    shutil.copytree(BUNDLED / "calibration", model / "calibration")
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-16:] = bytes(16)  # other weights (the sampled end of the file)
    weights.write_bytes(bytes(data))
    argv = [sys.executable, "-m", "services.cli", "up", "--port", str(free_port()), "--model", str(model),
            "--run-dir", str(tmp_path / "stack")]
    done = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode != 0, said
    assert "weights" in said and "made for another model or device" in said and "dls calibrate" in said, said
    assert not (tmp_path / "stack" / "logs").exists()  # nothing was started
