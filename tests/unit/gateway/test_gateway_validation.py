"""Bad requests are refused with OpenAI's error shape, the offending field named, before anything is
submitted; API keys are enforced on /v1/*."""

from __future__ import annotations

import pytest

from shared.messages import codec
from shared.messages.intake import CompletionRequest
from tests.unit.gateway.gateway_builders import MODEL, client

GOOD = {"model": MODEL, "prompt": "1+1="}


def post(body: dict | None = None, raw: bytes | None = None, path: str = "/v1/completions", headers=None, **settings):
    test_client, bus = client(**settings)
    if raw is not None:
        response = test_client.post(path, content=raw, headers={"content-type": "application/json", **(headers or {})})
    else:
        response = test_client.post(path, json=body, headers=headers)
    return response, bus


def assert_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    if param is not None:
        assert param in error["message"]
    return error


@pytest.mark.parametrize(("changes", "param"), [
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"logprobs": -1}, "logprobs"),
    ({"best_of": 2, "n": 3}, "best_of"),  # best_of is n: every sample is returned
    ({"stop": [1]}, "stop"),
    ({"prompt": "1" * 500, "max_tokens": 16}, "prompt"),  # over the model's 512-token context
    ({"slo_ms": -5}, "slo_ms"),
    ({"slo_ms": 0}, "slo_ms"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"max_tokens": 8.5}, "max_tokens"),  # not an integer (8.0 is 8)
    ({"cache": "full"}, "cache"),
    ({"min_threshold": 1.5}, "min_threshold"),
    ({"min_threshold": -0.1}, "min_threshold"),
    ({"temperature": -0.1}, "temperature"),
    ({"n": 0}, "n"),
    ({"block_length": 0}, "block_length"),
    ({"priority": "high"}, "priority"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["1+1=", "2+2="]}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": "WHAT IS 1+1"}, "prompt"),  # upper case is not in the character vocabulary
    ({"stream_options": {"include_progress": True, "colour": "red"}}, "stream_options.colour"),
])
def test_bad_completion_fields_are_400_naming_the_field(changes, param):
    response, bus = post({**GOOD, **changes})
    assert_error(response, 400, param)
    assert bus.submitted == []


def test_missing_model_and_unknown_model():
    body = dict(GOOD)
    del body["model"]
    response, _ = post(body)
    assert_error(response, 400, "model")
    response, bus = post({**GOOD, "model": "llada-8b"})
    error = assert_error(response, 404, "model")
    assert error["code"] == "model_not_found" and bus.submitted == []


