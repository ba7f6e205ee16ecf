"""The official ``openai`` package, unmodified, against ``dls up``: OpenAI's API as clients use it.

One stack (``dls up --workers 2 --policy fixed``: every step at the threshold 0.9, so greedy answers are
the engine's own) serves the module, its services' metrics on free ports:

* completions; chat with string content and with text parts (the same answer as the completion);
* streaming with ``stream_options.include_usage`` on (a last chunk with no choices and the usage) and
  off (no usage anywhere);
* ``logprobs`` (completions and chat shapes), ``stop`` (answers and streams), ``n=2`` with a
  temperature, ``seed`` reproducibility; errors as the SDK's exception types;
* the request bodies vLLM's benchmark client sends, parsed as it parses them;
* a client that times out and retries three times costs the work of one request, counted by the
  request-steps the workers ran (``dls_tokens_per_forward_count``);
* ``/metrics`` of the gateway, the scheduler and a worker carry the serving histograms with ``model_name``.

Answers are compared with each other, never with the bundled model's exact text (the model can be
retrained), except through ``check_answer``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import openai  # a dev dependency (pyproject.toml)
import pytest

from shared.runtime import free_port_range
from shared.tasks import Family, Split, TaskGenerator, check_answer
from tests.integration.conftest import dls_up

pytestmark = pytest.mark.integration

MODEL = "dls-tiny"
NUM_METRICS_PORTS = 8  # scheduler, predictor, reconfigurator, node agent, then the workers' (dls up's layout)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """``dls up`` on free ports; yields (gateway URL, metrics base port, its pid)."""
    metrics = free_port_range(NUM_METRICS_PORTS)
    env = {"DLS_METRICS_PORT": str(metrics),
           "DLS_WORKER_LEASE_TTL_S": "20",  # the retry and queue tests pause the workers for a few seconds
           "DLS_GATEWAY_SSE_KEEPALIVE_S": "1"}  # so every stream here may carry keep-alives
    with dls_up(tmp_path_factory.mktemp("stack"), "--policy", "fixed", env=env) as running:
        yield running.url, metrics, running.pid


@pytest.fixture(scope="module")
def sdk(stack):
    return openai.OpenAI(base_url=f"{stack[0]}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def problems():
    tasks = TaskGenerator(seed=5151)
    return {family: [tasks.problem(n % 3, Split.HELD_OUT, family) for n in range(4)]
            for family in (Family.ADD, Family.WORDS)}


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_completions_and_chat_with_string_content_and_with_parts(sdk, problems):
    for problem in problems[Family.ADD][:2] + problems[Family.WORDS][:2]:
        completion = sdk.completions.create(model=MODEL, prompt=problem.prompt, max_tokens=64)
        text = completion.choices[0].text
        assert completion.object == "text_completion" and completion.choices[0].finish_reason == "stop"
        assert completion.usage.completion_tokens >= len(text) > 0
        chat = sdk.chat.completions.create(model=MODEL, messages=_user(problem.prompt), max_completion_tokens=64)
        parts = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": problem.prompt}]}],
            max_tokens=64, temperature=0.0, top_p=1.0, presence_penalty=0.0, stop=None)
        assert chat.choices[0].message.content == parts.choices[0].message.content == text
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].logprobs is None


@pytest.mark.parametrize("include_usage", [True, False, None])
def test_streams_with_include_usage_on_and_off(sdk, problems, include_usage):
    problem = problems[Family.WORDS][0]
    whole = sdk.completions.create(model=MODEL, prompt=problem.prompt).choices[0].text
    options = {} if include_usage is None else {"stream_options": {"include_usage": include_usage}}
    for kind in ("completions", "chat"):
        if kind == "chat":
            chunks = list(sdk.chat.completions.create(model=MODEL, messages=_user(problem.prompt), stream=True,
                                                      **options))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            chunks = list(sdk.completions.create(model=MODEL, prompt=problem.prompt, stream=True, **options))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole, kind
        with_usage = [c for c in chunks if c.usage is not None]
        if include_usage:
            assert with_usage == [chunks[-1]] and chunks[-1].choices == []
            assert chunks[-1].usage.completion_tokens > 0 and chunks[-1].usage.prompt_tokens > 0
            assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "stop"
        else:
            assert with_usage == [] and chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_are_the_probabilities_tokens_were_committed_with(sdk, problems):
    problem = problems[Family.WORDS][1]
    completion = sdk.completions.create(model=MODEL, prompt=problem.prompt, logprobs=3).choices[0]
    logprobs = completion.logprobs
    assert "".join(logprobs.tokens) == completion.text and len(logprobs.token_logprobs) == len(logprobs.tokens)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert value <= 0.0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(value) and top[token] == pytest.approx(value)  # greedy: the top
    chat = sdk.chat.completions.create(model=MODEL, messages=_user(problem.prompt), logprobs=True,
                                       top_logprobs=2).choices[0]
    content = chat.logprobs.content
    assert "".join(c.token for c in content) == chat.message.content == completion.text
    assert all(c.top_logprobs[0].token == c.token and c.bytes == list(c.token.encode()) for c in content)
    plain = sdk.chat.completions.create(model=MODEL, messages=_user(problem.prompt), logprobs=True).choices[0]
    assert [c.logprob for c in plain.logprobs.content] == pytest.approx([c.logprob for c in content])
    assert all(c.top_logprobs == [] for c in plain.logprobs.content)


def test_stop_ends_the_answer_before_the_stop_string_streams_included(sdk, problems):
    problem = max(problems[Family.WORDS], key=lambda p: len(p.answer))
    whole = sdk.completions.create(model=MODEL, prompt=problem.prompt).choices[0].text
    assert len(whole) >= 4, whole
    stop = whole[2:4]
    cut = whole[: whole.index(stop)]
    completion = sdk.completions.create(model=MODEL, prompt=problem.prompt, stop=[stop, "@@"]).choices[0]
    assert (completion.text, completion.finish_reason) == (cut, "stop")
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=_user(problem.prompt), stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_samples_with_a_temperature_and_seeds_reproduce_them(sdk, problems):
    problem = problems[Family.WORDS][2]
    kwargs = dict(model=MODEL, prompt=problem.prompt, n=2, temperature=1.2, top_p=0.95, seed=1234,
                  extra_body={"top_k": 20})  # vLLM's extension, sent as clients send it
    first = sdk.completions.create(**kwargs)
    again = sdk.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    one = sdk.completions.create(**{**kwargs, "n": 1})
    assert one.choices[0].text == first.choices[0].text  # choice 0 of n keeps the seed as given
    chat = sdk.chat.completions.create(model=MODEL, messages=_user(problem.prompt), n=2, temperature=1.2, seed=99)
    chat_again = sdk.chat.completions.create(model=MODEL, messages=_user(problem.prompt), n=2, temperature=1.2,
                                             seed=99)
    assert [c.message.content for c in chat.choices] == [c.message.content for c in chat_again.choices]
    assert chat.usage.completion_tokens >= sum(len(c.message.content) for c in chat.choices)  # both counted
    best = sdk.completions.create(model=MODEL, prompt=problem.prompt, best_of=2, temperature=1.0)
    assert len(best.choices) == 2


def test_errors_are_the_sdk_s_exception_types_naming_the_field(sdk, problems):
    prompt = problems[Family.ADD][0].prompt
    with pytest.raises(openai.BadRequestError) as penalty:
        sdk.completions.create(model=MODEL, prompt=prompt, presence_penalty=1.0)
    assert "presence_penalty" in str(penalty.value) and penalty.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as top:
        sdk.chat.completions.create(model=MODEL, messages=_user(prompt), top_logprobs=2)
    assert top.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as image:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert "image_url" in str(image.value)
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="gpt-4o", prompt=prompt)
    keyed = {"Idempotency-Key": f"reuse-{time.time_ns()}"}
    sdk.completions.create(model=MODEL, prompt=prompt, extra_headers=keyed)
    with pytest.raises(openai.UnprocessableEntityError) as reused:
        sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=3, extra_headers=keyed)
    assert reused.value.body["param"] == "Idempotency-Key"


def test_the_bodies_vllm_benchmark_client_sends(stack, problems):
    """As vLLM's ``benchmarks/backend_request_func.py`` builds and parses them: the text from chunks with
    choices, the output length from the usage chunk (which has none)."""
    url = stack[0]
    problem = problems[Family.ADD][1]

    def stream(path: str, body: dict) -> tuple[str, int]:
        text, output_tokens = "", None
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=120,
                          headers={"Authorization": "Bearer unused"}) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                chunk = line.removeprefix("data: ")
                if not line.startswith("data: ") or chunk == "[DONE]":
                    continue
                data = json.loads(chunk)
                if choices := data.get("choices"):
                    text += choices[0].get("text") or choices[0].get("delta", {}).get("content") or ""
                elif usage := data.get("usage"):
                    output_tokens = usage.get("completion_tokens")
        assert output_tokens is not None and output_tokens >= len(text)
        return text, output_tokens

    completion = {"model": MODEL, "prompt": problem.prompt, "temperature": 0.0, "repetition_penalty": 1.0,
                  "max_tokens": 16, "logprobs": None, "stream": True, "stream_options": {"include_usage": True}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": problem.prompt}]}],
            "temperature": 0.0, "max_completion_tokens": 16, "stream": True,
            "stream_options": {"include_usage": True}}
    texts = [stream("/v1/completions", completion)[0], stream("/v1/chat/completions", chat)[0]]
    assert texts[0] == texts[1]
    assert check_answer(problem, texts[0]) == check_answer(problem, texts[1])
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        text, output_tokens = stream(path, {**body, "ignore_eos": True})
        assert text == texts[0] and output_tokens == 16  # the whole cap decoded; EOS padding renders as nothing


def _scrape(url: str) -> str:
    return httpx.get(url, timeout=10).text


def _sum(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _worker_steps(metrics: int) -> float:
    """Request-steps the workers ran: one ``dls_tokens_per_forward`` observation each (the node agent's
    /metrics carries its workers' series)."""
    return _sum(_scrape(f"http://127.0.0.1:{metrics + 3}/metrics"), "dls_tokens_per_forward_count")


def _wait_idle(metrics: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = _scrape(f"http://127.0.0.1:{metrics}/metrics")
        if _sum(text, "dls_num_requests_running") + _sum(text, "dls_num_requests_waiting") == 0:
            return
        time.sleep(0.3)
    raise AssertionError("the scheduler still holds requests")


def _worker_pids(stack_pid: int) -> list[int]:
    """The stack's worker processes: the descendants of its ``dls up`` running ``services.worker``."""
    parent_of, cmdline_of = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline_of[int(entry.name)] = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        parent_of[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parent_of.get(pid, 0)
            if pid == stack_pid:
                return True
        return False

    pids = [pid for pid, cmd in cmdline_of.items() if b"services.worker" in cmd and descends(pid)]
    assert len(pids) == 2, pids
    return pids


def test_a_client_that_times_out_and_retries_three_times_costs_one_request(stack, problems):
    """The workers are paused (SIGSTOP) while the SDK sends the request, so every attempt times out
    whatever this machine's speed: four attempts, the SDK's own three retries. Resumed, the cluster
    runs the request once; the client, asking again as its retry would, gets that answer."""
    url, metrics, stack_pid = stack
    _wait_idle(metrics)
    before = _worker_steps(metrics)
    body = dict(model=MODEL, prompt=problems[Family.WORDS][3].prompt, max_tokens=512, extra_body={"ignore_eos": True})
    impatient = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=3, timeout=0.1)
    pids = _worker_pids(stack_pid)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(**body)  # 4 attempts; retries 2-4 join the first, none starts work
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    patient = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    raw = patient.completions.with_raw_response.create(**body, extra_headers={"x-stainless-retry-count": "4"})
    answer = raw.parse()
    assert raw.headers.get("idempotent-replayed") == "true"  # joined the running request
    assert answer.choices[0].finish_reason == "length" and answer.usage.steps > 0
    _wait_idle(metrics)
    time.sleep(1.0)  # a duplicate's step would have been reported by now
    assert _worker_steps(metrics) - before == answer.usage.steps  # the request-steps of one request
    gateway = _scrape(f"{url}/metrics")
    assert _sum(gateway, "dls_gateway_idempotent_joins_total") >= 4  # three retries and the patient ask


def test_a_stream_queued_longer_than_the_clients_read_timeout_gets_its_answer(stack, sdk, problems):
    """The workers are paused (SIGSTOP) for 6 s while the official SDK streams a request with a 3 s read
    timeout: the gateway opens the stream a keep-alive period after the scheduler accepted it and
    keeps it alive, so the client neither times out nor sees anything but the answer it gets unpaused."""
    url, metrics, stack_pid = stack
    problem = problems[Family.ADD][0]
    expected = sdk.completions.create(model=MODEL, prompt=problem.prompt).choices[0].text
    _wait_idle(metrics)
    # The SDK's own Timeout: it names whichever HTTP library this release of the SDK is built on
    # (httpx in 1.x, httpx2 in 3.x), and a Timeout of another library is refused.
    strict = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                           timeout=openai.Timeout(120.0, read=3.0))
    pids = _worker_pids(stack_pid)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(6.0, lambda: [os.kill(pid, signal.SIGCONT) for pid in pids])
    resume.start()
    try:
        started = time.monotonic()
        chunks = list(strict.completions.create(model=MODEL, prompt=problem.prompt, stream=True))
        waited = time.monotonic() - started
    finally:
        resume.cancel()
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert waited > 5.0, f"the workers were paused, yet the answer came in {waited:.1f} s"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_metrics_of_the_gateway_scheduler_and_a_worker_carry_model_name(stack, sdk, problems):
    url, metrics, _ = stack
    # an answer of several blocks, so that the inter-token histograms have a sample whatever ran before
    problem = max(problems[Family.WORDS], key=lambda p: len(p.answer))
    chunks = list(sdk.completions.create(model=MODEL, prompt=problem.prompt, stream=True))
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 2, chunks
    label = f'model_name="{MODEL}"'
    gateway = _scrape(f"{url}/metrics")
    scheduler = _scrape(f"http://127.0.0.1:{metrics}/metrics")
    worker = _scrape(f"http://127.0.0.1:{metrics + 4}/metrics")
    expected = {
        "gateway": (gateway, ["dls_gateway_time_to_first_token_seconds", "dls_gateway_inter_token_latency_seconds",
                              "dls_gateway_e2e_request_latency_seconds"]),
        "scheduler": (scheduler, ["dls_time_to_first_token_seconds", "dls_inter_token_latency_seconds",
                                  "dls_request_time_per_output_token_seconds", "dls_e2e_request_latency_seconds"]),
        "worker": (worker, ["dls_tokens_per_forward"]),
    }
    for service, (text, names) in expected.items():
        for name in names:
            assert re.search(rf"^{name}_bucket{{[^}}]*{label}[^}}]*}} ", text, re.M), (service, name)
            assert re.search(rf"^# TYPE {name} histogram$", text, re.M), (service, name)
    for name in ("dls_prompt_tokens_total", "dls_generation_tokens_total"):
        assert re.search(rf"^{name}{{{label}}} [1-9]", scheduler, re.M), name
    for name in ("dls_num_requests_running", "dls_num_requests_waiting"):
        assert re.search(rf"^{name}{{{label}}} ", scheduler, re.M), name
