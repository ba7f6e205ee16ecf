"""OpenAI's API the way clients use it, against ``FakeBus``: sampling fields on the wire, ``n`` choices,
``logprobs`` shapes, ``stop``, usage chunks, keep-alives, retries that join the request they retry,
cancellation when a client leaves, the serving metrics."""

from __future__ import annotations

import asyncio
import math

import pytest

from services.gateway.prepare import choice_seed
from shared.messages.events import FailureReason, RequestAccepted, RequestFinished, TokenLogprobs
from tests.unit.gateway.gateway_builders import (
    MODEL,
    TOKENIZER,
    FakeBus,
    answer_script,
    client,
    data_chunks,
    failure_script,
    progress,
    usage,
)

PROBS = {"4": 0.9, "2": 0.5}  # the scripted answer's tokens and the probabilities they were committed with


def logprob_script(text: str = "42", top: int = 2):
    """``answer_script`` with TokenLogprobs: each token's probability, the token itself first among its top."""
    def logprobs(chars: str) -> TokenLogprobs:
        ids = TOKENIZER.encode(chars)
        return TokenLogprobs(probs=[PROBS[c] for c in chars], top_token_ids=[[i, TOKENIZER.encode("7")[0]][:top]
                                                                             for i in ids] if top else [],
                             top_probs=[[PROBS[c], 0.05][:top] for c in chars] if top else [])

    def script(request):
        events = [RequestAccepted(request_id=request.request_id, seq=1, prompt_tokens=4, deadline=request.deadline)]
        if request.stream:
            for i, char in enumerate(text):
                event = progress(request, i + 1, [i], char, delta=char)
                events.append(event.__class__(**{**{f: getattr(event, f) for f in event.__struct_fields__},
                                                 "delta_token_ids": TOKENIZER.encode(char),
                                                 "logprobs": logprobs(char)}))
        events.append(RequestFinished(request_id=request.request_id, seq=len(text) + 2, text=text,
                                      token_ids=TOKENIZER.encode(text), usage=usage(4, len(text), len(text)),
                                      logprobs=logprobs(text)))
        return events

    return script


def test_sampling_fields_and_stop_strings_reach_the_request():
    test_client, bus = client()
    body = {"model": MODEL, "prompt": "1+1=", "temperature": 0.8, "top_p": 0.9, "top_k": -1, "seed": 11,
            "stop": ["\n", "", "\n", "=="], "logprobs": 2}
    assert test_client.post("/v1/completions", json=body).status_code == 200
    [sent] = bus.submitted
    assert (sent.temperature, sent.top_p, sent.top_k, sent.seed) == (0.8, 0.9, 0, 11)
    assert sent.stop == ["\n", "=="] and sent.logprobs == 2  # empty strings and repeats dropped
    test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "stop": "=="})
    greedy = bus.submitted[-1]
    assert (greedy.temperature, greedy.top_p, greedy.top_k, greedy.logprobs, greedy.stop) == (0.0, 1.0, 0, None, ["=="])


@pytest.mark.parametrize("field", ["n", "best_of"])
def test_n_choices_are_n_requests_with_their_own_ids_and_seeds(field):
    test_client, bus = client()
    response = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", field: 3,
                                                         "temperature": 1.0, "seed": 5})
    assert response.status_code == 200, response.text
    answer = response.json()
    ids = [r.request_id for r in bus.submitted]
    assert ids == [f"{answer['id']}-{i}" for i in range(3)] and response.headers["x-request-id"] == answer["id"]
    assert [r.seed for r in bus.submitted] == [5, choice_seed(5, 1), choice_seed(5, 2)]
    assert len({r.seed for r in bus.submitted}) == 3
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["text"] == "42" for c in answer["choices"])
    assert answer["usage"]["prompt_tokens"] == 4 and answer["usage"]["completion_tokens"] == 6  # prompt counted once
    assert answer["usage"]["steps"] == 6


def test_one_choice_keeps_the_request_id_and_best_of_must_equal_n():
    test_client, bus = client()
    answer = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "n": 1}).json()
    assert bus.submitted[0].request_id == answer["id"]
    response = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "n": 2, "best_of": 3})
    assert response.status_code == 400 and response.json()["error"]["param"] == "best_of"


def test_n_choices_stream_interleaved_with_their_indexes_and_one_usage_chunk():
    test_client, bus = client()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "1+1="}], "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = data_chunks(test_client.post("/v1/chat/completions", json=body).text)
    assert chunks[-1] == "[DONE]" and chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == 4
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-2] if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant" and all("role" not in c["delta"] for c in mine[1:])
        assert "".join(c["delta"].get("content", "") for c in mine) == "42"
        assert [c["finish_reason"] for c in mine][-1] == "stop"
    assert all("usage" not in c for c in chunks[:-2])


