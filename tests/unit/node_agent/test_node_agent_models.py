"""The node agent's served models: which it serves, which model each boot worker serves, and what a
worker of each is given (its directory; the calibration setting only for the first model's)."""

from __future__ import annotations

import pytest

from services.node_agent.agent import AgentError, NodeAgent, Worker, boot_models, served_models
from shared.settings import NodeAgentSettings

MODEL_VARS = ("DLS_NODE_AGENT_MODEL_DIR", "DLS_NODE_AGENT_MODEL_DIRS", "DLS_WORKER_MODEL_DIR", "DLS_MODEL_DIR",
              "DLS_MODEL_DIRS", "DLS_NODE_AGENT_INITIAL_MODELS", "DLS_CALIBRATION_DIR")


@pytest.fixture(autouse=True)
def _no_model_variables(monkeypatch):
    for name in MODEL_VARS:
        monkeypatch.delenv(name, raising=False)


def test_the_served_models_come_from_the_agents_own_setting_else_the_shared_ones(monkeypatch):
    assert NodeAgentSettings().served_model_dirs == ["models/dls-tiny"]
    monkeypatch.setenv("DLS_MODEL_DIR", "/m/shared")
    assert NodeAgentSettings().served_model_dirs == ["/m/shared"]
    monkeypatch.setenv("DLS_WORKER_MODEL_DIR", "/m/workers")  # what its workers were given before
    assert NodeAgentSettings().served_model_dirs == ["/m/workers"]
    monkeypatch.setenv("DLS_NODE_AGENT_MODEL_DIR", "/m/own")
    assert NodeAgentSettings().served_model_dirs == ["/m/own"]
    monkeypatch.setenv("DLS_MODEL_DIRS", "/m/a, /m/b")
    assert NodeAgentSettings().served_model_dirs == ["/m/a", "/m/b"]
    monkeypatch.setenv("DLS_NODE_AGENT_MODEL_DIRS", "/m/c")
    assert NodeAgentSettings().served_model_dirs == ["/m/c"]


def test_models_are_named_by_basename_and_two_of_one_name_are_refused():
    served = served_models(NodeAgentSettings(model_dirs="/m/a,/n/b"))
    assert {name: model.directory for name, model in served.items()} == {"a": "/m/a", "b": "/n/b"}
    with pytest.raises(AgentError, match=r"DLS_NODE_AGENT_MODEL_DIRS .*: /m/a and /n/a are both the model 'a'"):
        served_models(NodeAgentSettings(model_dirs="/m/a,/n/a"))


def test_boot_workers_take_the_models_in_turn_or_as_the_setting_names_them():
    assert boot_models([], 3, ["a"]) == ["a", "a", "a"]  # one model: every worker, as before
    assert boot_models([], 3, ["a", "b"]) == ["a", "b", "a"]
    assert boot_models(["b", "b"], 2, ["a", "b"]) == ["b", "b"]
    with pytest.raises(AgentError, match=r"DLS_NODE_AGENT_INITIAL_MODELS \['a'\] names 1 models for 2 initial"):
        boot_models(["a"], 2, ["a", "b"])
    with pytest.raises(AgentError, match=r"DLS_NODE_AGENT_INITIAL_MODELS: 'c' not served by this agent "
                                         r"\(it serves a, b"):
        boot_models(["a", "c"], 2, ["a", "b"])


def test_bad_model_settings_stop_the_agent_before_anything_starts():
    with pytest.raises(AgentError, match="both the model 'a'"):
        NodeAgent(NodeAgentSettings(gpu_ids=[0, 1], initial_instances=[1, 1], model_dirs="/m/a,/n/a"), nc=None)
    with pytest.raises(AgentError, match="DLS_NODE_AGENT_INITIAL_MODELS: 'x' not served"):
        NodeAgent(NodeAgentSettings(gpu_ids=[0, 1], initial_instances=[1, 1], model_dirs="/m/a,/m/b",
                                    initial_models=["a", "x"]), nc=None)


def test_each_worker_gets_its_models_directory_and_only_the_first_model_the_calibration_setting(monkeypatch):
    monkeypatch.setenv("DLS_CALIBRATION_DIR", "/cal/a")  # the agent's environment, which its workers inherit
    agent = NodeAgent(NodeAgentSettings(node="n1", gpu_ids=[0, 1, 2], initial_instances=[1, 1, 1],
                                        model_dirs="/m/a,/m/b"), nc=None)
    assert agent.boot_models == ["a", "b", "a"] and agent.default_model == "a"
    envs = {model: agent.worker_env(Worker(f"n1-tp1-g{i}-abcd", 1, (i,), restartable=True, model=model))
            for i, model in enumerate(("a", "b", ""))}
    assert {m: (e["DLS_WORKER_MODEL_DIR"], e["DLS_CALIBRATION_DIR"]) for m, e in envs.items()} == {
        "a": ("/m/a", "/cal/a"), "b": ("/m/b", ""), "": ("/m/a", "/cal/a")}
    assert Worker("i", 1, (0,), restartable=True, model="b").describe() == "i (b, TP-1 on GPUs [0])"
