"""The simulator with several models: each model's steps timed by its own profile, every request on
instances of its model through reconfigurations that move GPUs between the models, the division
following the flipping mix, and the per-model figures the multi-model preset reports."""

from __future__ import annotations

import dataclasses

import pytest

from sim import multimodel
from sim.cluster import ClusterSpec
from sim.multimodel import MULTI_PRESETS, MultiModelPreset, ServedModel, multi_setup, run
from sim.simulator import Simulator


def tiny() -> MultiModelPreset:
    """Two models on 8 GPUs whose mix flips 90:10 -> 10:90, with short switch times."""
    preset = MULTI_PRESETS.get("multi-model")
    cluster = ClusterSpec(num_nodes=2, gpus_per_node=4, initial_tp=(1,) * 8, tp_degrees=(1, 2), reconfigure=True,
                          reconfig_period_s=10.0, reconfig_window_s=10.0, reconfig_peak_windows=1)
    flip = (0.9, 0.1)
    return dataclasses.replace(
        preset,
        base=dataclasses.replace(preset.base, cluster=cluster),
        models=(ServedModel("a", 4.0, flip, switch_s=3.0), ServedModel("b", 6.0, tuple(1 - s for s in flip),
                                                                        profile_scale=0.8, switch_s=3.0)),
        phase_s=(60.0, 60.0), rate_mults=(0.8,), flip_bin_s=10.0,
    )


@pytest.fixture(scope="module")
def setup():
    return multi_setup(tiny())


@pytest.fixture(scope="module")
def checked_run(setup):
    """A DiLaServe run recording, for every step started, the instance's model and its requests' models; at
    2x, where the models' own loads fill the cluster (no room for the hedge: the division follows them)."""
    seen = []
    original = Simulator._start

    def start(self, command):
        instance = self.view.instances[command.instance_id]
        seen.append((instance.model, {self.view.requests[it.request_id].model for it in command.items}))
        original(self, command)

    Simulator._start = start
    try:
        summary = run(setup, "dilaserve", 2.0)
    finally:
        Simulator._start = original
    return summary, seen


def test_every_step_runs_only_requests_of_its_instances_model(checked_run):
    summary, seen = checked_run
    assert seen
    assert all(models == {instance_model} for instance_model, models in seen)
    moved = [r for r in summary["reconfigurations"] if r.get("instances_by_model")]
    assert moved, "no division was applied, so nothing moved between the models"


def test_the_division_follows_the_flip(checked_run):
    summary, _ = checked_run
    times = summary["gpus_over_time"]["time_s"]
    gpus = summary["gpus_over_time"]["gpus_by_model"]
    before = [g for t, g in zip(times, gpus, strict=True) if 30.0 <= t < 60.0]
    after = [g for t, g in zip(times, gpus, strict=True) if t >= 90.0]
    assert before and after
    assert all(g.get("a", 0) > g.get("b", 0) for g in before)
    assert all(g.get("b", 0) > g.get("a", 0) for g in after)


def test_with_room_the_hedge_keeps_the_light_model_its_gpus_through_the_flip(setup):
    """At 0.8x both models' loads fit several times over: each is planned for a share of all the arrivals
    (``core/hedge.py``), so neither is cut to the one or two GPUs its own light phase needs."""
    summary = run(setup, "dilaserve", 0.8)
    gpus = summary["gpus_over_time"]["gpus_by_model"]
    assert min(min(g.get("a", 0), g.get("b", 0)) for g in gpus) >= 3, gpus
    assert summary["slo_attainment"] >= 0.95


def test_figures_per_model_and_after_each_flip(checked_run, setup):
    summary, _ = checked_run
    assert set(summary["by_model"]) == {"a", "b"}
    assert sum(f["num_requests"] for f in summary["by_model"].values()) == summary["num_requests"]
    for figures in summary["by_model"].values():
        assert [f["flip_s"] for f in figures["after_flips"]["flips"]] == [60.0]
        assert len(figures["attainment_over_time"]) >= 11
    # each model's SLO is its own factor times its own isolated latency (b's steps are 0.8x a's)
    a, b = setup.models["a"], setup.models["b"]
    assert b.base_latency_s == pytest.approx(0.8 * a.base_latency_s, rel=1e-6)
    assert a.slo_s == pytest.approx(4.0 * a.base_latency_s) and b.slo_s == pytest.approx(6.0 * b.base_latency_s)


