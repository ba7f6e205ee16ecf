"""The node agent's pure parts: worker command, instance ids, slots, worker environment, ack status."""

from __future__ import annotations

import json
import sys

import pytest

from services.node_agent.agent import (
    AgentError,
    NodeAgent,
    Worker,
    ack_status,
    first_free_slot,
    initial_slots,
    new_instance_id,
    worker_argv,
)
from shared.messages.control import PlanAckStatus
from shared.settings import NodeAgentSettings, WorkerSettings


def test_worker_command_runs_with_this_interpreter():
    assert worker_argv("python -m services.worker") == [sys.executable, "-m", "services.worker"]
    assert worker_argv("/opt/bin/worker --flag 'a b'") == ["/opt/bin/worker", "--flag", "a b"]
    with pytest.raises(AgentError, match="empty"):
        worker_argv("  ")


def test_instance_ids_are_readable_unique_subject_tokens():
    ids = {new_instance_id("node-a", 2, (4, 5)) for _ in range(50)}
    assert len(ids) > 40 and all(i.startswith("node-a-tp2-g4-") and "." not in i for i in ids)
    assert WorkerSettings(instance_id=ids.pop()).instance_id  # the worker accepts it


def test_slots_are_aligned_and_first_free():
    gpus = [3, 0, 1, 2]
    assert first_free_slot(gpus, set(), 2) == (0, 1)
    assert first_free_slot(gpus, {1}, 2) == (2, 3)
    assert first_free_slot(gpus, {1, 2}, 2) is None  # (1, 2) is not an aligned slot
    assert first_free_slot(gpus, {0}, 1) == (1,)
    assert initial_slots(gpus, [1, 2]) == [(0,), (2, 3)]
    assert initial_slots(gpus, []) == []
    with pytest.raises(AgentError, match="TP-4"):
        initial_slots(gpus, [1, 4])


def test_bad_settings_are_refused():
    with pytest.raises(AgentError, match="node name 'a.b'"):
        NodeAgent(NodeAgentSettings(node="a.b"), nc=None)
    with pytest.raises(AgentError, match="without repeats"):
        NodeAgent(NodeAgentSettings(gpu_ids=[0, 0]), nc=None)


def test_worker_environment(monkeypatch):
    monkeypatch.setenv("DLS_WORKER_MAX_BATCH", "8")
    settings = NodeAgentSettings(node="n1", gpu_ids=[0, 1], nats_url="nats://x:1", subject_prefix="p1",
                                 redis_key_prefix="k1")
    agent = NodeAgent(settings, nc=None)
    env = agent.worker_env(Worker("n1-tp2-g0-abcd", 2, (0, 1), restartable=True))
    assert (env["DLS_NATS_URL"], env["DLS_SUBJECT_PREFIX"], env["DLS_REDIS_KEY_PREFIX"]) == ("nats://x:1", "p1", "k1")
    assert json.loads(env["DLS_WORKER_GPU_IDS"]) == [0, 1] and env["DLS_WORKER_TP"] == "2"
    assert env["DLS_WORKER_MAX_BATCH"] == "8" and "PATH" in env
    for name, value in env.items():
        if name.startswith("DLS_"):
            monkeypatch.setenv(name, value)
    worker = WorkerSettings()  # what the worker will read
    assert (worker.instance_id, worker.node, worker.gpu_ids, worker.tp, worker.max_batch) == (
        "n1-tp2-g0-abcd", "n1", [0, 1], 2, 8)


def test_ack_status():
    assert ack_status(0, []) == PlanAckStatus.APPLIED
    assert ack_status(2, ["x"]) == PlanAckStatus.PARTIAL
    assert ack_status(0, ["x"]) == PlanAckStatus.FAILED


def test_a_gpu_count_gives_the_gpus_and_one_tp1_worker_each_unless_they_are_set():
    settings = NodeAgentSettings(num_gpus=4)
    assert settings.gpu_ids == [0, 1, 2, 3] and settings.initial_instances == [1, 1, 1, 1]
    assert initial_slots(settings.gpu_ids, settings.initial_instances) == [(0,), (1,), (2,), (3,)]
    assert NodeAgentSettings(num_gpus=2, initial_instances=[2]).initial_instances == [2]
    assert NodeAgentSettings(num_gpus=2, gpu_ids=[4, 5]).gpu_ids == [4, 5]
    with pytest.raises(ValueError, match=r"GPU_IDS \[0\] are not DLS_NODE_AGENT_NUM_GPUS 2 GPUs"):
        NodeAgentSettings(num_gpus=2, gpu_ids=[0])
    assert NodeAgentSettings().gpu_ids == [0]  # no count: as before


def test_workers_are_pinned_through_the_gpus_the_agent_itself_was_given(monkeypatch):
    from services.worker.parallel.placement import rank_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa,GPU-bb,4,5")  # the agent sees four GPUs, as 0..3
    agent = NodeAgent(NodeAgentSettings(node="n1", gpu_ids=[0, 1, 2, 3]), nc=None)
    envs = {gpus: agent.worker_env(Worker(f"n1-tp{len(gpus)}-g{gpus[0]}-abcd", len(gpus), gpus, restartable=True))
            for gpus in ((0,), (1,), (2, 3))}
    assert {gpus: env["CUDA_VISIBLE_DEVICES"] for gpus, env in envs.items()} == {
        (0,): "GPU-aa", (1,): "GPU-bb", (2, 3): "4,5"}
    assert rank_gpus("cuda", 2, envs[(2, 3)]) == ["4", "5"] and rank_gpus("cuda", 1, envs[(1,)]) == ["GPU-bb"]
    with pytest.raises(AgentError, match=r"GPU_IDS \[0, 1, 2, 3, 4\]: GPUs \[4\] are not among the 4 devices"):
        NodeAgent(NodeAgentSettings(node="n1", gpu_ids=[0, 1, 2, 3, 4]), nc=None)
