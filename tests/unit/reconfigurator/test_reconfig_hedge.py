"""The hedge of a division of GPUs between models (``core/hedge.py``): while the GPUs allow, a model
that is light now is planned as if it had a share of the cluster's arrivals, so that a flip of the mix
does not find it with the few GPUs its own load needs."""

from __future__ import annotations

import pytest

from services.reconfigurator.core.example_profile import example_profile
from services.reconfigurator.core.files import load_workload
from services.reconfigurator.core.hedge import hedge_demands
from services.reconfigurator.core.reconfigurator import ModelsReconfigurator
from services.reconfigurator.core.spec import ModelDemand, Workload, uniform_cluster
from services.reconfigurator.core.stage1 import Stage1Options, _gpus_needed, divide_gpus, precompute_model
from tests.unit.reconfigurator.test_reconfig_dividers import SETTINGS, Clock, arrive, running
from tests.unit.reconfigurator.test_reconfig_models import ROOT

EXAMPLE = load_workload(ROOT / "services/reconfigurator/examples/workload.json")
OPTIONS = Stage1Options()


def at(rps: float) -> Workload:
    return EXAMPLE.with_rate_scale(rps / EXAMPLE.total_rate)


def pair(heavy_rps: float, light_rps: float) -> list[ModelDemand]:
    return [ModelDemand("heavy", at(heavy_rps), example_profile()), ModelDemand("light", at(light_rps), example_profile())]


def needed(demands, cluster) -> float:
    return sum(_gpus_needed(precompute_model(d, cluster, OPTIONS), OPTIONS.max_utilization) for d in demands if d.has_load)


def test_with_room_each_model_is_planned_for_a_share_of_all_the_arrivals():
    cluster = uniform_cluster(8, 8, (1, 2, 4, 8))
    demands = pair(30.0, 10.0)
    hedged, hedge = hedge_demands(demands, cluster, OPTIONS)
    assert hedge.share > 0.25  # more than the light model's own quarter of the arrivals
    assert hedge.scales["light"] > 1.0
    for d in hedged:  # planned (the buffer applied) for at least the share of all 40 req/s
        planned = d.workload.total_rate * (1.0 + d.workload.safety_buffer)
        assert planned >= min(hedge.share * 40.0, planned) - 1e-9
    assert hedged[1].workload.total_rate == pytest.approx(10.0 * hedge.scales["light"])
    assert needed(hedged, cluster) <= cluster.num_gpus + 1e-6
    # the division of the hedged loads leaves the light model more GPUs than its own load would
    plain = divide_gpus(demands, cluster).gpus_by_model
    hedged_division = divide_gpus(hedged, cluster).gpus_by_model
    assert hedged_division["light"] > plain["light"]


def test_a_model_whose_own_load_is_above_the_share_is_planned_as_it_is():
    cluster = uniform_cluster(2, 8, (1, 2))
    demands = pair(48.0, 12.0)
    hedged, hedge = hedge_demands(demands, cluster, OPTIONS)
    assert 0.0 < hedge.share * 60.0 < 48.0 * 1.2
    assert hedge.scales["heavy"] == 1.0 and hedged[0] is demands[0]
    assert hedge.scales["light"] > 1.0


def test_the_share_is_the_largest_that_fits():
    cluster = uniform_cluster(2, 8, (1, 2))
    demands = pair(48.0, 12.0)
    hedged, hedge = hedge_demands(demands, cluster, OPTIONS)
    assert 0.0 < hedge.share < 1.0, hedge
    # the largest: the hedged loads fill the cluster at the lowest thresholds, and no larger share is taken
    assert needed(hedged, cluster) == pytest.approx(cluster.num_gpus, rel=1e-3)
    assert hedge_demands(demands, cluster, OPTIONS, max_share=hedge.share + 0.05)[1].share == pytest.approx(hedge.share,
                                                                                                           abs=1e-6)


def test_where_the_own_loads_fill_the_cluster_the_division_follows_them_alone():
    cluster = uniform_cluster(1, 8, (1, 2))
    demands = pair(60.0, 20.0)
    assert needed(demands, cluster) > cluster.num_gpus
    hedged, hedge = hedge_demands(demands, cluster, OPTIONS)
    assert hedge.share == 0.0 and hedged == demands


@pytest.mark.parametrize("case", ["off", "one model", "idle model"])
def test_nothing_is_hedged_when_off_alone_or_without_load(case):
    cluster = uniform_cluster(8, 8, (1, 2, 4, 8))
    demands = pair(30.0, 10.0)
    max_share = 1.0
    if case == "off":
        max_share = 0.0
    elif case == "one model":
        demands = demands[:1]
    else:
        demands = [demands[0], ModelDemand("idle", at(10.0).with_rate_scale(0.0), example_profile(), min_instances=1)]
    hedged, hedge = hedge_demands(demands, cluster, OPTIONS, max_share)
    assert hedged == demands
    assert all(scale == 1.0 for scale in hedge.scales.values())


def test_the_reconfigurator_keeps_the_light_model_more_gpus_with_the_hedge_than_without():
    def light_gpus(hedge_share: float) -> int:
        clock = Clock()
        models = [ModelDemand(name, Workload(()), example_profile(), switch_s=30.0, min_instances=1) for name in "ab"]
        divider = ModelsReconfigurator(models, clock, SETTINGS, hedge_share=hedge_share)
        cluster, on = running(uniform_cluster(2, 8, (1, 2)), {"a": 8, "b": 8})
        arrive(divider, clock, {"a": 12.0, "b": 0.5})
        outcome = divider.step(cluster, on).outcome
        assert outcome is not None
        return outcome.division.gpus_by_model["b"]

    assert light_gpus(1.0) > light_gpus(0.0)
