"""``dls up --pace P --pace-scale S``: the reconfigurator plans with P at S (the step times the paced
workers take), as the gateway's default SLOs do; a ``DLS_RECONFIGURATOR_PROFILE`` of one's own in the
environment is kept, and a ``DLS_RECONFIGURATOR_PROFILE_SCALE`` that disagrees with ``--pace-scale`` on
the pace profile is refused naming both."""

from __future__ import annotations

import pytest

from services.stack import reconfigurator_planning, service_env
from shared.cli import CliError
from tests.unit.test_stack_device import up_args

PACE = "profiles/llada-8b-h100.json"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in ("CUDA_VISIBLE_DEVICES", "DLS_WORKER_DEVICE", "DLS_MODEL_DIRS", "DLS_RECONFIGURATOR_PROFILE",
                 "DLS_RECONFIGURATOR_PROFILE_SCALE"):
        monkeypatch.delenv(name, raising=False)


def env_for(**overrides) -> dict[str, str]:
    return service_env(up_args(**overrides), "nats://n:1", "redis://r:2/0")


def test_the_reconfigurator_plans_with_the_pace_profile_at_the_pace_scale():
    env = env_for(pace=PACE, pace_scale=20.0)
    assert env["DLS_RECONFIGURATOR_PROFILE"] == env["DLS_WORKER_PACE_PROFILE"] == PACE
    assert env["DLS_RECONFIGURATOR_PROFILE_SCALE"] == env["DLS_WORKER_PACE_SCALE"] == "20.0"
    assert env["DLS_GATEWAY_PROFILE_SCALE"] == "20.0"


def test_unpaced_the_environment_stands(monkeypatch):
    assert "DLS_RECONFIGURATOR_PROFILE" not in env_for() and "DLS_RECONFIGURATOR_PROFILE_SCALE" not in env_for()
    monkeypatch.setenv("DLS_RECONFIGURATOR_PROFILE", "/p/own.json")
    monkeypatch.setenv("DLS_RECONFIGURATOR_PROFILE_SCALE", "3")
    env = env_for()
    assert (env["DLS_RECONFIGURATOR_PROFILE"], env["DLS_RECONFIGURATOR_PROFILE_SCALE"]) == ("/p/own.json", "3")


def test_a_profile_of_its_own_is_kept_with_its_own_scale(monkeypatch):
    monkeypatch.setenv("DLS_RECONFIGURATOR_PROFILE", "/p/with-overhead.json")
    env = env_for(pace=PACE, pace_scale=20.0)
    assert env["DLS_RECONFIGURATOR_PROFILE"] == "/p/with-overhead.json"
    assert "DLS_RECONFIGURATOR_PROFILE_SCALE" not in env  # its settings' default, 1
    assert env["DLS_WORKER_PACE_SCALE"] == "20.0"


def test_the_environment_naming_the_pace_profile_at_the_same_scale_is_no_conflict(monkeypatch):
    monkeypatch.setenv("DLS_RECONFIGURATOR_PROFILE", PACE)
    monkeypatch.setenv("DLS_RECONFIGURATOR_PROFILE_SCALE", "20")
    env = env_for(pace=PACE, pace_scale=20.0)
    assert (env["DLS_RECONFIGURATOR_PROFILE"], float(env["DLS_RECONFIGURATOR_PROFILE_SCALE"])) == (PACE, 20.0)


@pytest.mark.parametrize(("environ", "message"), [
    ({"DLS_RECONFIGURATOR_PROFILE_SCALE": "2"},
     "DLS_RECONFIGURATOR_PROFILE_SCALE=2 in the environment and --pace-scale 20"),
    ({"DLS_RECONFIGURATOR_PROFILE": PACE, "DLS_RECONFIGURATOR_PROFILE_SCALE": "1"},
     "DLS_RECONFIGURATOR_PROFILE_SCALE=1 in the environment and --pace-scale 20"),
    ({"DLS_RECONFIGURATOR_PROFILE_SCALE": "fast"}, "DLS_RECONFIGURATOR_PROFILE_SCALE=fast .* not a number"),
])
def test_a_scale_that_disagrees_on_the_pace_profile_is_refused_naming_both(environ, message):
    with pytest.raises(CliError, match=message):
        reconfigurator_planning(PACE, 20.0, environ)
