"""The gateway over real NATS (JetStream intake, events, heartbeats, cancel) and Redis (request state).

The HTTP app runs in-process (``httpx.ASGITransport``) on a real ``GatewayBus``; the scheduler is a
fake stand-in (``FakeScheduler``): a task that pulls the intake with ``IntakeConsumer``, acks, and
publishes scripted events, the progress events deliberately out of order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import nats
import pytest

from services.gateway.app import create_app
from services.gateway.bus import GatewayBus
from shared.jetstream import IntakeConsumer
from shared.messages.base import StepKind
from shared.messages.codec import decode, encode
from shared.messages.control import WorkerHeartbeat, WorkerStatus
from shared.messages.events import RequestAccepted, RequestFinished, RequestProgress, Usage
from shared.messages.intake import CancelRequest, CompletionRequest
from shared.settings import GatewaySettings
from shared.state import RedisStateStore, RequestRecord, RequestStatus, StepRecord
from shared.subjects import Subjects
from tests.integration.conftest import free_port
from tests.unit.gateway.gateway_builders import MODEL, MODEL_DIR, PROFILE, TOKENIZER, data_chunks

pytestmark = pytest.mark.integration

ANSWER = "42"
WAIT_S = 10.0  # upper bound on any wait for the servers; tests normally take well under a second


def gateway_settings(nats_url: str, redis_url: str, prefix: str) -> GatewaySettings:
    return GatewaySettings(nats_url=nats_url, redis_url=redis_url, subject_prefix=prefix, redis_key_prefix=prefix,
                           model_dir=str(MODEL_DIR), profile=str(PROFILE), request_timeout_s=WAIT_S)


class FakeScheduler:
    """A fake stand-in for the scheduler: takes requests off the intake and answers with ``ANSWER``."""

    def __init__(self, nc, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        self.received: list[CompletionRequest] = []
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        consumer = await IntakeConsumer.create(self.nc.jetstream(), self.subjects)
        self._task = asyncio.create_task(self._run(consumer))

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self, consumer: IntakeConsumer) -> None:
        while True:
            for delivery in await consumer.fetch(batch=4, timeout_s=0.5):
                await delivery.ack()
                self.received.append(delivery.request)
                for event in self._events(delivery.request):
                    await self.nc.publish(self.subjects.events(delivery.request.request_id), encode(event))
                await self.nc.flush()

    @staticmethod
    def _events(request: CompletionRequest) -> list:
        rid = request.request_id
        num_steps = len(ANSWER)
        usage = Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=len(ANSWER), num_steps=num_steps,
                      num_recompute_steps=1, thresholds=[0.9] * num_steps, instance_ids=["w0"], num_migrations=0,
                      latency_s=0.05, slo_met=True)
        progress = [RequestProgress(request_id=rid, seq=i + 2, num_steps=i + 1, block_index=0, committed_positions=[i],
                                    committed_token_ids=TOKENIZER.encode(char), num_committed=i + 1,
                                    gen_length=request.gen_length, text_delta=char, threshold=0.9, instance_id="w0")
                    for i, char in enumerate(ANSWER)]
        accepted = RequestAccepted(request_id=rid, seq=1, prompt_tokens=len(request.prompt_token_ids),
                                   deadline=request.deadline)
        finished = RequestFinished(request_id=rid, seq=num_steps + 2, text=ANSWER, token_ids=TOKENIZER.encode(ANSWER),
                                   usage=usage)
        # Progress (stream only) published last step first: the gateway must put it back in order.
        return [accepted, *(reversed(progress) if request.stream else []), finished]


@contextlib.asynccontextmanager
async def running_gateway(nats_server, redis_server, prefix: str):
    """(HTTP client, bus) on a started ``GatewayBus``; closed afterwards."""
    settings = gateway_settings(nats_server.url, redis_server.url, prefix)
    bus = GatewayBus(settings)
    await bus.start()
    assert await bus.wait_connected(WAIT_S)
    transport = httpx.ASGITransport(app=create_app(settings, bus=bus))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            yield http, bus
    finally:
        await bus.close()


def test_completion_and_stream_end_to_end(nats_server, redis_server, unique_prefix):
    async def main():
        nc = await nats.connect(nats_server.url)
        async with running_gateway(nats_server, redis_server, unique_prefix) as (http, _):
            scheduler = FakeScheduler(nc, Subjects(unique_prefix))
            await scheduler.start()
            try:
                plain = await http.post("/v1/completions", json={"model": MODEL, "prompt": "1+1="})
                stream = await http.post("/v1/completions", json={"model": MODEL, "prompt": "2+2=", "stream": True,
                                                                  "stream_options": {"include_progress": True}})
            finally:
                await scheduler.stop()
        await nc.close()
        return plain, stream, scheduler.received

    plain, stream, received = asyncio.run(main())
    assert plain.status_code == 200, plain.text
    answer = plain.json()
    assert answer["choices"][0]["text"] == ANSWER and answer["usage"]["steps"] == 2
    assert [r.request_id for r in received] == [answer["id"], stream.headers["x-request-id"]]
    assert received[0].prompt_token_ids == TOKENIZER.encode("1+1=") and not received[0].stream
    assert received[1].stream and received[1].slo_ms > 0

    assert stream.status_code == 200
    chunks = data_chunks(stream.text)
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["4", "2", ""]  # reordered by seq
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1] == "[DONE]"
    progress = [json.loads(line.removeprefix("data: ")) for line in stream.text.split("\n")
                if line.startswith("data: {\"request_id\"")]
    assert [p["canvas"][:3] for p in progress] == ["4__", "42_"]


def test_request_state_is_read_from_redis(nats_server, redis_server, unique_prefix):
    request_id = "cmpl-" + "0" * 32
    record = RequestRecord(request_id=request_id, status=RequestStatus.RUNNING, prompt_token_ids=TOKENIZER.encode("1+1="),
                           canvas=TOKENIZER.encode("4") + [TOKENIZER.mask_token_id] * 3,
                           mask_token_id=TOKENIZER.mask_token_id, gen_length=4, block_length=4, num_steps=1,
                           num_committed=1, threshold_history=[0.8], arrival_time=time.time(),
                           deadline=time.time() + 5, slo_ms=5000.0, instance_history=["w0"], model=MODEL)
    step = StepRecord(step_index=1, instance_id="w0", kind=StepKind.RECOMPUTE, block_index=0, threshold=0.8,
                      committed_positions=[0], started_at=time.time(), duration_s=0.01)

    async def main():
        store = RedisStateStore.from_url(redis_server.url, unique_prefix)
        await store.create(record)
        await store.append_steps(request_id, [step])
        await store.close()
        async with running_gateway(nats_server, redis_server, unique_prefix) as (http, _):
            return await http.get(f"/v1/requests/{request_id}"), await http.get("/v1/requests/cmpl-unknown")

    found, missing = asyncio.run(main())
    assert found.status_code == 200, found.text
    info = found.json()
    assert (info["status"], info["prompt"], info["canvas"], info["output"]) == ("running", "1+1=", "4___", None)
    assert info["thresholds"] == [0.8] and info["instances"] == ["w0"]
    assert [(s["step_index"], s["kind"], s["committed_positions"]) for s in info["steps"]] == [(1, "recompute", [0])]
    assert missing.status_code == 404


def test_readiness_follows_worker_heartbeats(nats_server, redis_server, unique_prefix):
    subjects = Subjects(unique_prefix)

    def heartbeat(status: WorkerStatus, seq: int) -> bytes:
        return encode(WorkerHeartbeat(instance_id="w0", node="local", tp=1, max_batch=16, model=MODEL, status=status,
                                      ttl_s=30.0, sent_at=time.time(), seq=seq))

    async def wait_for_serving(http, serving: bool) -> httpx.Response:
        deadline = time.monotonic() + WAIT_S
        while True:
            response = await http.get("/readyz")
            if response.json()["serving"] == serving or time.monotonic() > deadline:
                return response
            await asyncio.sleep(0.02)

    async def main():
        nc = await nats.connect(nats_server.url)
        async with running_gateway(nats_server, redis_server, unique_prefix) as (http, _):
            before = await http.get("/readyz")
            await nc.publish(subjects.heartbeat, heartbeat(WorkerStatus.READY, seq=1))
            await nc.flush()
            ready = await wait_for_serving(http, True)
            await nc.publish(subjects.heartbeat, heartbeat(WorkerStatus.STOPPING, seq=2))
            await nc.flush()
            stopped = await wait_for_serving(http, False)
        await nc.close()
        return before, ready, stopped

    before, ready, stopped = asyncio.run(main())
    # ready throughout (NATS and Redis are up): workers come and go without the gateway leaving its Service
    assert before.status_code == 200 and before.json()["missing"] == [] and not before.json()["serving"]
    assert ready.status_code == 200 and ready.json()["workers"][0]["instance_id"] == "w0" and ready.json()["serving"]
    assert stopped.status_code == 200 and not stopped.json()["serving"]


def test_cancel_is_published_on_the_cancel_subject(nats_server, redis_server, unique_prefix):
    async def main():
        nc = await nats.connect(nats_server.url)
        subscription = await nc.subscribe(Subjects(unique_prefix).cancel)
        await nc.flush()
        async with running_gateway(nats_server, redis_server, unique_prefix) as (_, bus):
            await bus.cancel("cmpl-" + "1" * 32, "client disconnected")
            msg = await subscription.next_msg(timeout=WAIT_S)
        await nc.close()
        return decode(CancelRequest, msg.data)

    cancel = asyncio.run(main())
    assert (cancel.request_id, cancel.reason) == ("cmpl-" + "1" * 32, "client disconnected")


def test_unreachable_servers_mean_503_not_a_hung_start(unique_prefix):
    settings = gateway_settings(f"nats://127.0.0.1:{free_port()}", f"redis://127.0.0.1:{free_port()}/0",
                                unique_prefix)

    async def main():
        bus = GatewayBus(settings)
        await bus.start()
        try:
            transport = httpx.ASGITransport(app=create_app(settings, bus=bus))
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
                return (await http.post("/v1/completions", json={"model": MODEL, "prompt": "1+1="}),
                        await http.get("/readyz"), await http.get("/healthz"))
        finally:
            await bus.close()

    completion, ready, health = asyncio.run(main())
    assert completion.status_code == 503 and "retry-after" in completion.headers
    assert ready.status_code == 503 and ready.json()["missing"] == ["nats", "redis"]
    assert health.status_code == 200