def test_context_limit_names_both_lengths():
    response, _ = post({**GOOD, "prompt": "1" * 500, "max_tokens": 16})
    error = assert_error(response, 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    assert "500" in error["message"] and "512" in error["message"]


@pytest.mark.parametrize("raw", [b'{"model": "dls-tiny", "prompt": ', b"not json", b"[]", b'"a string"', b""])
def test_malformed_or_non_object_bodies_are_400(raw):
    response, bus = post(raw=raw)
    assert_error(response, 400, None)
    assert bus.submitted == []


def test_body_over_the_byte_limit_is_400():
    response, bus = post({**GOOD, "prompt": "1" * 5000}, max_request_bytes=2000)
    error = assert_error(response, 400, None)
    assert error["code"] == "body_too_large" and bus.submitted == []


def test_harmless_openai_fields_are_accepted():
    response, bus = post({**GOOD, "n": 1, "temperature": 0, "user": "someone", "prompt": ["1+1="],
                          "stream_options": {"include_usage": True}})
    assert response.status_code == 200, response.text
    assert len(bus.submitted) == 1


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"),
    ([{"role": "robot", "content": "hi"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": "hi", "mood": "good"}], "messages[0].mood"),
    ([{"role": "user", "content": "hi"}] * 3, "messages"),  # over max_messages=2
    ([{"role": "user", "content": "HI"}], "messages"),  # not encodable
])
def test_bad_chat_messages_are_400(messages, param):
    response, bus = post({"model": MODEL, "messages": messages}, path="/v1/chat/completions", max_messages=2)
    assert_error(response, 400, param)
    assert bus.submitted == []


def test_api_keys_are_required_on_v1_when_configured():
    keys = {"api_keys": ["secret-1", "secret-2"]}
    response, bus = post(GOOD, **keys)
    assert_error(response, 401, None)
    response, _ = post(GOOD, headers={"Authorization": "Bearer wrong"}, **keys)
    assert_error(response, 401, None)
    response, _ = post(GOOD, headers={"Authorization": "Basic secret-1"}, **keys)
    assert_error(response, 401, None)
    response, _ = post(raw=b"{not json", **keys)  # refused before the body is even parsed
    assert_error(response, 401, None)
    assert bus.submitted == []
    response, bus = post(GOOD, headers={"Authorization": "Bearer secret-2"}, **keys)
    assert response.status_code == 200 and len(bus.submitted) == 1


def test_health_is_open_and_models_are_protected_when_keys_are_set():
    test_client, _ = client(api_keys=["k"])
    assert test_client.get("/healthz").status_code == 200
    assert test_client.get("/v1/models").status_code == 401
    assert test_client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200


def test_unknown_route_has_the_error_shape():
    test_client, _ = client()
    response = test_client.get("/v1/nothing-here")
    assert response.status_code == 404 and "error" in response.json()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("cache", ["dual", "none"])
def test_block_length_1_on_a_long_canvas_is_400_naming_it(path, cache):
    body = {"model": MODEL, "max_tokens": 128, "block_length": 1, "cache": cache}
    body.update({"prompt": "1+1="} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "1+1="}]})
    response, bus = post(body, path=path)
    error = assert_error(response, 400, "block_length")
    assert error["code"] == "block_length_too_small" and "DLS_GATEWAY_MIN_BLOCK_LENGTH" in error["message"]
    assert bus.submitted == []
    response, bus = post({**body, "block_length": 4}, path=path)  # the floor itself is served
    assert response.status_code == 200, response.text
    assert bus.submitted[0].block_length == 4


def test_a_canvas_of_more_blocks_than_the_cap_is_400_saying_the_smallest_block_that_fits():
    response, bus = post({**GOOD, "max_tokens": 128, "block_length": 8}, max_blocks=8)
    error = assert_error(response, 400, "block_length")
    assert error["code"] == "too_many_blocks"
    assert "16 blocks" in error["message"] and "at least 16" in error["message"]
    assert bus.submitted == []
    response, bus = post({**GOOD, "max_tokens": 128, "block_length": 16}, max_blocks=8)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("role", ["user", "system", "developer"])
def test_content_null_outside_an_assistant_turn_is_400_naming_the_field(role):
    messages = [{"role": role, "content": None}, {"role": "user", "content": "1+1="}]
    if role == "user":
        messages = [{"role": "user", "content": None}]
    response, bus = post({"model": MODEL, "messages": messages}, path="/v1/chat/completions")
    error = assert_error(response, 400, "messages[0].content")
    assert "null" in error["message"] and bus.submitted == []


def test_an_assistant_turn_with_null_content_is_accepted():
    messages = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": None},
                {"role": "user", "content": "2+2="}]
    response, bus = post({"model": MODEL, "messages": messages}, path="/v1/chat/completions")
    assert response.status_code == 200, response.text


def test_cache_none_on_a_canvas_past_the_recompute_cap_is_400_naming_cache():
    response, bus = post({**GOOD, "max_tokens": 128, "cache": "none"}, max_recompute_steps=64)
    error = assert_error(response, 400, "cache")
    assert error["code"] == "too_many_recompute_steps" and "DLS_GATEWAY_MAX_RECOMPUTE_STEPS" in error["message"]
    assert bus.submitted == []
    response, bus = post({**GOOD, "max_tokens": 128, "cache": "dual"}, max_recompute_steps=64)  # 16 blocks
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "top_k"])
def test_a_cap_past_the_wires_integers_is_served_as_no_cap(field):
    response, bus = post({**GOOD, field: 10**30})
    assert response.status_code == 200, response.text
    request = bus.submitted[0]
    assert max(request.max_tokens or 0, request.top_k) < 2**63
    assert codec_round_trip(request) == request  # fits msgpack (a 10**30 would raise OverflowError)


def codec_round_trip(request: CompletionRequest) -> CompletionRequest:
    return codec.decode(CompletionRequest, codec.encode(request))