def test_a_static_split_never_moves(setup):
    summary = run(setup, "static", 0.8, split={"a": 6, "b": 2})
    assert summary["reconfigurations"] == []
    assert all(g == {"a": 6, "b": 2} for g in summary["gpus_over_time"]["gpus_by_model"])


def test_per_model_planners_move_gpus_too(setup):
    summary = run(setup, "per-model", 0.8)
    assert summary["reconfigurations"]
    assert set(summary["by_model"]) == {"a", "b"}


def test_compare_refuses_an_unknown_policy(setup):
    with pytest.raises(ValueError, match="unknown policies"):
        multimodel.compare(setup, ["dilaserve", "nope"])


@pytest.mark.parametrize("overlap", [True, False])
def test_a_switch_made_before_break_leaves_no_gpu_idle(overlap):
    preset = tiny()
    cluster = dataclasses.replace(preset.base.cluster, overlap_switch=overlap)
    slow = tuple(dataclasses.replace(m, switch_s=12.0) for m in preset.models)
    preset = dataclasses.replace(preset, base=dataclasses.replace(preset.base, cluster=cluster, sample_period_s=1.0),
                                 models=slow)
    summary = run(multi_setup(preset), "dilaserve", 0.8)
    assert summary["reconfigurations"]
    serving = [sum(g.values()) for g in summary["gpus_over_time"]["gpus_by_model"]]
    if overlap:  # the outgoing instance serves through the incoming one's load
        assert min(serving) == 8
    else:  # drained first: its GPUs idle through the load
        assert min(serving) < 8


def test_frozen_thresholds_pin_the_requests_after_each_flip_alone():
    from shared.tasks import Family, Problem
    from sim.workload import RequestSpec

    problem = Problem(Family.ADD, "1+1=", "2", "1+1=", 0)
    specs = [RequestSpec(f"r{i}", t, problem, 16, 8, 1.0, model=m)
             for i, (t, m) in enumerate([(10.0, "a"), (65.0, "a"), (70.0, "b"), (190.0, "a")])]
    out = multimodel.freeze_after_flips(specs, [60.0], {"a": [0.83], "b": [None]})
    assert [(r.min_threshold, r.max_threshold) for r in out] == [(0.0, 1.0), (0.8, 0.8), (0.0, 1.0), (0.0, 1.0)]


def test_a_frozen_run_holds_each_models_pre_flip_threshold_after_the_flip(setup):
    ours = run(setup, "dilaserve", 2.0)
    frozen = {n: f["pre_flip_thresholds"] for n, f in ours["by_model"].items()}
    assert all(len(v) == 1 and v[0] is not None and 0.7 - 1e-9 <= v[0] <= 0.9 + 1e-9 for v in frozen.values()), frozen
    steps = []  # (request arrival, its model, the step's threshold) of every step started
    original = Simulator._start

    def start(self, command):
        for it in command.items:
            request = self.view.requests[it.request_id]
            steps.append((request.arrival_time, request.model, it.threshold))
        original(self, command)

    Simulator._start = start
    try:
        held = run(setup, "dilaserve-frozen", 2.0, frozen=frozen)
    finally:
        Simulator._start = original
    assert held["num_requests"] == ours["num_requests"]
    flip = tiny().flips_s[0]
    after = [(m, t) for arrival, m, t in steps if flip <= arrival < flip + multimodel.FLIP_WINDOW_S]
    assert after
    assert all(t == pytest.approx(round(frozen[m][0], 1)) for m, t in after)
    before = {t for arrival, _, t in steps if arrival < flip}
    assert len(before) > 1  # before the flip thresholds move as load control chooses
