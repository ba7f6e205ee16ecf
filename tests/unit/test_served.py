"""The served models' one home (``shared.served``): a model's name is its directory's basename, two
directories of one name are refused naming the setting and both, and ``DLS_CALIBRATION_DIR`` is the first
model's calibration alone; every model-serving service's settings give the same list."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from shared.served import DuplicateModelName, ServedModelDir, model_name, served_models, served_models_of
from shared.settings import (
    GatewaySettings,
    NodeAgentSettings,
    PredictorSettings,
    ReconfiguratorSettings,
    SchedulerSettings,
)

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "dls-tiny"


def test_a_model_is_named_by_its_directorys_basename():
    assert model_name("/models/llada-8b") == "llada-8b"
    assert model_name("models/dream/") == "dream"  # a trailing slash names nothing else
    assert model_name(Path("relative/m")) == "m"
    assert model_name(".") == Path.cwd().name  # no basename: the directory it resolves to
    assert [m.name for m in served_models(["/a/x", "b/y", "z"])] == ["x", "y", "z"]  # the settings' order


def test_two_directories_of_one_name_are_refused_naming_the_setting_and_both():
    with pytest.raises(DuplicateModelName, match=r"^DLS_SCHEDULER_MODEL_DIRS: /a/m and /b/m are both the model 'm' "
                                                 r"\(a model's name is its directory's basename\): rename one$") as err:
        served_models(["/a/m", "/c/n", "/b/m"], setting="DLS_SCHEDULER_MODEL_DIRS")
    assert isinstance(err.value, ValueError)  # what the services raised before
    assert (err.value.setting, err.value.name, err.value.directories) == ("DLS_SCHEDULER_MODEL_DIRS", "m",
                                                                          ("/a/m", "/b/m"))
    with pytest.raises(DuplicateModelName, match="^DLS_MODEL_DIRS: m and m are both"):  # the default setting
        served_models(["m", "m"])


def test_the_calibration_override_is_the_first_models_alone():
    assert served_models(["/a/x", "/b/y", "/c/z"], "/cal") == [
        ServedModelDir("x", "/a/x", "/cal"), ServedModelDir("y", "/b/y", ""), ServedModelDir("z", "/c/z", "")]
    assert served_models(["/a/x"], Path("/cal")) == [ServedModelDir("x", "/a/x", "/cal")]
    assert served_models(["/a/x", "/b/y"]) == [ServedModelDir("x", "/a/x"), ServedModelDir("y", "/b/y")]


def test_each_model_finds_its_own_calibration(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    for copy in (first, second):  # the bundled weights without their bundle: uncalibrated unless told where it is
        shutil.copytree(BUNDLED, copy, ignore=shutil.ignore_patterns("calibration", "replay", "MODEL_CARD.md"))
    served = served_models([str(first), str(second)], str(BUNDLED / "calibration"))
    assert served[0].calibration() is not None and served[0].calibration().directory == BUNDLED / "calibration"
    assert served[1].calibration() is None  # the override is not the second model's
    assert served_models([str(BUNDLED)])[0].calibration().directory == BUNDLED / "calibration"  # inside it


@pytest.mark.parametrize("settings_class", [GatewaySettings, SchedulerSettings, PredictorSettings,
                                            ReconfiguratorSettings, NodeAgentSettings])
def test_every_services_settings_give_the_same_models(settings_class, monkeypatch):
    for name in list(os.environ):
        if name.startswith("DLS_") and name.endswith(("MODEL_DIR", "MODEL_DIRS", "CALIBRATION_DIR")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("DLS_MODEL_DIRS", "/m/a, /n/b")
    monkeypatch.setenv("DLS_CALIBRATION_DIR", "/cal/a")
    assert served_models_of(settings_class(), "X") == [ServedModelDir("a", "/m/a", "/cal/a"),
                                                       ServedModelDir("b", "/n/b", "")]
    monkeypatch.delenv("DLS_MODEL_DIRS")
    monkeypatch.setenv("DLS_MODEL_DIR", "/m/only")  # no list: the one model_dir
    assert served_models_of(settings_class(), "X") == [ServedModelDir("only", "/m/only", "/cal/a")]