def test_completion_logprobs_in_openai_s_shape():
    test_client, _ = client(bus=FakeBus(logprob_script()))
    answer = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "logprobs": 2}).json()
    logprobs = answer["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["4", "2"] and logprobs["text_offset"] == [0, 1]
    assert logprobs["token_logprobs"] == pytest.approx([math.log(0.9), math.log(0.5)])
    assert logprobs["top_logprobs"] == [pytest.approx({"4": math.log(0.9), "7": math.log(0.05)}),
                                        pytest.approx({"2": math.log(0.5), "7": math.log(0.05)})]
    zero = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "logprobs": 0}).json()
    assert zero["choices"][0]["logprobs"]["top_logprobs"] is None
    plain = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1="}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_chat_logprobs_in_openai_s_shape_and_top_logprobs_needs_logprobs():
    test_client, _ = client(bus=FakeBus(logprob_script()))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "1+1="}], "logprobs": True, "top_logprobs": 2}
    content = test_client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["4", "2"] and content[0]["bytes"] == [ord("4")]
    assert content[0]["logprob"] == pytest.approx(math.log(0.9))
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["2", "7"]
    refused = test_client.post("/v1/chat/completions", json={**body, "logprobs": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"


def test_streamed_logprobs_ride_on_each_text_chunk():
    test_client, _ = client(bus=FakeBus(logprob_script()))
    body = {"model": MODEL, "prompt": "1+1=", "logprobs": 1, "stream": True}
    chunks = [c for c in data_chunks(test_client.post("/v1/completions", json=body).text)[:-1]
              if c["choices"][0]["text"]]
    assert [c["choices"][0]["logprobs"]["tokens"] for c in chunks] == [["4"], ["2"]]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [[0], [1]]


def test_quiet_streams_get_keep_alive_comments():
    def slow_script(request):
        return answer_script("42")(request)

    class SlowBus(FakeBus):
        async def submit(self, request, headers=None):
            self.submitted.append(request)
            for event in slow_script(request):
                await asyncio.sleep(0.3)
                yield event

    test_client, _ = client(bus=SlowBus(), sse_keepalive_s=0.05)
    text = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "stream": True}).text
    assert ": keep-alive\n\n" in text and text.endswith("data: [DONE]\n\n")
    quiet, _ = client(bus=SlowBus(), sse_keepalive_s=0)
    assert ": keep-alive" not in quiet.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=",
                                                                     "stream": True}).text


def test_a_request_queued_after_admission_gets_its_stream_opened_with_keep_alives():
    """Accepted, then queued behind others: the stream opens once it has waited ``sse_keepalive_s`` and
    sends keep-alives until the first step (bytes flow, so proxies and client read timeouts keep it);
    a failure after that comes in-band, while one right after admission is still a plain status."""
    def queued(script, wait_s):
        class QueuedBus(FakeBus):
            async def submit(self, request, headers=None):
                self.submitted.append(request)
                events = script(request)
                yield events[0]  # RequestAccepted
                await asyncio.sleep(wait_s)  # in the scheduler's queue
                for event in events[1:]:
                    yield event
        return QueuedBus()

    body = {"model": MODEL, "prompt": "1+1=", "stream": True}
    test_client, _ = client(bus=queued(answer_script("42"), 0.4), sse_keepalive_s=0.05)
    reply = test_client.post("/v1/completions", json=body)
    assert reply.status_code == 200 and reply.text.startswith(": keep-alive\n\n")
    assert "".join(c["choices"][0]["text"] for c in data_chunks(reply.text)[:-1]) == "42"
    failed, _ = client(bus=queued(failure_script(FailureReason.DEADLINE_INFEASIBLE, "too late"), 0.4), sse_keepalive_s=0.05)
    reply = failed.post("/v1/completions", json=body)
    assert reply.status_code == 200 and reply.text.startswith(": keep-alive\n\n")
    assert '"error"' in reply.text and reply.text.endswith("data: [DONE]\n\n")
    refused, _ = client(bus=queued(failure_script(FailureReason.DEADLINE_INFEASIBLE, "too late"), 0.0), sse_keepalive_s=5.0)
    assert refused.post("/v1/completions", json=body).status_code == 429


def test_a_retry_with_the_same_idempotency_key_joins_the_running_request():
    bus = FakeBus(hang=True)
    test_client, _ = client(bus=bus, request_timeout_s=0.2)
    with test_client:  # one event loop for every call: the waiting request outlives the first call
        _join_after_a_timeout(test_client, bus)


