"""Switches made before break, the pure parts: when the setting is on (and refused), which stopping
workers each start replaces, the incoming worker's /metrics port beside the outgoing one's, the
workers-per-model gauge."""

from __future__ import annotations

import pytest

from services.node_agent.agent import AgentError, NodeAgent, Worker, replaced_by, switch_on
from shared.messages.control import InstanceSlot
from shared.settings import NodeAgentSettings

CUDA = {"DLS_WORKER_DEVICE": "cuda"}


@pytest.mark.parametrize(("setting", "env", "on"), [
    ("auto", {}, True),  # the workers' default device is the CPU
    ("auto", {"DLS_WORKER_DEVICE": "cpu"}, True),
    ("auto", CUDA, False),
    ("auto", {"DLS_WORKER_DEVICE": "cuda:1"}, False),
    ("off", {}, False),
    ("on", {}, True),
    ("on", {**CUDA, "DLS_WORKER_KV_BUDGET_BYTES": str(20 << 30)}, True),
])
def test_the_setting_is_on_for_cpu_workers_and_on_cuda_where_the_operator_says(setting, env, on):
    assert switch_on(setting, env) is on


@pytest.mark.parametrize("budget", [None, "0"])
def test_on_for_cuda_workers_without_a_kv_budget_is_refused_naming_the_settings(budget):
    env = {**CUDA, **({"DLS_WORKER_KV_BUDGET_BYTES": budget} if budget is not None else {})}
    with pytest.raises(AgentError, match="DLS_NODE_AGENT_OVERLAP_SWITCH=on with CUDA workers .*needs "
                                         "DLS_WORKER_KV_BUDGET_BYTES set"):
        switch_on("on", env)
    with pytest.raises(AgentError, match="DLS_WORKER_KV_BUDGET_BYTES='lots' is not a byte count"):
        switch_on("on", {**CUDA, "DLS_WORKER_KV_BUDGET_BYTES": "lots"})


def test_the_agent_refuses_to_start_with_it_on_cuda_unbudgeted(monkeypatch):
    monkeypatch.setenv("DLS_WORKER_DEVICE", "cuda")
    monkeypatch.delenv("DLS_WORKER_KV_BUDGET_BYTES", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(AgentError, match="DLS_WORKER_KV_BUDGET_BYTES"):
        NodeAgent(NodeAgentSettings(gpu_ids=[0], overlap_switch="on"), nc=None)
    assert not NodeAgent(NodeAgentSettings(gpu_ids=[0]), nc=None).overlap_switch  # auto: off on CUDA


def worker(instance_id: str, gpus: tuple[int, ...], model: str) -> Worker:
    return Worker(instance_id, len(gpus), gpus, restartable=True, model=model)


def slot(gpus: list[int], model: str = "") -> InstanceSlot:
    return InstanceSlot(tp=len(gpus), gpu_ids=gpus, model=model)


def ids(replaced: list[list[Worker]]) -> list[list[str]]:
    return [[w.instance_id for w in workers] for workers in replaced]


def test_a_start_replaces_the_stops_on_its_gpus_that_serve_another_model():
    stopping = [worker("a0", (0,), "alpha"), worker("a1", (1,), "alpha"), worker("b2", (2, 3), "beta")]
    starts = [slot([0], "beta"), slot([1], "alpha"), slot([2], "alpha"), slot([4], "beta")]
    # GPU 0 changes model; GPU 1 is alpha again (a restart, not a switch); beta's TP-2 gives GPU 2 to alpha
    assert ids(replaced_by(starts, stopping, "alpha")) == [["a0"], [], ["b2"], []]


def test_a_slot_naming_no_model_is_the_default_ones():
    stopping = [worker("a0", (0,), "alpha"), worker("b1", (1,), "beta")]
    assert ids(replaced_by([slot([0]), slot([1])], stopping, "alpha")) == [[], ["b1"]]


def test_a_worker_any_start_switches_is_replaced_by_every_start_on_its_gpus():
    # alpha's TP-2 on [0, 1] gives way to alpha on [0] and beta on [1]: both spawn beside it (neither waits)
    stopping = [worker("a01", (0, 1), "alpha")]
    assert ids(replaced_by([slot([0], "alpha"), slot([1], "beta")], stopping, "alpha")) == [["a01"], ["a01"]]


def test_the_incoming_workers_metrics_port_is_beside_the_outgoing_ones():
    agent = NodeAgent(NodeAgentSettings(gpu_ids=[0, 1, 2, 3], metrics_port=9000, initial_instances=[]), nc=None)
    assert agent.free_metrics_port((1,)) == 9002
    agent.workers["old"] = Worker("old", 2, (0, 1), restartable=True, metrics_port=agent.free_metrics_port((0, 1)))
    assert agent.workers["old"].metrics_port == 9001
    assert agent.free_metrics_port((0,)) == 9005  # beside the outgoing one on GPU 0: past the agent's 4 GPUs
    assert agent.free_metrics_port((1,)) == 9002
    off = NodeAgent(NodeAgentSettings(gpu_ids=[0, 1], metrics_port=0, initial_instances=[]), nc=None)
    assert off.free_metrics_port((0,)) == 0


def test_workers_are_counted_per_model(tmp_path):
    settings = NodeAgentSettings(gpu_ids=[0, 1, 2], initial_instances=[], model_dirs=f"{tmp_path}/alpha,{tmp_path}/beta")
    agent = NodeAgent(settings, nc=None)
    agent.workers = {"a0": worker("a0", (0,), "alpha"), "b1": worker("b1", (1,), "beta"),
                     "b2": worker("b2", (2,), "beta")}
    count = agent.metrics.registry.get_sample_value
    assert count("dls_node_agent_model_workers", {"model": "alpha"}) == 1
    assert count("dls_node_agent_model_workers", {"model": "beta"}) == 2
    assert count("dls_node_agent_workers") == 3
