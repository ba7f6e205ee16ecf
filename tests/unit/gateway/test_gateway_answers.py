"""Good requests: the CompletionRequest the bus receives (defaults filled in), OpenAI-shaped answers,
SSE framing, failure statuses, timeouts, cancellation on disconnect, and the state/health routes."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from starlette.requests import Request

from services.gateway.answers import DONE
from services.gateway.app import ChoiceEvents
from services.gateway.bus import Readiness
from services.gateway.recovery import TrackedEvents
from services.gateway.schemas import CompletionBody
from shared.generation import read_generation_limits
from shared.messages.base import CacheMode, StepKind
from shared.messages.control import WorkerStatus
from shared.messages.events import FailureReason
from shared.state import RequestRecord, RequestStatus, StepRecord
from tests.unit.gateway.gateway_builders import (
    MODEL,
    MODEL_DIR,
    TOKENIZER,
    FakeBus,
    answer_script,
    client,
    data_chunks,
    failure_script,
    heartbeat,
    sse_events,
)

LIMITS = read_generation_limits(MODEL_DIR)
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
REQUEST_ID = re.compile(r"^cmpl-[0-9a-f]{32}$")
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens", "steps", "recompute_steps", "thresholds",
              "instances", "migrations", "latency_ms", "slo_ms", "slo_met"}


def test_completion_submits_a_filled_in_request_and_answers_in_openai_shape():
    test_client, bus = client(min_default_slo_ms=0.0)
    before = time.time()
    response = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "seed": 7, "priority": 2,
                                                         "min_threshold": 0.6, "cache": "prefix"},
                                headers={"traceparent": TRACEPARENT})
    assert response.status_code == 200, response.text
    [sent] = bus.submitted
    assert REQUEST_ID.match(sent.request_id)
    assert sent.prompt_token_ids == TOKENIZER.encode("1+1=")
    assert (sent.gen_length, sent.block_length) == (LIMITS.gen_length, LIMITS.block_length)  # the model's defaults
    assert (sent.max_tokens, sent.ignore_eos) == (None, False)
    assert sent.cache_mode is CacheMode.PREFIX
    assert (sent.seed, sent.priority, sent.min_threshold, sent.stream, sent.model) == (7, 2, 0.6, False, MODEL)
    assert before <= sent.arrival_time <= time.time()
    # 5x the isolated latency of the predictor service's estimate (FakeBus: 2 recompute, 6 cache steps), timed by
    # the profile, not the fallback
    assert 0 < sent.slo_ms < 30_000
    [asked] = bus.predicted
    assert asked.one_shot and asked.thresholds == [0.9] and asked.queries[0].prompt_length == len(sent.prompt_token_ids)
    [headers] = bus.headers  # the caller's trace continues (the gateway's own span, when tracing is on)
    assert headers["traceparent"].split("-")[1] == TRACEPARENT.split("-")[1]

    answer = response.json()
    assert response.headers["x-request-id"] == answer["id"] == sent.request_id
    assert (answer["object"], answer["model"]) == ("text_completion", MODEL)
    assert answer["choices"] == [{"index": 0, "text": "42", "logprobs": None, "finish_reason": "stop"}]
    assert set(answer["usage"]) == USAGE_KEYS
    assert answer["usage"]["total_tokens"] == 6 and answer["usage"]["slo_ms"] == sent.slo_ms
    assert answer["usage"]["instances"] == ["local-0", "local-1"] and answer["usage"]["migrations"] == 1


def test_default_slo_has_a_floor_and_a_fallback():
    test_client, bus = client(min_default_slo_ms=1500.0)
    test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1="})
    assert bus.submitted[-1].slo_ms == 1500.0  # the tiny model's predicted latency is far below the floor
    test_client, bus = client(profile="profiles/missing.json", default_slo_ms=12_345.0)
    test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1="})
    assert bus.submitted[-1].slo_ms == 12_345.0
    down = FakeBus()
    down.predictor_up = False  # the predictor service does not answer: the fixed default
    test_client, bus = client(bus=down, default_slo_ms=23_456.0)
    test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1="})
    assert bus.submitted[-1].slo_ms == 23_456.0
    test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "slo_ms": 800})
    assert bus.submitted[-1].slo_ms == 800


def test_explicit_lengths_and_settings_defaults():
    test_client, bus = client(default_gen_length=12, default_block_length=4)
    test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1="})
    assert (bus.submitted[-1].gen_length, bus.submitted[-1].block_length) == (12, 4)
    test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "max_tokens": 6, "block_length": 4})
    assert (bus.submitted[-1].gen_length, bus.submitted[-1].max_tokens) == (8, 6)  # whole blocks, the cap carried
    test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "max_tokens": 3, "block_length": 32})
    assert (bus.submitted[-1].gen_length, bus.submitted[-1].block_length) == (min(32, LIMITS.max_gen_length),) * 2


def test_max_tokens_is_a_cap_bounded_by_the_model_not_refused():
    test_client, bus = client()
    for max_tokens in (4096, 10**6):
        response = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "max_tokens": max_tokens})
        assert response.status_code == 200, response.text
        assert (bus.submitted[-1].gen_length, bus.submitted[-1].max_tokens) == (LIMITS.max_gen_length, max_tokens)
    test_client, bus = client(max_gen_length=8)  # the operator's cap applies too
    test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "max_tokens": 64})
    assert bus.submitted[-1].gen_length == 8


def test_what_sdks_and_benchmark_clients_send_is_accepted():
    test_client, bus = client()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "2+2="}]}],
            "temperature": 0.0, "top_p": 1.0, "stop": None, "presence_penalty": 0.0, "frequency_penalty": 0,
            "max_completion_tokens": 24, "max_tokens": 999, "logprobs": False, "n": 1, "seed": 3,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "user": "u", "tool_choice": "none"}
    response = test_client.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200, response.text
    sent = bus.submitted[-1]
    assert sent.prompt_token_ids == TOKENIZER.encode("2+2=")  # text parts joined, the template adds nothing
    assert (sent.max_tokens, sent.ignore_eos) == (24, True)  # max_completion_tokens wins over max_tokens
    completion = {"model": MODEL, "prompt": "1+1=", "temperature": 0.0, "best_of": 1, "max_tokens": 16,
                  "logprobs": None, "repetition_penalty": 1.0, "stream_options": {"include_usage": True}}
    assert test_client.post("/v1/completions", json=completion).status_code == 200


@pytest.mark.parametrize("field, value, named", [
    ("presence_penalty", 0.5, "no penalties"), ("frequency_penalty", -1.0, "no penalties"),
    ("repetition_penalty", 1.2, "no penalties"), ("min_p", 0.1, "min_p"), ("echo", True, "prompt"),
    ("suffix", "x", "insertion"), ("min_tokens", 3, "EOS"), ("top_p", 0.0, "greater than 0"),
    ("temperature", 2.5, "less than or equal to 2"), ("n", 17, "less than or equal to 16"),
    ("logprobs", 21, "less than or equal to 20"), ("stop", ["x"] * 17, "at most 16"),
])
def test_values_the_engine_cannot_honour_are_refused_naming_the_field(field, value, named):
    test_client, _ = client()
    response = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", field: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and named in error["message"]


def test_a_non_text_content_part_is_refused_naming_it():
    test_client, _ = client()
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    response = test_client.post("/v1/chat/completions",
                                json={"model": MODEL, "messages": [{"role": "user", "content": [part]}]})
    assert response.status_code == 400
    assert "image_url" in response.json()["error"]["message"]


def test_chat_completion_joins_messages_and_answers_as_chat():
    test_client, bus = client(bus=FakeBus(answer_script("4")))
    messages = [{"role": "system", "content": "add."}, {"role": "user", "content": "2+2="}]
    response = test_client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert response.status_code == 200, response.text
    assert bus.submitted[0].prompt_token_ids == TOKENIZER.encode("add.\n2+2=")
    answer = response.json()
    assert answer["object"] == "chat.completion"
    assert answer["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "4"},
                                  "logprobs": None, "finish_reason": "stop"}]
    assert set(answer["usage"]) == USAGE_KEYS


@pytest.mark.parametrize("stream_options", [None, {}, {"include_usage": False}, {"include_usage": True}])
def test_stream_sends_one_chunk_per_delta_then_usage_only_when_asked_then_done(stream_options):
    test_client, bus = client(bus=FakeBus(answer_script("42", finish_reason="length")))
    body = {"model": MODEL, "prompt": "1+1=", "stream": True}
    if stream_options is not None:
        body["stream_options"] = stream_options
    response = test_client.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert bus.submitted[0].stream
    chunks = data_chunks(response.text)
    assert response.text.endswith(DONE) and chunks[-1] == "[DONE]"
    with_usage = bool(stream_options and stream_options.get("include_usage"))
    answer_chunks = chunks[:-2] if with_usage else chunks[:-1]
    assert [chunk["choices"][0]["text"] for chunk in answer_chunks] == ["4", "2", ""]
    assert all(chunk["id"] == bus.submitted[0].request_id for chunk in chunks[:-1])
    assert [chunk["choices"][0]["finish_reason"] for chunk in answer_chunks] == [None, None, "length"]
    assert all("usage" not in chunk for chunk in answer_chunks)
    if with_usage:  # OpenAI's and vLLM's shape: a last chunk with no choices and the usage
        assert chunks[-2]["choices"] == [] and set(chunks[-2]["usage"]) == USAGE_KEYS
        assert chunks[-2]["usage"]["completion_tokens"] == 2
    assert all(name == "message" for name, _ in sse_events(response.text))  # no progress lines unless asked


def test_stream_progress_lines_show_the_canvas():
    test_client, _ = client()
    body = {"model": MODEL, "prompt": "1+1=", "max_tokens": 4, "block_length": 4, "stream": True,
            "stream_options": {"include_progress": True}}
    response = test_client.post("/v1/completions", json=body)
    progress = [data for name, data in sse_events(response.text) if name == "progress"]
    assert len(progress) == 2
    import json

    first, second = (json.loads(p) for p in progress)
    assert (first["step"], first["threshold"], first["instance_id"]) == (1, 0.9, "local-0")
    assert (first["canvas"], second["canvas"]) == ("4___", "42__")
    assert data_chunks(response.text)[-1] == "[DONE]"


def test_chat_stream_carries_the_role_first():
    test_client, _ = client()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "1+1="}], "stream": True}
    chunks = data_chunks(test_client.post("/v1/chat/completions", json=body).text)
    assert chunks[-1] == "[DONE]"
    assert [c["object"] for c in chunks[:-1]] == ["chat.completion.chunk"] * 3
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [{"role": "assistant", "content": "4"},
                                                               {"content": "2"}, {}]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and "usage" not in chunks[-2]


def test_stream_sends_text_whose_progress_was_lost_before_the_final_chunk():
    def script(request):
        return [event for event in answer_script("123")(request) if getattr(event, "num_steps", 0) != 3]

    test_client, _ = client(bus=FakeBus(script))
    chunks = data_chunks(test_client.post("/v1/completions",
                                          json={"model": MODEL, "prompt": "1+1=", "stream": True}).text)
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["1", "2", "3", ""]


@pytest.mark.parametrize(("reason", "detail", "status", "param", "retry_after"), [
    (FailureReason.DEADLINE_INFEASIBLE, "needs 900 ms, has 100", 429, "slo_ms", True),
    (FailureReason.FLOOR_UNSATISFIABLE, "min_threshold 0.99 above every candidate", 400, "min_threshold", False),
    (FailureReason.INVALID, "prompt (600) plus gen_length (16) exceeds 512 tokens", 400, "max_tokens", False),
    (FailureReason.NO_INSTANCE, "", 503, None, True),
    (FailureReason.CANCELLED, "operator", 409, None, False),
    (FailureReason.WORKER_ERROR, "CUDA error", 500, None, False),
    (FailureReason.INTERNAL, "", 500, None, False),
])
def test_failures_map_to_statuses(reason, detail, status, param, retry_after):
    test_client, bus = client(bus=FakeBus(failure_script(reason, detail)), retry_after_s=3)
    for stream in (False, True):  # a stream refused before its first chunk gets the status too
        response = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "stream": stream})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["param"] == param
        assert bus.submitted[-1].request_id in error["message"]
        assert ("retry-after" in response.headers) == retry_after
        if retry_after:
            assert response.headers["retry-after"] == "3"


def test_failure_after_the_stream_started_is_an_error_chunk_then_done():
    test_client, bus = client(bus=FakeBus(failure_script(FailureReason.WORKER_ERROR, "boom", after_progress=True)))
    response = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "stream": True})
    assert response.status_code == 200
    chunks = data_chunks(response.text)
    assert chunks[0]["choices"][0]["text"] == "4"
    assert chunks[1]["error"]["code"] == "worker_error" and bus.submitted[0].request_id in chunks[1]["error"]["message"]
    assert chunks[2] == "[DONE]"
    assert bus.cancelled == []


def test_timeout_is_504_with_the_request_id_and_cancels_it():
    test_client, bus = client(bus=FakeBus(hang=True), request_timeout_s=0.2)
    response = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1="})
    assert response.status_code == 504
    request_id = bus.submitted[0].request_id
    assert request_id in response.json()["error"]["message"]
    assert bus.cancelled == [(request_id, "timed out")]  # no retry key: no one can join it, no orphan work


async def _no_record(request_id: str):
    return None


def _gateway(bus: FakeBus):
    test_client, _ = client(bus=bus)
    return test_client.app.state.gateway


def test_stream_cancels_the_request_when_the_client_leaves():
    bus = FakeBus(answer_script("4242"))
    gateway = _gateway(bus)

    async def main():
        body = CompletionBody(model=MODEL, prompt="1+1=", stream=True)
        prepared = await gateway.preparer.prepare(body, "cmpl-" + "a" * 32, time.time())
        events = ChoiceEvents([TrackedEvents(bus.submit(prepared.request), prepared.request_id,
                                             _no_record, 10.0)])
        first = await anext(events)
        stream = gateway._stream(prepared, first, events, asyncio.get_running_loop().time() + 10, None)
        assert (await anext(stream)).startswith("data: ")  # the first delta
        await stream.aclose()  # the client went away

    asyncio.run(main())
    assert bus.cancelled == [("cmpl-" + "a" * 32, "client disconnected")]


def test_non_streaming_request_is_cancelled_when_the_client_leaves():
    bus = FakeBus(hang=True)
    gateway = _gateway(bus)

    async def disconnect():
        return {"type": "http.disconnect"}

    async def main():
        request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, disconnect)
        body = CompletionBody(model=MODEL, prompt="1+1=")
        return await gateway.complete(body, request)

    response = asyncio.run(main())
    assert response.status_code == 499
    assert bus.cancelled == [(bus.submitted[0].request_id, "client disconnected")]


def _record(request_id: str, status: RequestStatus) -> RequestRecord:
    canvas = TOKENIZER.encode("42") + [TOKENIZER.eos_token_id] * 2 if status == RequestStatus.FINISHED else \
        TOKENIZER.encode("4") + [TOKENIZER.mask_token_id] * 3
    return RequestRecord(request_id=request_id, status=status, prompt_token_ids=TOKENIZER.encode("1+1="),
                         canvas=canvas, mask_token_id=TOKENIZER.mask_token_id, gen_length=4, block_length=4,
                         num_steps=2, num_committed=4, threshold_history=[0.9, 0.8], arrival_time=100.0,
                         deadline=101.0, slo_ms=1000.0, instance_history=["local-0"], num_recompute_steps=1,
                         model=MODEL, finish_reason="stop" if status == RequestStatus.FINISHED else "",
                         finished_at=100.5 if status == RequestStatus.FINISHED else None)


def test_request_state_route():
    bus = FakeBus()
    steps = [StepRecord(step_index=1, instance_id="local-0", kind=StepKind.RECOMPUTE, block_index=0, threshold=0.9,
                        committed_positions=[0], started_at=100.1, duration_s=0.01)]
    bus.records["cmpl-done"] = (_record("cmpl-done", RequestStatus.FINISHED), steps)
    bus.records["cmpl-running"] = (_record("cmpl-running", RequestStatus.RUNNING), [])
    test_client, _ = client(bus=bus)

    done = test_client.get("/v1/requests/cmpl-done").json()
    assert (done["status"], done["prompt"], done["output"], done["canvas"]) == ("finished", "1+1=", "42", "42")
    assert (done["thresholds"], done["instances"], done["slo_met"], done["finish_reason"]) == (
        [0.9, 0.8], ["local-0"], True, "stop")
    assert done["steps"] == [{"step_index": 1, "instance_id": "local-0", "kind": "recompute", "block_index": 0,
                              "threshold": 0.9, "committed_positions": [0], "batch_size": 1, "loaded_state": False,
                              "started_at": 100.1, "duration_s": 0.01}]
    running = test_client.get("/v1/requests/cmpl-running").json()
    assert (running["status"], running["canvas"], running["output"], running["slo_met"]) == (
        "running", "4___", None, None)
    missing = test_client.get("/v1/requests/cmpl-nope")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "request_id"


def test_models_health_and_readiness():
    bus = FakeBus()
    test_client, _ = client(bus=bus)
    models = test_client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_sequence_length"] == 512
    assert test_client.get("/healthz").status_code == 200

    assert test_client.get("/health").status_code == 200
    ready = test_client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["serving"]
    # no READY worker of this model: the gateway is still ready (it can answer), and says it does not serve
    bus.state = Readiness(True, True, [heartbeat(status=WorkerStatus.DRAINING), heartbeat("other", model="llada")])
    response = test_client.get("/readyz")
    assert response.status_code == 200 and response.json()["missing"] == [] and not response.json()["serving"]
    assert "503" in response.json()["detail"]["worker"]
    bus.state = Readiness(False, False, [], {"nats": "not connected", "redis": "ConnectionError"})
    response = test_client.get("/readyz")
    body = response.json()
    assert response.status_code == 503
    assert body["missing"] == ["nats", "redis"] and body["detail"]["redis"] == "ConnectionError"


def test_without_a_ready_worker_completions_get_503_with_retry_after_at_once():
    bus = FakeBus()
    bus.state = Readiness(True, True, [heartbeat(status=WorkerStatus.DRAINING), heartbeat("other", model="llada")])
    test_client, _ = client(bus=bus)
    response = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "stream": True})
    assert response.status_code == 503 and response.headers["retry-after"] == "2"
    assert response.json()["error"]["code"] == "no_instance" and bus.submitted == []
    bus.ready_workers = lambda: None  # the bus cannot tell yet (just started): the scheduler decides
    assert test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1="}).status_code == 200
    assert len(bus.submitted) == 1
