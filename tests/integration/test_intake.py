"""The JetStream intake against a real nats-server: work-queue retention, redelivery, dedupe, poison
messages; a core-NATS request/reply with the codec; and the intake protocol end to end."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats.js.api import RetentionPolicy, StreamConfig

from shared.jetstream import IntakeConsumer, IntakeError, ensure_intake_stream, publish_request
from shared.messages import PayloadTooLargeError, decode, encode
from shared.messages.events import FailureReason, RequestAccepted, RequestEvent, RequestFailed
from shared.messages.intake import CompletionRequest
from shared.messages.predictor import (
    PredictionQuery,
    PredictReply,
    PredictRequest,
    RemainingSteps,
    StepPrediction,
)
from shared.state import RedisStateStore, RequestExistsError, RequestRecord
from shared.subjects import Subjects, shard_of

pytestmark = pytest.mark.integration


def request(request_id: str, num_prompt_tokens: int = 5) -> CompletionRequest:
    return CompletionRequest(request_id=request_id, prompt_token_ids=list(range(num_prompt_tokens)), gen_length=32,
                             block_length=8, slo_ms=5000.0, arrival_time=time.time())


async def connect_with_intake(url: str, prefix: str):
    """Subjects, a NATS connection and its JetStream context, with the intake stream in place."""
    subjects = Subjects(prefix)
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_intake_stream(js, subjects)
    return subjects, nc, js


def test_stream_has_work_queue_retention_and_ensure_is_idempotent(nats_server, unique_prefix):
    async def main():
        nc = await nats.connect(nats_server.url)
        js, subjects = nc.jetstream(), Subjects(unique_prefix)
        first = await ensure_intake_stream(js, subjects)
        again = await ensure_intake_stream(js, subjects)
        assert first.config.retention == again.config.retention == RetentionPolicy.WORK_QUEUE
        assert again.config.subjects == [subjects.intake, subjects.intake_shards]
        await nc.close()

    asyncio.run(main())


def test_a_stream_made_before_shards_gets_their_subjects_and_each_shard_its_requests(nats_server, unique_prefix):
    async def main():
        nc = await nats.connect(nats_server.url)
        js, subjects = nc.jetstream(), Subjects(unique_prefix)
        await js.add_stream(StreamConfig(name=subjects.intake_stream, subjects=[subjects.intake],
                                         retention=RetentionPolicy.WORK_QUEUE))
        info = await ensure_intake_stream(js, subjects)
        assert info.config.subjects == [subjects.intake, subjects.intake_shards]
        ids = [f"r{k}" for k in range(12)]
        for rid in ids:
            await publish_request(js, subjects, request(rid), shards=2)
        got = {}
        for shard in (0, 1):
            consumer = await IntakeConsumer.create(js, subjects, durable=f"sched-{shard}", shard=shard, shards=2)
            deliveries = await consumer.fetch(20, timeout_s=2.0)
            got[shard] = sorted(d.request.request_id for d in deliveries)
            for d in deliveries:
                await d.ack()
            await consumer.close()
        assert got[0] and got[1] and sorted(got[0] + got[1]) == sorted(ids)
        assert all(shard_of(rid, 2) == shard for shard, rids in got.items() for rid in rids)
        await nc.close()

    asyncio.run(main())


def test_existing_stream_with_other_retention_is_refused(nats_server, unique_prefix):
    async def main():
        nc = await nats.connect(nats_server.url)
        js, subjects = nc.jetstream(), Subjects(unique_prefix)
        await js.add_stream(StreamConfig(name=subjects.intake_stream, subjects=[subjects.intake],
                                         retention=RetentionPolicy.LIMITS))
        with pytest.raises(IntakeError, match="work-queue retention"):
            await ensure_intake_stream(js, subjects)
        await nc.close()

    asyncio.run(main())


def test_unacked_request_is_redelivered_to_the_next_consumer_and_acked_is_gone(nats_server, unique_prefix):
    async def main():
        subjects = Subjects(unique_prefix)
        gateway = await nats.connect(nats_server.url)
        js = gateway.jetstream()
        await ensure_intake_stream(js, subjects)
        ack = await publish_request(js, subjects, request("r1"), headers={"traceparent": "00-abc-def-01"})
        assert ack.stream == subjects.intake_stream and not ack.duplicate

        # A scheduler takes the request and dies before storing it (no ack).
        crashed = await nats.connect(nats_server.url)
        first = await IntakeConsumer.create(crashed.jetstream(), subjects, ack_wait_s=1.0)
        [delivery] = await first.fetch(batch=10, timeout_s=2.0)
        assert (delivery.request.request_id, delivery.num_delivered) == ("r1", 1)
        assert delivery.headers["traceparent"] == "00-abc-def-01"
        await crashed.close()

        # The next scheduler bound to the same durable consumer gets it again once ack_wait passes.
        survivor = await nats.connect(nats_server.url)
        second = await IntakeConsumer.create(survivor.jetstream(), subjects, ack_wait_s=1.0)
        [again] = await second.fetch(batch=10, timeout_s=5.0)
        assert (again.request, again.num_delivered) == (delivery.request, 2)
        await again.ack()

        assert await second.fetch(batch=10, timeout_s=1.5) == []  # acked: never redelivered
        info = await js.stream_info(subjects.intake_stream)
        assert info.state.messages == 0  # work-queue retention removed it
        await second.close()
        await survivor.close()
        await gateway.close()

    asyncio.run(main())


def test_nak_redelivers_at_once(nats_server, unique_prefix):
    async def main():
        subjects, nc, js = await connect_with_intake(nats_server.url, unique_prefix)
        await publish_request(js, subjects, request("r1"))
        consumer = await IntakeConsumer.create(js, subjects, ack_wait_s=30.0)
        [delivery] = await consumer.fetch(timeout_s=2.0)
        await delivery.nak()
        [again] = await consumer.fetch(timeout_s=2.0)
        assert again.num_delivered == 2
        await again.ack()
        await nc.close()

    asyncio.run(main())


def test_republished_request_id_is_stored_once(nats_server, unique_prefix):
    async def main():
        subjects, nc, js = await connect_with_intake(nats_server.url, unique_prefix)
        await publish_request(js, subjects, request("r1"))
        retry = await publish_request(js, subjects, request("r1"))
        assert retry.duplicate
        await publish_request(js, subjects, request("r2"))
        consumer = await IntakeConsumer.create(js, subjects)
        deliveries = await consumer.fetch(batch=10, timeout_s=1.0)
        assert [d.request.request_id for d in deliveries] == ["r1", "r2"]
        for d in deliveries:
            await d.ack()
        await nc.close()

    asyncio.run(main())


def test_malformed_intake_message_is_dropped_not_redelivered(nats_server, unique_prefix):
    async def main():
        subjects, nc, js = await connect_with_intake(nats_server.url, unique_prefix)
        await js.publish(subjects.intake, b"\xc1 definitely not msgpack")
        await publish_request(js, subjects, request("good"))
        consumer = await IntakeConsumer.create(js, subjects, ack_wait_s=1.0)
        deliveries = await consumer.fetch(batch=10, timeout_s=1.0)
        assert [d.request.request_id for d in deliveries] == ["good"]
        await deliveries[0].ack()
        assert await consumer.fetch(batch=10, timeout_s=1.5) == []  # the bad one was terminated
        assert (await js.stream_info(subjects.intake_stream)).state.messages == 0
        await nc.close()

    asyncio.run(main())


def test_oversize_request_is_refused_before_publishing(nats_server, unique_prefix):
    async def main():
        subjects, nc, js = await connect_with_intake(nats_server.url, unique_prefix)
        with pytest.raises(PayloadTooLargeError, match="CompletionRequest"):
            await publish_request(js, subjects, request("big", num_prompt_tokens=400_000))
        assert (await js.stream_info(subjects.intake_stream)).state.messages == 0
        await nc.close()

    asyncio.run(main())


def test_predictor_request_reply_over_core_nats(nats_server, unique_prefix):
    async def main():
        subjects = Subjects(unique_prefix)
        nc = await nats.connect(nats_server.url)

        async def predictor(msg):
            ask = decode(PredictRequest, msg.data)
            reply = PredictReply(predictions=[
                StepPrediction(request_id=q.request_id, made_at_step=q.num_steps_done,
                               threshold_to_steps={t: RemainingSteps(recompute_steps=1.0, cache_steps=10 * t)
                                                   for t in ask.thresholds})
                for q in ask.queries])
            await msg.respond(encode(reply))

        await nc.subscribe(subjects.predict, queue="predictor", cb=predictor)
        ask = PredictRequest(thresholds=[0.5, 0.9], queries=[
            PredictionQuery(request_id="r1", num_steps_done=3, gen_length=32, prompt_length=5, block_length=8)])
        answer = decode(PredictReply, (await nc.request(subjects.predict, encode(ask), timeout=2.0)).data)
        assert answer.predictions[0].threshold_to_steps[0.9].total == pytest.approx(10.0)
        await nc.close()

    asyncio.run(main())


def test_intake_skeleton_gateway_to_scheduler_and_back(nats_server, redis_server, unique_prefix):
    """The intake protocol end to end with stand-ins for the services (a template for them):
    the gateway subscribes to the request's events, then publishes; the scheduler stores the request
    in Redis, acks, and answers with events; the gateway reads them in order."""

    async def main():
        subjects = Subjects(unique_prefix)
        gateway, scheduler = await nats.connect(nats_server.url), await nats.connect(nats_server.url)
        store = RedisStateStore.from_url(redis_server.url, prefix=unique_prefix)
        await ensure_intake_stream(gateway.jetstream(), subjects)

        # gateway: subscribe first, then publish
        asked = request("cmpl-1")
        events = await gateway.subscribe(subjects.events(asked.request_id))
        await publish_request(gateway.jetstream(), subjects, asked)

        # scheduler: store, ack, answer
        intake = await IntakeConsumer.create(scheduler.jetstream(), subjects)
        [delivery] = await intake.fetch(timeout_s=2.0)
        record = delivery.request
        try:
            stored = await store.create(RequestRecord(
                request_id=record.request_id, prompt_token_ids=record.prompt_token_ids, canvas=[126] * 32,
                mask_token_id=126, gen_length=record.gen_length, block_length=record.block_length,
                arrival_time=record.arrival_time, deadline=record.deadline, slo_ms=record.slo_ms))
        except RequestExistsError:  # a redelivery: already durable
            stored = await store.load(record.request_id)
        await delivery.ack()
        await scheduler.publish(subjects.events(record.request_id), encode(RequestAccepted(
            request_id=record.request_id, seq=1, prompt_tokens=len(record.prompt_token_ids),
            deadline=stored.deadline)))
        await scheduler.publish(subjects.events(record.request_id), encode(RequestFailed(
            request_id=record.request_id, seq=2, reason=FailureReason.NO_INSTANCE, detail="no workers yet")))

        # gateway: answer from the events
        received = [decode(RequestEvent, (await events.next_msg(timeout=2.0)).data) for _ in range(2)]
        assert [type(e).__name__ for e in received] == ["RequestAccepted", "RequestFailed"]
        assert await store.list_in_flight() == ["cmpl-1"]
        await store.close()
        await scheduler.close()
        await gateway.close()

    asyncio.run(main())
