"""Scale from zero at the gateway (``DLS_GATEWAY_COLD_START_TIMEOUT_S``): a request for a served model with
no READY instance, while another served model's worker is READY, is admitted and waits for its model's
first instance (its wait in ``X-DLS-Cold-Start-Ms`` and ``dls_gateway_cold_start_seconds``); past the bound
it is cancelled with a 503 naming the model and the wait. With no READY worker at all, or cold starts
off, it is a 503 at once, as before."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from services.gateway.app import COLD_START_HEADER
from services.gateway.bus import Readiness

from .gateway_builders import MODEL, MODEL_DIR, FakeBus, client, data_chunks, heartbeat

TWIN = "dls-twin"


class ColdBus(FakeBus):
    """FAKE: ``TWIN`` is scaled to zero. A request of it is queued (no event) until an instance of it is
    READY; with ``starts_instance`` one is, once such a request was submitted (as the reconfigurator
    starts one on its arrival)."""

    def __init__(self, starts_instance: bool = True) -> None:
        super().__init__()
        self.starts_instance = starts_instance
        self.state = Readiness(True, True, [heartbeat("a-0", model=MODEL)])

    def ready_workers(self):
        ready = super().ready_workers()
        if self.starts_instance and any(r.model == TWIN for r in self.submitted):
            ready.append(heartbeat("twin-0", model=TWIN))
        return ready

    async def submit(self, request, headers=None):
        self.submitted.append(request)
        self.headers.append(headers)
        while not any(hb.model == request.model for hb in self.ready_workers()):
            await asyncio.sleep(0.01)  # queued at the scheduler: no instance of its model yet
        for event in self.script(request):
            yield event


@pytest.fixture
def twin_dir(tmp_path):
    target = tmp_path / TWIN
    shutil.copytree(MODEL_DIR, target, ignore=shutil.ignore_patterns("calibration", "replay"))
    return target


def cold_client(twin_dir, bus: ColdBus, **overrides):
    return client(bus=bus, model_dirs=f"{MODEL_DIR},{twin_dir}", **overrides)[0]


def test_a_request_for_a_model_at_zero_waits_for_its_first_instance_and_reports_the_wait(twin_dir):
    bus = ColdBus()
    test_client = cold_client(twin_dir, bus)
    response = test_client.post("/v1/completions", json={"model": TWIN, "prompt": "@b=", "max_tokens": 8})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "42" and response.json()["model"] == TWIN
    assert int(response.headers[COLD_START_HEADER]) >= 0
    streamed = test_client.post("/v1/completions", json={"model": TWIN, "prompt": "@b=", "max_tokens": 8,
                                                         "stream": True})
    assert streamed.status_code == 200 and COLD_START_HEADER not in streamed.headers  # an instance is up now
    assert data_chunks(streamed.text)[-1] == "[DONE]"
    served = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "@b=", "max_tokens": 8})
    assert served.status_code == 200 and COLD_START_HEADER not in served.headers
    metrics = test_client.get("/metrics").text
    assert f'dls_gateway_cold_start_seconds_count{{model_name="{TWIN}",outcome="served"}} 1.0' in metrics


def test_a_streamed_request_opens_its_stream_once_the_instance_is_up_with_the_wait(twin_dir):
    test_client = cold_client(twin_dir, ColdBus())
    response = test_client.post("/v1/completions", json={"model": TWIN, "prompt": "@b=", "max_tokens": 8,
                                                         "stream": True})
    assert response.status_code == 200 and int(response.headers[COLD_START_HEADER]) >= 0
    assert "".join(c["choices"][0]["text"] for c in data_chunks(response.text)[:-1] if c["choices"]) == "42"


def test_past_the_bound_the_request_is_cancelled_with_a_503_naming_the_model_and_the_wait(twin_dir):
    bus = ColdBus(starts_instance=False)  # the reconfigurator never starts one
    test_client = cold_client(twin_dir, bus, cold_start_timeout_s=0.3, retry_grace_s=0)
    response = test_client.post("/v1/completions", json={"model": TWIN, "prompt": "@b="})
    error = response.json()["error"]
    assert response.status_code == 503 and error["code"] == "cold_start_timeout", error
    assert TWIN in error["message"] and "0.3 s" in error["message"]
    assert "DLS_GATEWAY_COLD_START_TIMEOUT_S" in error["message"] and response.headers["Retry-After"]
    [submitted] = bus.submitted
    assert [rid for rid, _ in bus.cancelled] == [submitted.request_id]  # no orphan waits in the queue
    metrics = test_client.get("/metrics").text
    assert f'dls_gateway_cold_start_seconds_count{{model_name="{TWIN}",outcome="timed_out"}} 1.0' in metrics


def test_with_no_ready_worker_at_all_it_is_a_503_at_once(twin_dir):
    bus = ColdBus()
    bus.state = Readiness(True, True, [heartbeat("a-0", model=MODEL, status=heartbeat().status.STARTING)])
    test_client = cold_client(twin_dir, bus)
    for model in (TWIN, MODEL):
        response = test_client.post("/v1/completions", json={"model": model, "prompt": "@b="})
        error = response.json()["error"]
        assert response.status_code == 503 and error["code"] == "no_instance", error
        assert model in error["message"] and "not serving" in error["message"] and response.headers["Retry-After"]
    assert bus.submitted == []


def test_with_cold_starts_off_a_model_at_zero_is_a_503_at_once_naming_the_setting(twin_dir):
    bus = ColdBus()
    test_client = cold_client(twin_dir, bus, cold_start_timeout_s=0)
    response = test_client.post("/v1/completions", json={"model": TWIN, "prompt": "@b="})
    assert response.status_code == 503 and "DLS_GATEWAY_COLD_START_TIMEOUT_S" in response.json()["error"]["message"]
    assert bus.submitted == []
