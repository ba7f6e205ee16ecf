"""Scale from zero in the division policy (``ModelsReconfigurator``): a model with arrivals and no running
instance is one to start at once (``models_to_start``), and a division that starts it is applied even
where the margin rule alone would keep the shape (overload: the new division moves too few GPUs)."""

from __future__ import annotations

from services.reconfigurator.core.example_profile import example_profile
from services.reconfigurator.core.monitor import ArrivalEvent, MonitorSettings
from services.reconfigurator.core.reconfigurator import ModelsReconfigurator
from services.reconfigurator.core.spec import Instance, ModelDemand, Workload, uniform_cluster

WINDOW_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def two_models(clock: Clock) -> ModelsReconfigurator:
    """``a`` and ``b``, each kept at 0 instances without load; monitors that have watched their memory."""
    demands = [ModelDemand(name, Workload(()), example_profile(), min_instances=0) for name in ("a", "b")]
    core = ModelsReconfigurator(demands, clock, MonitorSettings(window_s=WINDOW_S, min_window_s=WINDOW_S,
                                                                peak_windows=1))
    clock.now += 2 * WINDOW_S
    return core


def arrive(core: ModelsReconfigurator, clock: Clock, model: str, rps: float) -> None:
    """The last window's arrivals of ``model`` at ``rps``."""
    count = max(1, int(rps * WINDOW_S))
    for i in range(count):
        core.observe(ArrivalEvent(clock.now - WINDOW_S + i * WINDOW_S / count, 200, 128), model)


def all_of_a(num_nodes: int):
    """A cluster of 8-GPU nodes whose every GPU runs a TP-1 instance of ``a``."""
    running = {Instance(f"node-{n}", 1, (g,)): "a" for n in range(num_nodes) for g in range(8)}
    return uniform_cluster(num_nodes, 8, (1, 2, 4, 8)).with_placement(tuple(running)), running


def test_a_model_with_arrivals_and_no_instance_is_one_to_start():
    clock = Clock()
    core = two_models(clock)
    cluster, running = all_of_a(1)
    assert core.models_to_start(running) == []  # no load anywhere: nothing to start
    arrive(core, clock, "a", 5.0)
    assert core.models_to_start(running) == []  # a has load and instances
    arrive(core, clock, "b", 0.1)  # one request of b, scaled to zero
    assert core.models_to_start(running) == ["b"]
    running_b = {**running, Instance("node-1", 1, (0,)): "b"}
    assert core.models_to_start(running_b) == []


def test_one_request_of_a_model_at_zero_gets_it_an_instance():
    clock = Clock()
    core = two_models(clock)
    cluster, running = all_of_a(1)
    arrive(core, clock, "a", 5.0)
    arrive(core, clock, "b", 0.1)
    result = core.step(cluster, running)
    assert result.decision.apply, result.decision
    assert result.plan_to_apply.division.gpus_by_model["b"] >= 1
    assert core.step(cluster, running).plan_to_apply is None  # in flight until acknowledged


def test_in_overload_a_division_that_starts_the_model_is_applied_though_it_moves_few_gpus():
    clock = Clock()
    core = two_models(clock)
    cluster, running = all_of_a(8)  # 64 GPUs, every one a's
    arrive(core, clock, "a", 3000.0)  # far beyond the cluster: every division is a fallback
    arrive(core, clock, "b", 200.0)  # its share: a few GPUs, under the 10% margin of the 64
    result = core.step(cluster, running)
    division = result.outcome.division
    assert division.objective is None and 0 < division.gpus_by_model["b"] < 0.1 * 64
    assert result.decision.apply, result.decision
    assert "a cold start" in result.decision.reason and "moves" in result.decision.reason
