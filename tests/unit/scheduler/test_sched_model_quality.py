"""Several models, each with its own quality curve: the candidate grid is the union of their candidates,
and each request runs within its own model's floors (``ThresholdGrid.model_floors``), built by the
service from each served model's calibration (``load_policy``). One model: the config of before."""

from __future__ import annotations

import shutil
from pathlib import Path

from services.scheduler.core import SchedulingLoop, make_policy
from services.scheduler.core.threshold import ModelFloors, ThresholdGrid
from services.scheduler.core.view import ClusterView
from services.scheduler.service import ServedQuality, load_policy, served_qualities
from shared.settings import SchedulerSettings
from tests.unit.scheduler.sched_builders import make_request, toy_profile

REPO = Path(__file__).resolve().parents[3]
BUNDLED = REPO / "models" / "dls-tiny"
CURVE = {"0.5": 0.712, "0.6": 0.85, "0.7": 0.994, "0.8": 0.998, "0.9": 0.998}
THRESHOLDS = [0.5, 0.6, 0.7, 0.8, 0.9]


def two_models(model_floors: dict[str, ModelFloors]) -> SchedulingLoop:
    """One toy TP-1 instance of model a, one of model b."""
    policy = make_policy("dilaserve", {"thresholds": tuple(THRESHOLDS), "model_floors": model_floors})
    view = ClusterView()
    view.add_instance("a0", 1, toy_profile(), node_id="n0", model="a")
    view.add_instance("b0", 1, toy_profile(), node_id="n1", model="b")
    return SchedulingLoop(policy, view)


def test_under_load_each_model_is_lowered_only_as_far_as_its_own_curve_allows():
    """Seven requests of each model, SLO 2 s, on one instance each: load control lowers the requests of a
    (calibrated: 0.5 and up) to the bottom of the grid; those of b (uncalibrated: the highest alone) stay
    at 0.9, whatever the load."""
    loop = two_models({"a": ModelFloors(0.5), "b": ModelFloors(0.9)})
    requests = [make_request(f"{m}{i}", slo_s=2.0, model=m) for i in range(7) for m in ("a", "b")]
    decisions = loop.on_arrivals(0.0, requests)
    by_model = {m: [a for a in decisions.assignments if a.request_id.startswith(m)] for m in ("a", "b")}
    assert len(by_model["a"]) == len(by_model["b"]) == 7
    assert min(a.max_allowed_threshold for a in by_model["a"]) == 0.5  # lowered, down to its floor
    assert {a.max_allowed_threshold for a in by_model["b"]} == {a.threshold for a in by_model["b"]} == {0.9}
    assert all(a.instance_id == f"{a.request_id[0]}0" for a in decisions.assignments)


def test_a_models_floors_bound_its_canvas_and_leave_the_others_alone():
    grid = ThresholdGrid(THRESHOLDS, {16: 0.8, 64: 0.5},
                         {"a": ModelFloors(0.6, ((16, 0.7), (64, 0.6))), "b": ModelFloors(0.9)})

    def lowest(model, gen_len=128):
        return grid.values[grid.request_range(make_request("r", gen_len=gen_len, model=model))[0]]

    assert (lowest("a"), lowest("a", 16), lowest("b"), lowest("b", 16)) == (0.6, 0.7, 0.9, 0.9)
    assert (lowest("other"), lowest("other", 16)) == (0.5, 0.8)  # not named: the grid's own canvas floors
    grid.withdraw_below(0.8, "a")  # shadow decoding, on a's requests
    assert (lowest("a"), grid.lowest_of("a"), lowest("other")) == (0.8, 0.8, 0.5)
    grid.withdraw_below(0.7)  # every request's
    assert (lowest("other"), lowest("a"), grid.lowest_of()) == (0.7, 0.8, 0.7)


def test_the_service_gives_each_model_its_own_curves_floors():
    settings = SchedulerSettings(thresholds=THRESHOLDS)
    tight = {"accuracy": CURVE, "accuracy@16": {"0.5": 0.655, "0.6": 0.865, "0.7": 0.935, "0.8": 0.995, "0.9": 1.0}}
    loose = {"accuracy": {"0.5": 0.99, "0.6": 0.995, "0.7": 0.998, "0.8": 0.998, "0.9": 0.998}}
    qualities = {"a": ServedQuality(tight, "a/quality.json"), "b": ServedQuality(None, "b (uncalibrated)"),
                 "c": ServedQuality(loose, "c/quality.json")}
    policy = load_policy(settings, qualities=qualities)
    assert policy.grid.values == (0.5, 0.6, 0.7, 0.8, 0.9)  # the union: c's reach 0.5
    floors = policy.config.model_floors
    assert floors["a"] == ModelFloors(0.7, ((16, 0.8),)) and floors["b"] == ModelFloors(0.9)
    assert floors["c"] == ModelFloors(0.5) and floors[""] == floors["a"]  # no model named: the first's
    assert policy.config.canvas_floors == ((16, 0.8),)

    one = load_policy(settings, qualities={"a": qualities["a"]})  # one model: as before several
    assert one.grid.values == (0.7, 0.8, 0.9) and one.config.model_floors == {}
    assert one.config == load_policy(settings, qualities["a"]).config


def test_served_models_are_read_from_their_own_calibrations(tmp_path):
    """The bundled model (calibrated) and a copy of it without its calibration."""
    copy = tmp_path / "dls-copy"
    shutil.copytree(BUNDLED, copy, ignore=shutil.ignore_patterns("calibration"))
    settings = SchedulerSettings(thresholds=THRESHOLDS, model_dirs=f"{BUNDLED},{copy}", quality_curves=["accuracy"])
    qualities = served_qualities(settings)
    assert list(qualities) == ["dls-tiny", "dls-copy"]
    assert qualities["dls-tiny"].curves is not None and qualities["dls-copy"].curves is None
    floors = load_policy(settings).config.model_floors
    assert floors["dls-tiny"].lowest == 0.7 and floors["dls-copy"].lowest == 0.9
