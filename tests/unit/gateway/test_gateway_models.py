"""Several models behind one gateway (``DLS_GATEWAY_MODEL_DIRS``): each listed with its state, each
request served by the model it names with that model's defaults, an unknown one a 404 naming it and
listing those served, and a model without a live instance refused on its own."""

from __future__ import annotations

import shutil

import pytest
from pydantic import ValidationError

from services.gateway.bus import Readiness
from services.gateway.models import ModelLoadError
from shared.messages.control import WorkerStatus
from shared.settings import GatewaySettings

from .gateway_builders import MODEL, MODEL_DIR, FakeBus, client, heartbeat


@pytest.fixture
def second_model(tmp_path):
    """The bundled model again under another name (its calibration dropped: a second, uncalibrated model)."""
    target = tmp_path / "dls-second"
    shutil.copytree(MODEL_DIR, target, ignore=shutil.ignore_patterns("calibration", "replay"))
    return target


def live(bus: FakeBus, *workers) -> None:
    bus.state = Readiness(True, True, list(workers))


def two_models(second, **overrides):
    bus = FakeBus()
    live(bus, heartbeat("a-0", model=MODEL), heartbeat("b-0", model="dls-second", status=WorkerStatus.STARTING))
    return client(bus=bus, model_dirs=f"{MODEL_DIR},{second}", **overrides)


def test_every_served_model_is_listed_with_its_state_and_calibration(second_model):
    test_client, bus = two_models(second_model)
    cards = {c["id"]: c for c in test_client.get("/v1/models").json()["data"]}
    assert set(cards) == {MODEL, "dls-second"}
    assert cards[MODEL]["state"] == "serving" and cards[MODEL]["calibration"]["calibrated"]
    assert cards["dls-second"]["state"] == "starting" and not cards["dls-second"]["calibration"]["calibrated"]
    live(bus, heartbeat("a-0", model=MODEL))
    cards = {c["id"]: c for c in test_client.get("/v1/models").json()["data"]}
    assert cards["dls-second"]["state"] == "scaled_to_zero"


def test_a_request_goes_to_the_model_it_names_and_an_unknown_one_is_a_404_listing_those_served(second_model):
    test_client, bus = two_models(second_model)
    live(bus, *bus.state.workers, heartbeat("b-1", model="dls-second"))
    for name in (MODEL, "dls-second"):
        response = test_client.post("/v1/completions", json={"model": name, "prompt": "@b=", "max_tokens": 8})
        assert response.status_code == 200, response.text
        assert bus.submitted[-1].model == name and response.json()["model"] == name
    response = test_client.post("/v1/completions", json={"model": "llada-8b", "prompt": "@b="})
    error = response.json()["error"]
    assert response.status_code == 404 and error["code"] == "model_not_found"
    assert "llada-8b" in error["message"] and MODEL in error["message"] and "dls-second" in error["message"]


def test_a_model_without_a_ready_instance_is_refused_and_the_other_still_served(second_model):
    # cold starts off: a model without a READY instance is refused at once (with them: test_gateway_cold_start)
    test_client, bus = two_models(second_model, cold_start_timeout_s=0)  # dls-second only starting
    response = test_client.post("/v1/completions", json={"model": "dls-second", "prompt": "@b="})
    assert response.status_code == 503 and "dls-second" in response.json()["error"]["message"]
    assert response.headers["Retry-After"]
    assert test_client.post("/v1/completions", json={"model": MODEL, "prompt": "@b="}).status_code == 200


def test_a_default_slo_can_be_set_per_model(second_model):
    test_client, bus = two_models(second_model, model_slo_ms="dls-second=1234")
    live(bus, *bus.state.workers, heartbeat("b-1", model="dls-second"))
    test_client.post("/v1/completions", json={"model": "dls-second", "prompt": "@b=", "max_tokens": 8})
    test_client.post("/v1/completions", json={"model": MODEL, "prompt": "@b=", "max_tokens": 8})
    second, first = bus.submitted
    assert second.slo_ms == 1234 and first.slo_ms != 1234  # the first is timed with its own profile


def test_bad_model_settings_name_the_setting(second_model, tmp_path):
    with pytest.raises(ModelLoadError, match="DLS_GATEWAY_MODEL_SLO_MS names other"):
        two_models(second_model, model_slo_ms="other=100")
    with pytest.raises(ValidationError, match="DLS_GATEWAY_MODEL_SLO_MS"):
        GatewaySettings(model_slo_ms="dls-second=fast")
    same_name = tmp_path / "elsewhere" / MODEL
    shutil.copytree(MODEL_DIR, same_name)
    with pytest.raises(ModelLoadError, match="DLS_GATEWAY_MODEL_DIRS"):
        client(model_dirs=f"{MODEL_DIR},{same_name}")
