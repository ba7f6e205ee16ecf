"""``dls up --model A --model B``: several models for every service (DLS_MODEL_DIRS), the workers divided
between them (in turn, or ``--workers-per-model``), each model's calibration said, two models of one
name refused; one ``--model`` gives the environment it always did."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.stack import (
    Placement,
    _division_line,
    _serving_lines,
    describe_calibrations,
    model_dirs,
    service_env,
    worker_models,
    worker_placement,
)
from shared.cli import CliError
from tests.unit.test_stack_device import up_args

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "models" / "dls-tiny"
SERVICES_MODEL_DIRS = ("DLS_GATEWAY_MODEL_DIRS", "DLS_SCHEDULER_MODEL_DIRS", "DLS_PREDICTOR_MODEL_DIRS",
                       "DLS_RECONFIGURATOR_MODEL_DIRS", "DLS_NODE_AGENT_MODEL_DIRS")


@pytest.fixture(autouse=True)
def _cpu_and_no_model_list(monkeypatch):
    for name in ("CUDA_VISIBLE_DEVICES", "DLS_WORKER_DEVICE", "DLS_MODEL_DIRS", "DLS_NODE_AGENT_INITIAL_MODELS",
                 *SERVICES_MODEL_DIRS):
        monkeypatch.delenv(name, raising=False)


def env_for(**overrides) -> dict[str, str]:
    return service_env(up_args(**overrides), "nats://n:1", "redis://r:2/0")


def test_one_model_gives_the_environment_it_always_did(monkeypatch):
    monkeypatch.setenv("DLS_GATEWAY_MODEL_DIRS", "/elsewhere/a,/elsewhere/b")  # --model says what is served
    for model in ("models/dls-tiny", ["models/dls-tiny"]):  # a str (older callers) or what argparse appends
        env = env_for(model=model, workers=3)
        assert "DLS_MODEL_DIRS" not in env and "DLS_GATEWAY_MODEL_DIRS" not in env
        assert "DLS_NODE_AGENT_INITIAL_MODELS" not in env
        assert {env[k] for k in ("DLS_MODEL_DIR", "DLS_GATEWAY_MODEL_DIR", "DLS_SCHEDULER_MODEL_DIR",
                                 "DLS_PREDICTOR_MODEL_DIR", "DLS_RECONFIGURATOR_MODEL_DIR", "DLS_NODE_AGENT_MODEL_DIR",
                                 "DLS_WORKER_MODEL_DIR")} == {"models/dls-tiny"}
        assert env["DLS_NODE_AGENT_INITIAL_INSTANCES"] == "[1, 1, 1]"
    assert model_dirs(up_args(model=None)) == ["models/dls-tiny"]


def test_two_models_are_served_by_every_service_and_the_workers_take_them_in_turn():
    env = env_for(model=["models/dls-tiny", "/tmp/x/other"], workers=3)
    assert env["DLS_MODEL_DIRS"] == "models/dls-tiny,/tmp/x/other"
    assert json.loads(env["DLS_NODE_AGENT_INITIAL_MODELS"]) == ["dls-tiny", "other", "dls-tiny"]
    assert env["DLS_NODE_AGENT_INITIAL_INSTANCES"] == "[1, 1, 1]"
    # the first model is each service's own (and the one --calibration is for)
    assert env["DLS_MODEL_DIR"] == env["DLS_GATEWAY_MODEL_DIR"] == env["DLS_NODE_AGENT_MODEL_DIR"] == "models/dls-tiny"


def test_workers_per_model_divides_them_and_sets_their_number():
    args = up_args(model=["a/m1", "b/m2"], workers_per_model="1,3")
    assert worker_placement(args) == Placement("cpu", [1, 1, 1, 1])  # no --workers: their sum
    assert worker_models(args, 4) == ["m1", "m2", "m2", "m2"]
    env = service_env(args, "nats://n:1", "redis://r:2/0")
    assert json.loads(env["DLS_NODE_AGENT_INITIAL_MODELS"]) == ["m1", "m2", "m2", "m2"]
    assert worker_models(up_args(model=["a/m1", "b/m2"], workers_per_model="0,2"), 2) == ["m2", "m2"]
    tp_args = up_args(model=["a/m1", "b/m2"], workers_per_model="1,1", tp="2,1")
    assert worker_placement(tp_args) == Placement("cpu", [2, 1])
    assert json.loads(service_env(tp_args, "n", "r")["DLS_NODE_AGENT_INITIAL_MODELS"]) == ["m1", "m2"]


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(model=["a/m", "b/m"]), r"--model: a/m and b/m are both the model 'm' \(a model's name is its directory's"),
    (dict(model=["a/m", "a/m"]), r"--model: a/m and a/m are both the model 'm'"),
    (dict(model=["a/m,n"]), r"--model: a/m,n has a comma in it"),
    (dict(model=["a/m1", "b/m2", "c/m3"], workers=2), r"--workers: 2 worker\(s\) for 3 models"),
    (dict(model=["a/m1", "b/m2"], workers_per_model="2"), r"--workers-per-model: 2 counts >= 0 .* got '2'"),
    (dict(model=["a/m1", "b/m2"], workers_per_model="0,0"), r"--workers-per-model: 2 counts >= 0"),
    (dict(model=["a/m1", "b/m2"], workers_per_model="1,-1"), r"--workers-per-model: 2 counts >= 0"),
    (dict(model=["a/m1", "b/m2"], workers_per_model="1,x"), r"--workers-per-model: comma-separated integers"),
    (dict(model=["a/m1", "b/m2"], workers_per_model="2,2", workers=3),
     r"--workers-per-model 2,2 makes 4 workers, --workers/--tp 3"),
])
def test_bad_model_flags_are_refused_naming_the_flag(overrides, message):
    with pytest.raises(CliError, match=message):
        env_for(**overrides)


def test_each_models_calibration_is_said_and_the_serving_line_names_every_model(tmp_path):
    other = tmp_path / "other"
    shutil.copytree(BUNDLED, other, ignore=shutil.ignore_patterns("calibration", "replay", "MODEL_CARD.md"))
    args = up_args(model=[str(BUNDLED), str(other)], calibration="")
    lines = describe_calibrations(args, Placement("cpu", [1, 1]))
    assert list(lines) == ["dls-tiny", "other"]
    assert lines["dls-tiny"].startswith("calibration: ") and "NONE" not in lines["dls-tiny"]
    assert lines["other"].startswith("calibration: NONE") and str(other) in lines["other"]
    said = _serving_lines("http://h:1", lines)
    assert "DiLaServe is serving dls-tiny, other (UNCALIBRATED: see above) at http://h:1\n" in said
    assert '"model": "dls-tiny"' in said
    assert _division_line(lines, ["dls-tiny", "other", "dls-tiny"]) == "workers per model: dls-tiny 2, other 1"
    one = _serving_lines("http://h:1", {"dls-tiny": lines["dls-tiny"]})
    assert one.startswith("\nDiLaServe is serving dls-tiny at http://h:1\n\n  curl http://h:1/v1/completions")
