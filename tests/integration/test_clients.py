"""``max_tokens`` as clients send it, against ``dls up``: a cap, never a change of the answer.

One stack (``dls up --workers 2 --policy fixed``: every step at the default threshold 0.9, so answers are
the engine's own) serves the whole module over a real HTTP port:

* held-out sums and word prompts are answered as the engine answers them at its default canvas, for
  ``max_tokens`` omitted, 16, 32, 64, 128 and 512, through completions and chat (string content and
  text parts): accuracy within 2 points of the engine's own;
* a cap shorter than the answer cuts it (its first tokens) with ``finish_reason: "length"``;
* the official ``openai`` package, unmodified, with ``max_tokens`` left out, small and large, and chat
  content sent as parts (``tests/integration/test_openai_api.py`` covers the rest of the API).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.worker.engine.engine import DLMEngine
from shared.tasks import Family, Split, TaskGenerator, check_answer
from tests.integration.conftest import dls_up

pytestmark = pytest.mark.integration

MODEL = "dls-tiny"
MODEL_DIR = "models/dls-tiny"
MAX_TOKENS = (None, 16, 32, 64, 128, 512)
NUM_PER_FAMILY = 12


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """``dls up`` on free ports; yields its URL."""
    with dls_up(tmp_path_factory.mktemp("stack"), "--policy", "fixed") as running:
        yield running.url


@pytest.fixture(scope="module")
def problems():
    tasks = TaskGenerator(seed=4242)
    return [tasks.problem(n % 4, Split.HELD_OUT, family) for family in (Family.ADD, Family.WORDS)
            for n in range(NUM_PER_FAMILY)]


@pytest.fixture(scope="module")
def engine_accuracy(problems):
    """The engine's own accuracy on the problems: default canvas, threshold 0.9, as a request without
    max_tokens is served."""
    engine = DLMEngine.from_pretrained(MODEL_DIR)
    return sum(check_answer(p, engine.generate(p.prompt, threshold=0.9).text) for p in problems) / len(problems)


def _post_all(url: str, path: str, bodies: list[dict]) -> list[dict]:
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            replies = await asyncio.gather(*(client.post(path, json=body) for body in bodies))
        for reply in replies:
            assert reply.status_code == 200, reply.text
        return [reply.json() for reply in replies]

    return asyncio.run(main())


def _with_cap(body: dict, max_tokens: int | None) -> dict:
    return body if max_tokens is None else {**body, "max_tokens": max_tokens}


@pytest.mark.parametrize("max_tokens", MAX_TOKENS)
def test_max_tokens_never_changes_an_answer_that_fits(stack, problems, engine_accuracy, max_tokens):
    completions = _post_all(stack, "/v1/completions", [
        _with_cap({"model": MODEL, "prompt": p.prompt}, max_tokens) for p in problems])
    chats = _post_all(stack, "/v1/chat/completions", [
        _with_cap({"model": MODEL, "messages": [{"role": "user", "content": p.prompt}]}, max_tokens)
        for p in problems[::2]] + [
        _with_cap({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": p.prompt}]}]},
                  max_tokens) for p in problems[1::2]])
    texts = [c["choices"][0]["text"] for c in completions]
    chat_texts = [None] * len(problems)
    chat_texts[::2] = [c["choices"][0]["message"]["content"] for c in chats[: len(problems[::2])]]
    chat_texts[1::2] = [c["choices"][0]["message"]["content"] for c in chats[len(problems[::2]):]]
    for answers in (texts, chat_texts):
        accuracy = sum(check_answer(p, t) for p, t in zip(problems, answers, strict=True)) / len(problems)
        assert accuracy >= engine_accuracy - 0.02, (max_tokens, list(zip([p.prompt for p in problems], answers, strict=True)))
    assert all(c["choices"][0]["finish_reason"] == "stop" for c in completions + chats)


def test_a_cap_shorter_than_the_answer_cuts_it_with_finish_reason_length(stack):
    problem = TaskGenerator(seed=7).problem(0, Split.HELD_OUT, Family.WORDS)
    [full, cut] = _post_all(stack, "/v1/completions", [
        {"model": MODEL, "prompt": problem.prompt},
        {"model": MODEL, "prompt": problem.prompt, "max_tokens": 5}])
    assert full["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["text"] == full["choices"][0]["text"][:5]
    assert cut["usage"]["completion_tokens"] == 5


def test_the_official_openai_sdk_with_max_tokens_left_out_small_and_large(stack, problems):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{stack}/v1", api_key="unused", max_retries=0)
    sums = [p for p in problems if p.family is Family.ADD][:3]
    for cap in (None, 8, 4096):
        kwargs = {} if cap is None else {"max_tokens": cap}
        completion = client.completions.create(model=MODEL, prompt=sums[0].prompt, **kwargs)
        assert completion.choices[0].text == sums[0].answer and completion.choices[0].finish_reason == "stop"
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": sums[1].prompt}], **kwargs)
        assert chat.choices[0].message.content == sums[1].answer
        parts = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": sums[2].prompt}]}], **kwargs)
        assert parts.choices[0].message.content == sums[2].answer


def test_loadgen_reads_the_step_timelines_of_the_requests_it_sent(stack):
    """``dls loadgen --timelines``: the ids its results carry name the stored timelines, whose
    consecutive steps give the control-plane time per step the simulator is told."""
    from loadgen.driver import poisson_plan, run_plan
    from loadgen.timelines import fetch_timelines, step_gaps

    plan = poisson_plan(20.0, 0.5, slo_ms=60_000.0, max_tokens=16, seed=3, family=Family.WORDS)
    for stream in (False, True):
        results = asyncio.run(run_plan(stack, plan, cache="dual", stream=stream))
        assert all(r.finished for r in results), [r.error for r in results]
        timelines = asyncio.run(fetch_timelines(stack, [r.request_id for r in results]))
        assert len(timelines) == len(results)
        assert all(len(t["steps"]) == r.usage["steps"] for t, r in zip(timelines, results, strict=True))
        gaps = step_gaps(timelines)
        assert gaps["num_gaps"] > 0 and 0 <= gaps["p50_ms"] < 1000 and gaps["mean_forward_ms"] > 0
