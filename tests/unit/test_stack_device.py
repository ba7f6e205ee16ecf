"""``dls up --device``: CPU as before; CUDA workers pinned per slot; no CUDA device: refused at once,
before anything starts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from services.stack import Placement, service_env, worker_placement
from shared.cli import CliError
from shared.runtime import free_port

REPO = Path(__file__).resolve().parents[2]


def up_args(**overrides) -> SimpleNamespace:
    args = dict(host="127.0.0.1", port=8000, workers=None, tp=None, device="cpu", gpus=None, policy="dilaserve",
                schedulers=1, pace=None, pace_scale=1.0, pace_context=None, model="models/dls-tiny", run_dir="runs/x")
    return SimpleNamespace(**{**args, **overrides})


def test_cpu_is_the_default_and_places_workers_as_before(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("DLS_WORKER_DEVICE", raising=False)
    assert worker_placement(up_args()) == Placement("cpu", [1, 1])
    assert worker_placement(up_args(workers=3)) == Placement("cpu", [1, 1, 1])
    env = service_env(up_args(tp="1,2"), "nats://n:1", "redis://r:2/0")
    assert json.loads(env["DLS_NODE_AGENT_GPU_IDS"]) == [0, 1, 2] and env["DLS_NODE_AGENT_INITIAL_INSTANCES"] == "[1, 2]"
    assert "DLS_WORKER_DEVICE" not in env and "CUDA_VISIBLE_DEVICES" not in env
    with pytest.raises(CliError, match="--gpus: needs --device cuda"):
        worker_placement(up_args(gpus="0,1"))
    with pytest.raises(CliError, match="--tp: comma-separated integers"):
        worker_placement(up_args(tp="1,x"))


def test_cuda_workers_get_the_chosen_gpus_as_the_agents_slots(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # what this process sees as GPUs 0..3
    env = service_env(up_args(device="cuda"), "nats://n:1", "redis://r:2/0", Placement("cuda", [1, 2], [1, 2, 3]))
    assert env["DLS_WORKER_DEVICE"] == "cuda" and env["CUDA_VISIBLE_DEVICES"] == "5,6,7"
    assert json.loads(env["DLS_NODE_AGENT_GPU_IDS"]) == [0, 1, 2] and env["DLS_NODE_AGENT_INITIAL_INSTANCES"] == "[1, 2]"
    assert json.loads(env["DLS_RECONFIGURATOR_CLUSTER"]) == {"nodes": {"local": 3}}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_up_on_cuda_without_a_cuda_device_fails_at_once_and_starts_nothing(tmp_path):
    nats_port, redis_port = free_port(), free_port()
    env = dict(os.environ, DLS_NATS_URL=f"nats://127.0.0.1:{nats_port}", DLS_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0")
    run_dir = tmp_path / "stack"
    done = subprocess.run([sys.executable, "-m", "services.cli", "up", "--device", "cuda", "--port", str(free_port()),
                           "--run-dir", str(run_dir)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "dls: error: --device cuda: torch" in done.stderr and "sees no CUDA device" in done.stderr
    assert "nothing was started" in done.stderr and done.stdout == ""
    assert not run_dir.exists()  # no server, no service, not even a log
    for port in (nats_port, redis_port):
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_cuda_placement_takes_every_gpu_or_those_named_and_checks_the_slots(monkeypatch):
    # what torch would say on a 4-GPU machine (the CUDA check itself is tested above, where it refuses)
    monkeypatch.setattr("services.stack.cuda_problem", lambda device, num_gpus: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert worker_placement(up_args(device="cuda")) == Placement("cuda", [1, 1, 1, 1], [0, 1, 2, 3])
    assert worker_placement(up_args(device="cuda", gpus="2,3", workers=1)) == Placement("cuda", [1], [2, 3])
    assert worker_placement(up_args(device="cuda", gpus="0,1,2,3", tp="2,1")) == Placement("cuda", [2, 1], [0, 1, 2, 3])
    with pytest.raises(CliError, match=r"--gpus: 3,4 must name distinct GPUs among the 4 this process sees"):
        worker_placement(up_args(device="cuda", gpus="3,4"))
    with pytest.raises(CliError, match=r"--tp/--workers on --gpus 0,1,2: .*no free aligned slot left for TP-2"):
        worker_placement(up_args(device="cuda", gpus="0,1,2", tp="1,2"))
