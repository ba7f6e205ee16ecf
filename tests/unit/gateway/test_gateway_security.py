"""API keys, request ownership, admission and answers recovered from Redis, on the in-process app
with the fake bus (the Redis-backed rate limit: tests/integration/test_gateway_security.py)."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.gateway.recovery import event_from_record
from services.gateway.security import key_hash
from shared.messages.events import FailureReason, RequestFailed, RequestFinished
from shared.state import RequestRecord, RequestStatus
from tests.unit.gateway.gateway_builders import TOKENIZER, FakeBus, client, settings

BODY = {"model": "dls-tiny", "prompt": "12+30=", "max_tokens": 8}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _record(request_id: str, owner: str = "", status: RequestStatus = RequestStatus.FINISHED,
            text: str = "42") -> RequestRecord:
    canvas = TOKENIZER.encode(text) + [TOKENIZER.eos_token_id] * 2
    return RequestRecord(request_id=request_id, version=3, status=status, prompt_token_ids=TOKENIZER.encode("12+30="),
                         canvas=canvas, mask_token_id=TOKENIZER.mask_token_id, gen_length=len(canvas),
                         block_length=len(canvas), num_steps=2, num_committed=len(canvas), arrival_time=time.time() - 1,
                         deadline=time.time() + 10, slo_ms=10_000, finished_at=time.time(), finish_reason="stop",
                         owner=owner, detail="" if status == RequestStatus.FINISHED else "cancelled by client")


def test_without_a_valid_key_every_path_but_the_health_checks_is_401():
    app, _ = client(api_keys=["key-a"])
    for path in ("/v1/models", "/v1/requests/x", "/docs", "/openapi.json"):
        assert app.get(path).status_code == 401, path
        assert app.get(path, headers=_auth("wrong")).status_code == 401, path
    assert app.post("/v1/completions", json=BODY).status_code == 401
    assert app.get("/healthz").status_code == 200
    assert app.get("/readyz").status_code == 200
    assert app.get("/v1/models", headers=_auth("key-a")).status_code == 200


def test_a_request_remembers_the_hash_of_its_key_never_the_key():
    app, bus = client(api_keys=["key-a", "key-b"])
    reply = app.post("/v1/completions", json=BODY, headers=_auth("key-b"))
    assert reply.status_code == 200
    assert bus.submitted[0].owner == key_hash("key-b")
    assert "key-b" not in bus.submitted[0].owner


def test_a_requests_state_is_404_with_another_keys_token():
    app, bus = client(api_keys=["key-a", "key-b"])
    bus.records["cmpl-1"] = (_record("cmpl-1", owner=key_hash("key-a")), [])
    assert app.get("/v1/requests/cmpl-1", headers=_auth("key-a")).status_code == 200
    other = app.get("/v1/requests/cmpl-1", headers=_auth("key-b"))
    assert other.status_code == 404 and other.json()["error"]["param"] == "request_id"
    assert app.get("/v1/requests/cmpl-1").status_code == 401


def test_without_keys_requests_are_open_and_ownerless():
    app, bus = client()
    assert app.post("/v1/completions", json=BODY).status_code == 200
    assert bus.submitted[0].owner == ""
    bus.records["cmpl-2"] = (_record("cmpl-2"), [])
    assert app.get("/v1/requests/cmpl-2").status_code == 200


def test_admission_is_bounded_429_with_retry_after_and_frees_its_slots():
    app, bus = client(max_in_flight=1, retry_after_s=3)
    gateway = app.app.state.gateway
    gateway.admission.in_flight = 1  # one request held open
    full = app.post("/v1/completions", json=BODY)
    assert full.status_code == 429 and full.headers["Retry-After"] == "3"
    assert full.json()["error"]["code"] == "overloaded"
    gateway.admission.in_flight = 0
    for _ in range(3):  # each answered request gives its slot back
        assert app.post("/v1/completions", json=BODY).status_code == 200
    assert app.post("/v1/completions", json={**BODY, "max_tokens": 0}).status_code == 400
    assert gateway.admission.in_flight == 0


class _RecordingLimiter:
    def __init__(self, limit: int) -> None:
        self.limit, self.seen = limit, []

    async def check(self, identity: str) -> None:
        from services.gateway.errors import ApiError

        self.seen.append(identity)
        if self.seen.count(identity) > self.limit:
            raise ApiError(429, "rate limit", None, "rate_limit_exceeded", headers={"Retry-After": "60"})


def test_the_rate_limit_counts_per_key():
    limiter = _RecordingLimiter(limit=1)
    app = TestClient(create_app(settings(api_keys=["key-a", "key-b"]), bus=FakeBus(), rate_limiter=limiter))
    assert app.post("/v1/completions", json=BODY, headers=_auth("key-a")).status_code == 200
    over = app.post("/v1/completions", json=BODY, headers=_auth("key-a"))
    assert over.status_code == 429 and over.headers["Retry-After"] == "60"
    assert app.post("/v1/completions", json=BODY, headers=_auth("key-b")).status_code == 200
    assert limiter.seen == [key_hash("key-a"), key_hash("key-a"), key_hash("key-b")]


def test_a_lost_final_event_is_answered_from_the_stored_state():
    """The worker stored FINISHED and died before publishing RequestFinished: the gateway hears
    nothing more, looks the request up in Redis and answers from it."""
    bus = FakeBus(hang=True)
    app, _ = client(bus, result_poll_s=0.05)

    original = bus.load_request

    async def load(request_id):
        if request_id not in bus.records:
            bus.records[request_id] = (_record(request_id, text="42"), [])
        return await original(request_id)

    bus.load_request = load
    reply = app.post("/v1/completions", json=BODY)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == "42"
    assert app.app.state.gateway.admission.in_flight == 0


def test_event_from_record_stands_for_the_terminal_event():
    from services.gateway.models import load_served_model
    from tests.unit.gateway.gateway_builders import MODEL_DIR

    codec = load_served_model(str(MODEL_DIR)).codec
    finished = event_from_record(_record("r", text="42"), codec)
    assert isinstance(finished, RequestFinished) and finished.text == "42" and finished.usage.completion_tokens == 2
    cancelled = event_from_record(_record("r", status=RequestStatus.CANCELLED), codec)
    assert isinstance(cancelled, RequestFailed) and cancelled.reason == FailureReason.CANCELLED
    running = _record("r", status=RequestStatus.RUNNING)
    assert event_from_record(running, codec) is None


def test_dashboard_page_shells_are_open_but_their_data_needs_a_key():
    from services.gateway.edge import is_open

    assert is_open("/dashboard") and is_open("/requests/cmpl-1") and is_open("/static/dashboard/dashboard.js")
    assert is_open("/health") and is_open("/healthz") and is_open("/readyz")
    assert not is_open("/v1/cluster") and not is_open("/v1/requests/cmpl-1/timeline")
    assert not is_open("/v1/completions") and not is_open("/metrics") and not is_open("/openapi.json")