def _join_after_a_timeout(test_client, bus: FakeBus) -> None:
    body = {"model": MODEL, "prompt": "1+1="}
    first = test_client.post("/v1/completions", json=body, headers={"Idempotency-Key": "abc"})
    assert first.status_code == 504 and bus.cancelled == []  # kept for a retry (DLS_GATEWAY_RETRY_GRACE_S)
    bus.hang = False
    retry = test_client.post("/v1/completions", json=body, headers={"Idempotency-Key": "abc"})
    assert retry.status_code == 200 and retry.headers["idempotent-replayed"] == "true"
    assert len(bus.submitted) == 1 and [r.request_id for r in bus.followed] == [bus.submitted[0].request_id]
    assert retry.json()["id"] == bus.submitted[0].request_id
    other = test_client.post("/v1/completions", json={**body, "max_tokens": 4}, headers={"Idempotency-Key": "abc"})
    assert other.status_code == 422 and other.json()["error"]["param"] == "Idempotency-Key"
    fresh = test_client.post("/v1/completions", json=body, headers={"Idempotency-Key": "def"})
    assert fresh.status_code == 200 and len(bus.submitted) == 2
    assert test_client.get("/metrics").text.count("dls_gateway_idempotent_joins_total 1.0") == 1


def test_the_sdk_s_retries_join_and_its_first_attempts_do_not():
    bus = FakeBus()
    test_client, _ = client(bus=bus)
    body = {"model": MODEL, "prompt": "1+1="}
    first = {"x-stainless-retry-count": "0"}
    assert test_client.post("/v1/completions", json=body, headers=first).status_code == 200
    assert test_client.post("/v1/completions", json=body, headers=first).status_code == 200  # sent afresh
    assert len(bus.submitted) == 2 and bus.followed == []
    retry = test_client.post("/v1/completions", json=body, headers={"x-stainless-retry-count": "1"})
    assert retry.status_code == 200 and len(bus.submitted) == 2
    assert [r.request_id for r in bus.followed] == [bus.submitted[0].request_id]
    changed = test_client.post("/v1/completions", json={**body, "seed": 1}, headers={"x-stainless-retry-count": "1"})
    assert changed.status_code == 200 and len(bus.submitted) == 3  # another body: another request


def test_a_request_nobody_retries_is_cancelled_after_the_grace():
    bus = FakeBus(hang=True)
    test_client, _ = client(bus=bus, request_timeout_s=0.1, retry_grace_s=0.2)
    with test_client:
        _cancelled_after_the_grace(test_client, bus)


def _cancelled_after_the_grace(test_client, bus: FakeBus) -> None:
    response = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1="},
                                headers={"Idempotency-Key": "k"})
    assert response.status_code == 504

    async def wait():
        for _ in range(100):
            if bus.cancelled:
                return
            await asyncio.sleep(0.05)

    test_client.portal.call(wait)
    rid = bus.submitted[0].request_id
    assert [r for r, _ in bus.cancelled] == [rid] and "no retry joined" in bus.cancelled[0][1]
    retry = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1="},
                             headers={"Idempotency-Key": "k"})
    assert retry.status_code == 504 and len(bus.submitted) == 2  # the key was dropped: new work


def test_a_bad_idempotency_key_is_400():
    test_client, bus = client()
    response = test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1="},
                                headers={"Idempotency-Key": "x" * 300})
    assert response.status_code == 400 and response.json()["error"]["param"] == "Idempotency-Key"
    assert bus.submitted == []


def test_gateway_serving_metrics_carry_the_model_name():
    test_client, _ = client()
    test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "stream": True})
    test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1="})
    text = test_client.get("/metrics").text
    for name in ("dls_gateway_time_to_first_token_seconds", "dls_gateway_inter_token_latency_seconds",
                 "dls_gateway_e2e_request_latency_seconds"):
        assert f'{name}_count{{model_name="{MODEL}"}}' in text, name
    assert f'dls_gateway_e2e_request_latency_seconds_count{{model_name="{MODEL}"}} 2.0' in text


def test_an_answer_recovered_from_redis_keeps_its_stop_cut_and_logprobs():
    import msgspec

    from services.gateway.answers import request_info
    from services.gateway.models import load_served_model
    from services.gateway.recovery import event_from_record
    from tests.unit.gateway.gateway_builders import MODEL_DIR
    from tests.unit.gateway.test_gateway_security import _record

    codec = load_served_model(str(MODEL_DIR)).codec
    record = msgspec.structs.replace(_record("r", text="4242"), stop=["24"], stop_length=1, logprobs=1,
                                     confidences=[0.9, 0.8, 0.7, 0.6, 1.0, 1.0],
                                     top_token_ids=[[7, 8]] * 6, top_probs=[[0.9, 0.1]] * 6)
    finished = event_from_record(record, codec)
    assert (finished.text, finished.token_ids) == ("4", TOKENIZER.encode("4"))  # ended before "24"
    assert finished.logprobs.probs == [0.9] and finished.logprobs.top_token_ids == [[7, 8]]
    assert request_info(record, [], codec).output == "4"
    plain = event_from_record(_record("r", text="42"), codec)
    assert plain.logprobs is None  # not asked for
