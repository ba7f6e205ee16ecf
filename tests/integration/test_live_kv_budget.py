"""KV memory on the real stack (``dls up``: gateway, scheduler, two workers, NATS, Redis): a budget so
small that three long-prompt requests fill an instance, and forty of them sent at once with the
official ``openai`` SDK. Every one completes with the answer the engine gives offline, or gets a
429/503 with Retry-After; no worker restarts; no heartbeat ever reports more KV than the budget, no
worker refuses a step for memory (the scheduler placed nothing beyond it); and once the burst is
over the pools report 0 bytes used, and give their memory back."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import nats
import openai
import pytest

from services.worker.engine.engine import DLMEngine
from shared.messages import codec
from shared.messages.control import WorkerHeartbeat
from shared.runtime import free_port
from shared.subjects import DEFAULT_PREFIX, Subjects
from shared.tasks import Family, Split, TaskGenerator
from tests.integration.conftest import dls_up

pytestmark = pytest.mark.integration

MODEL = "dls-tiny"
MODEL_DIR = "models/dls-tiny"
NUM_REQUESTS = 40
MAX_TOKENS = 16  # a 16-token canvas
NUM_SHOTS = 8  # prompts of about 110 tokens: about 8 times the canvas
MAX_BATCH = 16  # the workers' default
PAGE_TOKENS = 16  # the CPU engine's KV page


@pytest.fixture(scope="module")
def problems():
    tasks = TaskGenerator(seed=2727)
    return [tasks.problem(NUM_SHOTS, Split.HELD_OUT, Family.ADD) for _ in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def offline(problems):
    """What the engine answers on its own, at the fixed policy's threshold and the served canvas."""
    engine = DLMEngine.from_pretrained(MODEL_DIR)
    contexts = [len(engine.encode(p.prompt)) + MAX_TOKENS for p in problems]
    answers = [engine.generate(p.prompt, threshold=0.9, max_tokens=MAX_TOKENS).text for p in problems]
    return answers, contexts, engine.kv_memory().bytes_per_token


def _budget_bytes(contexts: list[int], bytes_per_token: int) -> int:
    """A per-GPU budget whose schedulable tokens (less one page's rounding per request of a full batch)
    hold three of the longest requests and not four."""
    longest = max(contexts)
    tokens = int(3.5 * longest) + MAX_BATCH * (PAGE_TOKENS - 1)
    return tokens * bytes_per_token


async def _watch_heartbeats(nats_url: str, beats: list[WorkerHeartbeat], stop: asyncio.Event) -> None:
    nc = await nats.connect(nats_url)
    try:
        async def on_beat(msg):
            beats.append(codec.decode(WorkerHeartbeat, msg.data))

        await nc.subscribe(Subjects(DEFAULT_PREFIX).heartbeat, cb=on_beat)
        await stop.wait()
    finally:
        await nc.close()


async def _burst(url: str, problems) -> list:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(problem):
        try:
            return await client.completions.create(model=MODEL, prompt=problem.prompt, max_tokens=MAX_TOKENS)
        except openai.APIStatusError as exc:
            return exc

    try:
        return await asyncio.gather(*(one(p) for p in problems))
    finally:
        await client.close()


def _refused(metrics_text: str) -> float:
    found = re.findall(r"^dls_worker_kv_refused_total\{[^}]*\} ([0-9.e+]+)$", metrics_text, re.MULTILINE)
    return sum(float(v) for v in found)


def test_forty_long_prompts_against_a_three_request_budget_lose_nothing(tmp_path, problems, offline):
    answers, contexts, bytes_per_token = offline
    budget = _budget_bytes(contexts, bytes_per_token)
    nats_url = f"nats://127.0.0.1:{free_port()}"
    env = {"DLS_NATS_URL": nats_url, "DLS_WORKER_KV_BUDGET_BYTES": str(budget),
           "DLS_WORKER_HEARTBEAT_INTERVAL_S": "0.25"}  # beats often enough to see the burst
    with dls_up(tmp_path, "--policy", "fixed", env=env) as stack:
        async def main():
            beats: list[WorkerHeartbeat] = []
            stop = asyncio.Event()
            watcher = asyncio.create_task(_watch_heartbeats(nats_url, beats, stop))
            await asyncio.sleep(0.5)
            replies = await _burst(stack.url, problems)
            done_at = time.monotonic()
            # the pools drain: every instance's latest heartbeat says nothing is held, within seconds
            while time.monotonic() - done_at < 15:
                latest = {b.instance_id: b for b in beats}
                if len(latest) == 2 and all(b.kv is not None and b.kv.used_bytes == 0 for b in latest.values()):
                    fresh = [b for b in beats if b.sent_at >= time.time() - 1.0]  # sent after the burst
                    if fresh:
                        break
                await asyncio.sleep(0.2)
            drained_s = time.monotonic() - done_at
            stop.set()
            await watcher
            return replies, beats, drained_s

        replies, beats, drained_s = asyncio.run(main())
        metrics_ports = {b.instance_id: b.metrics_port for b in beats if b.metrics_port}
        refused = sum(_refused(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)
                      for port in metrics_ports.values())

    completed = [(i, r) for i, r in enumerate(replies) if not isinstance(r, Exception)]
    print(f"{len(completed)} completed, {NUM_REQUESTS - len(completed)} turned away; {len(beats)} heartbeats, "
          f"most KV held {max((b.kv.used_bytes for b in beats if b.kv), default=0)} of {budget} bytes; "
          f"drained {drained_s:.1f} s after the last reply")
    turned_away = [r for r in replies if isinstance(r, Exception)]
    for error in turned_away:  # told to come back, never a failure
        assert error.status_code in (429, 503), error
        assert error.response.headers.get("retry-after"), error
    assert len(completed) + len(turned_away) == NUM_REQUESTS
    assert len(completed) >= NUM_REQUESTS // 2, [str(e) for e in turned_away]
    assert len({r.id for _, r in completed}) == len(completed)  # one answer each, none twice
    for i, reply in completed:
        assert reply.choices[0].text == answers[i], f"request {i}"

    instances = {b.instance_id for b in beats}
    assert len(instances) == 2
    for iid in instances:  # no worker restarted (a restart changes started_at)
        assert len({b.started_at for b in beats if b.instance_id == iid}) == 1
    with_kv = [b for b in beats if b.kv is not None]
    assert with_kv and all(b.kv.budget_bytes and b.kv.budget_bytes <= budget for b in with_kv)
    assert all(b.kv.used_bytes <= b.kv.budget_bytes and b.kv.pool_bytes <= b.kv.budget_bytes for b in with_kv)
    assert max(b.kv.used_bytes for b in with_kv) > 0  # the burst did hold memory
    capacity = with_kv[0].kv.capacity_tokens
    assert 3 * max(contexts) <= capacity < 4 * max(contexts)  # three requests fill an instance
    assert refused == 0  # the scheduler never sent a step beyond a budget
    latest = {b.instance_id: b for b in beats}
    assert all(b.kv.used_bytes == 0 and b.kv.pool_bytes == 0 for b in latest.values()), drained_s
    assert drained_s < 10
