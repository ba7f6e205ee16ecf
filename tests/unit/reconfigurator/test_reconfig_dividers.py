"""The policies that divide a cluster's GPUs between models every period: DiLaServe's
``ModelsReconfigurator`` (one ILP over every model, under the trigger rule) and the per-model planners
sharing a GPU budget it is compared with (``SharedBudgetPlanners``)."""

from __future__ import annotations

import pytest

from services.reconfigurator.core.baselines import SharedBudgetPlanners, share_slots
from services.reconfigurator.core.example_profile import example_profile
from services.reconfigurator.core.monitor import ArrivalEvent, MonitorSettings
from services.reconfigurator.core.reconfigurator import ModelsReconfigurator
from services.reconfigurator.core.spec import Instance, ModelDemand, Workload, uniform_cluster


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


SETTINGS = MonitorSettings(window_s=30.0, min_window_s=10.0, peak_windows=1)


def models(min_instances: int = 1) -> list[ModelDemand]:
    return [ModelDemand(name, Workload(()), example_profile(), switch_s=30.0, min_instances=min_instances)
            for name in ("a", "b")]


def arrive(divider, clock: Clock, rates: dict[str, float], seconds: float = 30.0) -> None:
    """Arrivals of each model at its rate for ``seconds``, ending at the clock's time after it."""
    start = clock.now
    for name, rate in rates.items():
        n = int(rate * seconds)
        for i in range(n):
            divider.observe(ArrivalEvent(start + i * seconds / max(n, 1), 200, 256, None), name)
    clock.now = start + seconds


def running(cluster, split: dict[str, int]):
    """``cluster`` with TP-1 instances on every GPU, the first ones to the first model."""
    instances = [Instance(node.name, 1, (g,)) for node in cluster.nodes for g in node.gpu_ids]
    names = [name for name, n in split.items() for _ in range(n)]
    placement = tuple(instances[: len(names)])
    return cluster.with_placement(placement), dict(zip(placement, names, strict=True))


def test_the_division_follows_each_models_own_arrivals_and_waits_for_its_acknowledgement():
    clock = Clock()
    divider = ModelsReconfigurator(models(), clock, SETTINGS, hedge_share=0.0)  # the loads alone (no hedge)
    cluster, on = running(uniform_cluster(2, 8, (1, 2)), {"a": 8, "b": 8})
    arrive(divider, clock, {"a": 12.0, "b": 0.5})
    first = divider.step(cluster, on)
    assert first.plan_to_apply is not None, first.decision.reason
    gpus = first.plan_to_apply.division.gpus_by_model
    assert gpus["a"] > gpus["b"] >= 1  # b keeps its minimum
    starts = {m: p.num_started for m, p in first.plan_to_apply.placement.by_model.items()}
    assert starts["a"] > 0 and starts["b"] == 0
    # one plan in flight at a time
    assert divider.step(cluster, on).plan_to_apply is None
    assert divider.acknowledge(first.plan_to_apply.plan_id)
    # the mix flips: the next plan gives b the GPUs
    arrive(divider, clock, {"a": 0.5, "b": 12.0})
    flipped = divider.step(cluster, on)
    assert flipped.plan_to_apply is not None, flipped.decision.reason
    gpus = flipped.plan_to_apply.division.gpus_by_model
    assert gpus["b"] > gpus["a"] >= 1


def test_a_division_already_running_is_not_applied_again():
    clock = Clock()
    divider = ModelsReconfigurator(models(), clock, SETTINGS)
    cluster = uniform_cluster(2, 8, (1, 2))
    arrive(divider, clock, {"a": 10.0, "b": 10.0})
    clock.now += 60.0  # watched long enough for a gain
    arrive(divider, clock, {"a": 10.0, "b": 10.0})
    first = divider.step(*running(cluster, {"a": 8, "b": 8}))
    plan = first.plan_to_apply
    if plan is not None:  # apply it, then the same workload asks for nothing more
        divider.acknowledge(plan.plan_id)
        target = plan.placement.target_instances_by_model()
        placement = tuple(i for instances in target.values() for i in instances)
        on = {i: m for m, instances in target.items() for i in instances}
        cluster, running_now = cluster.with_placement(placement), on
    else:
        cluster, running_now = running(cluster, {"a": 8, "b": 8})
    arrive(divider, clock, {"a": 10.0, "b": 10.0})
    again = divider.step(cluster, running_now)
    assert again.plan_to_apply is None
    assert "shape" in again.decision.reason or "gain" in again.decision.reason


def test_an_arrival_of_a_model_not_served_counts_for_the_first():
    clock = Clock()
    divider = ModelsReconfigurator(models(), clock, SETTINGS)
    arrive(divider, clock, {"": 5.0})
    demands = {d.name: d for d in divider.demands()}
    assert demands["a"].has_load and not demands["b"].has_load


def test_models_must_be_named_apart():
    with pytest.raises(ValueError, match="share a name"):
        ModelsReconfigurator([*models(), models()[0]], Clock())
    with pytest.raises(ValueError, match="at least one"):
        ModelsReconfigurator([], Clock())


# --- per-model planners under one budget -------------------------------------------------------


@pytest.mark.parametrize(("asks", "minimum", "slots", "expected"), [
    ({"a": 3.0, "b": 1.0}, {"a": 1, "b": 1}, 16, {"a": 12, "b": 4}),
    ({"a": 1.0, "b": 0.0}, {"a": 1, "b": 1}, 16, {"a": 15, "b": 1}),
    ({"a": 0.0, "b": 0.0}, {"a": 1, "b": 0}, 16, {"a": 1, "b": 0}),
    ({"a": 1.0, "b": 1.0, "c": 1.0}, {}, 16, {"a": 6, "b": 5, "c": 5}),
    ({"a": 5.0, "b": 5.0}, {"a": 9, "b": 9}, 16, {"a": 9, "b": 9}),  # minimums over the slots: given as they are
])
def test_slots_are_shared_in_proportion_to_what_each_model_asks(asks, minimum, slots, expected):
    counts = share_slots(asks, minimum, slots)
    assert counts == expected
    if sum(minimum.values()) <= slots and any(asks.values()):
        assert sum(counts.values()) == slots  # no slot idles


def test_per_model_planners_scale_each_model_by_its_own_load():
    clock = Clock()
    planners = SharedBudgetPlanners(models(), clock, SETTINGS)
    cluster, on = running(uniform_cluster(2, 8, (1, 2)), {"a": 8, "b": 8})
    arrive(planners, clock, {"a": 9.0, "b": 3.0})
    asks = planners.asks(cluster)
    assert asks["a"] == pytest.approx(3 * asks["b"], rel=0.05)
    round_ = planners.step(cluster, on)
    plan = round_.plan_to_apply
    assert plan is not None, round_.decision.reason
    division = plan.division.instances_by_model_tp
    assert set(division["a"]) == set(division["b"]) == {1}  # each at its deployment's degree
    assert division["a"][1] + division["b"][1] == 16  # the whole budget, in about the 3:1 of the asks
    assert division["a"][1] / division["b"][1] == pytest.approx(3.0, rel=0.3)
    assert planners.step(cluster, on).plan_to_apply is None  # in flight
    assert planners.acknowledge(plan.plan_id)
    target = plan.placement.target_instances_by_model()
    applied = cluster.with_placement(tuple(i for instances in target.values() for i in instances))
    on = {i: m for m, instances in target.items() for i in instances}
    arrive(planners, clock, {"a": 9.0, "b": 3.0})
    same = planners.step(applied, on)
    assert same.plan_to_apply is None and "already" in same.decision.reason
