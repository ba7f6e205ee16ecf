"""The reconfigurator service's settings and inputs for several models: the per-model switch times and
minimums (and their errors, naming the setting), each model's planning profile, and the wire form of
a division between models."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.reconfigurator.core.plan import ModelPlacement, NodePlan, PlacementPlan
from services.reconfigurator.core.spec import Instance
from services.reconfigurator.service import (
    loaded_profiles,
    model_demands,
    planning_profiles,
    wire_model_node_plans,
)
from shared.profiles import LatencyProfile
from shared.settings import DEFAULT_MIN_INSTANCES, DEFAULT_SWITCH_S, ReconfiguratorSettings

REPO = Path(__file__).resolve().parents[3]
BUNDLED = REPO / "models" / "dls-tiny"
TWO = "/m/alpha,/m/beta"


def test_switch_times_and_minimums_per_model_with_defaults_for_the_rest():
    settings = ReconfiguratorSettings(model_dirs=TWO, switch_s=" alpha = 12.5 ", min_instances="beta=0")
    assert settings.switch_s_by_model == {"alpha": 12.5} and settings.min_instances_by_model == {"beta": 0}
    profile = LatencyProfile.load(REPO / "profiles" / "llada-8b-h100.json")
    demands = {d.name: d for d in model_demands(settings, {"alpha": profile, "beta": profile})}
    assert (demands["alpha"].switch_s, demands["alpha"].min_instances) == (12.5, DEFAULT_MIN_INSTANCES)
    assert (demands["beta"].switch_s, demands["beta"].min_instances) == (DEFAULT_SWITCH_S, 0)
    assert demands["alpha"].tp_degrees == profile.tp_degrees and not demands["alpha"].workload.classes
    with pytest.raises(ValueError, match="profiles of alpha, but DLS_RECONFIGURATOR_MODEL_DIRS serves alpha, beta"):
        model_demands(settings, {"alpha": profile})


@pytest.mark.parametrize(("overrides", "message"), [
    ({"switch_s": "alpha=fast"}, "DLS_RECONFIGURATOR_SWITCH_S: 'alpha=fast' is not name=seconds with seconds >= 0"),
    ({"switch_s": "alpha=-1"}, "DLS_RECONFIGURATOR_SWITCH_S: 'alpha=-1' is not name=seconds"),
    ({"switch_s": "alpha=nan"}, "DLS_RECONFIGURATOR_SWITCH_S: 'alpha=nan' is not name=seconds"),
    ({"switch_s": "=30"}, "DLS_RECONFIGURATOR_SWITCH_S: '=30' is not name=seconds"),
    ({"switch_s": "alpha=1,alpha=2"}, "DLS_RECONFIGURATOR_SWITCH_S: 'alpha' is named twice"),
    ({"switch_s": "gamma=30"}, r"DLS_RECONFIGURATOR_SWITCH_S names gamma, which is not served \(served: alpha, beta"),
    ({"min_instances": "beta=1.5"}, "DLS_RECONFIGURATOR_MIN_INSTANCES: 'beta=1.5' is not name=n with n >= 0"),
    ({"min_instances": "beta=-1"}, "DLS_RECONFIGURATOR_MIN_INSTANCES: 'beta=-1' is not name=n"),
    ({"min_instances": "beta"}, "DLS_RECONFIGURATOR_MIN_INSTANCES: 'beta' is not name=n"),
    ({"min_instances": "gamma=1"}, "DLS_RECONFIGURATOR_MIN_INSTANCES names gamma, which is not served"),
])
def test_a_bad_pair_is_refused_naming_the_setting(overrides, message):
    with pytest.raises(ValidationError, match=message):
        ReconfiguratorSettings(model_dirs=TWO, **overrides)


def test_the_environment_sets_them(monkeypatch):
    monkeypatch.delenv("DLS_RECONFIGURATOR_MODEL_DIRS", raising=False)
    monkeypatch.setenv("DLS_MODEL_DIRS", TWO)
    monkeypatch.setenv("DLS_RECONFIGURATOR_SWITCH_S", "alpha=5,beta=90")
    monkeypatch.setenv("DLS_RECONFIGURATOR_MIN_INSTANCES", "alpha=2")
    settings = ReconfiguratorSettings()
    assert settings.switch_s_by_model == {"alpha": 5.0, "beta": 90.0}
    assert settings.min_instances_by_model == {"alpha": 2}


@pytest.fixture
def second_calibrated(tmp_path) -> Path:
    """The bundled model and its calibration under another name."""
    copy = tmp_path / "second"
    shutil.copytree(BUNDLED, copy, ignore=shutil.ignore_patterns("replay", "MODEL_CARD.md"))
    return copy


@pytest.fixture
def second_uncalibrated(tmp_path) -> Path:
    copy = tmp_path / "bare"
    shutil.copytree(BUNDLED, copy, ignore=shutil.ignore_patterns("calibration", "replay", "MODEL_CARD.md"))
    return copy


def test_each_model_is_planned_with_its_own_calibrations_profile(second_calibrated):
    settings = ReconfiguratorSettings(model_dirs=f"{BUNDLED},{second_calibrated}")
    assert planning_profiles(settings) == {"dls-tiny": str(BUNDLED / "calibration" / "profile.json"),
                                           "second": str(second_calibrated / "calibration" / "profile.json")}
    profiles = loaded_profiles(settings)
    assert list(profiles) == ["dls-tiny", "second"] and all(isinstance(p, LatencyProfile) for p in profiles.values())


def test_an_uncalibrated_model_among_several_means_no_plans_and_says_which(second_uncalibrated, caplog):
    settings = ReconfiguratorSettings(model_dirs=f"{BUNDLED},{second_uncalibrated}")
    assert planning_profiles(settings)["bare"] is None
    with caplog.at_level(logging.WARNING, logger="dls.reconfigurator"):
        assert loaded_profiles(settings) is None
    [said] = [r.getMessage() for r in caplog.records]
    assert str(second_uncalibrated) in said and "no plans while any served model is uncalibrated" in said
    # one profile for every model (as `dls up --pace` sets): planned with it
    paced = ReconfiguratorSettings(model_dirs=f"{BUNDLED},{second_uncalibrated}", profile=str(BUNDLED / "calibration"
                                                                                           / "profile.json"))
    assert set(planning_profiles(paced).values()) == {paced.profile} and len(loaded_profiles(paced)) == 2


def test_two_directories_with_one_name_are_refused():
    with pytest.raises(ValueError, match="DLS_RECONFIGURATOR_MODEL_DIRS: /a/alpha and /b/alpha are both the "
                                         "model 'alpha'"):
        planning_profiles(ReconfiguratorSettings(model_dirs="/a/alpha,/b/alpha", profile="p.json"))


def test_a_division_is_one_plan_per_node_with_every_models_slots_naming_their_model():
    def inst(node: str, gpu: int) -> Instance:
        return Instance(node, 1, (gpu,))

    placement = ModelPlacement({
        "alpha": PlacementPlan((NodePlan("n1", keep=(inst("n1", 0),), start=(inst("n1", 1),)),
                                NodePlan("n2", keep=(inst("n2", 0),)))),
        "beta": PlacementPlan((NodePlan("n1", stop=(inst("n1", 1),)), NodePlan("n2", start=(inst("n2", 1),)))),
    })
    n1, n2 = wire_model_node_plans(placement)
    assert n1.node == "n1" and n2.node == "n2"
    assert [(s.model, s.gpu_ids) for s in n1.keep] == [("alpha", [0])]
    assert [(s.model, s.gpu_ids) for s in n1.stop] == [("beta", [1])]
    assert [(s.model, s.gpu_ids) for s in n1.start] == [("alpha", [1])]
    assert [(s.model, s.gpu_ids) for s in n2.keep] == [("alpha", [0])] and not n2.stop
    assert [(s.model, s.gpu_ids) for s in n2.start] == [("beta", [1])]
