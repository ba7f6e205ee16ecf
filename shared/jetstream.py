"""The JetStream intake: the stream, publishing a request, and a pull consumer that acks explicitly.

The stream has work-queue retention: a message is removed once a consumer acks it, and one not acked
within ``ack_wait`` is redelivered (to the same durable consumer, whichever scheduler process is
bound to it now). The scheduler acks only after the request is in Redis (``StateStore.create``; a
``RequestExistsError`` on a redelivery means it already is, so ack then too). The gateway publishes
with the request id as ``Nats-Msg-Id``, so a retried publish inside the duplicate window is stored once.

A work-queue stream allows one consumer per subject, so scheduler replicas share one durable name.

``JETSTREAM_TRANSIENT_ERRORS``: what JetStream's API raises while it cannot answer for a moment (a NATS
node down, a meta-leader election); a service retries those (``shared.retry.retry_transient``) and
fails on anything else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from nats.errors import (
    ConnectionClosedError,
    ConnectionReconnectingError,
    NoRespondersError,
    StaleConnectionError,
)
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    PubAck,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)
from nats.js.errors import NotFoundError, ServerError, ServiceUnavailableError

from shared.messages.codec import DEFAULT_MAX_PAYLOAD_BYTES, CodecError, decode, encode
from shared.messages.intake import CompletionRequest
from shared.subjects import Subjects, shard_of

logger = logging.getLogger(__name__)

MSG_ID_HEADER = "Nats-Msg-Id"  # JetStream's dedupe header

# a timeout (nats.errors.TimeoutError is one), no responder, a 503 or 500 from the API, a connection re-made
JETSTREAM_TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError, NoRespondersError, ServiceUnavailableError, ServerError,
    ConnectionClosedError, ConnectionReconnectingError, StaleConnectionError,
)


class IntakeError(RuntimeError):
    """The intake stream exists but cannot serve as the work queue (wrong retention or subjects)."""


async def ensure_intake_stream(
    js: JetStreamContext,
    subjects: Subjects,
    storage: StorageType = StorageType.FILE,
    num_replicas: int = 1,
    duplicate_window_s: float = 120.0,
) -> StreamInfo:
    """Create the intake stream if it is missing; check an existing one has work-queue retention.

    The stream takes the plain intake subject and the per-shard ones (``<p>.requests.<shard>``); an
    existing stream without the latter (made before sharding existed) gets them added."""
    try:
        info = await js.stream_info(subjects.intake_stream)
    except NotFoundError:
        return await js.add_stream(StreamConfig(
            name=subjects.intake_stream,
            subjects=[subjects.intake, subjects.intake_shards],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=storage,
            num_replicas=num_replicas,
            duplicate_window=duplicate_window_s,
        ))
    if info.config.retention != RetentionPolicy.WORK_QUEUE:
        raise IntakeError(
            f"stream {subjects.intake_stream} exists with {info.config.retention} retention; the intake needs "
            "work-queue retention (delete the stream or use another subject prefix)"
        )
    if subjects.intake not in (info.config.subjects or []):
        raise IntakeError(f"stream {subjects.intake_stream} exists but does not take {subjects.intake!r}")
    if subjects.intake_shards not in info.config.subjects:
        info.config.subjects = [*info.config.subjects, subjects.intake_shards]
        info = await js.update_stream(info.config)
    return info


async def publish_request(
    js: JetStreamContext,
    subjects: Subjects,
    request: CompletionRequest,
    headers: dict[str, str] | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    timeout_s: float = 5.0,
    shards: int = 1,
) -> PubAck:
    """Publish ``request`` to the intake and wait for JetStream to store it.

    ``headers``: e.g. the OpenTelemetry trace context. ``PubAck.duplicate`` is true when the stream
    already had this request id (a retried publish). ``shards`` > 1: to the subject of the scheduler
    shard that owns the request id (``shard_of``).
    """
    data = encode(request, max_payload_bytes)
    all_headers = {**(headers or {}), MSG_ID_HEADER: request.request_id}
    subject = subjects.intake_for(shard_of(request.request_id, shards), shards)
    return await js.publish(subject, data, timeout=timeout_s, stream=subjects.intake_stream, headers=all_headers)


@dataclass
class IntakeDelivery:
    """One request taken from the intake; ``ack`` it once the request is durably in Redis."""

    request: CompletionRequest  # the decoded request
    num_delivered: int  # 1 on first delivery; more after redeliveries
    headers: dict[str, str] = field(default_factory=dict)  # trace context and the dedupe id
    msg: Msg | None = field(default=None, repr=False)  # the JetStream message behind it

    async def ack(self, timeout_s: float = 1.0) -> None:
        """Remove the message from the stream; waits for the server to confirm."""
        await self.msg.ack_sync(timeout=timeout_s)

    async def nak(self, delay_s: float | None = None) -> None:
        """Ask for redelivery now (or after ``delay_s``): this process could not take the request."""
        await self.msg.nak(delay=delay_s)

    async def in_progress(self) -> None:
        """Reset the ack timer (storing the request is taking a while)."""
        await self.msg.in_progress()


DRAIN_TIMEOUT_S = 0.05  # after the first arrival, the most a fetch waits for the others already queued


class IntakeConsumer:
    """A durable pull consumer on the intake with explicit acks."""

    def __init__(self, subscription: JetStreamContext.PullSubscription,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        self._subscription = subscription
        self.max_payload_bytes = max_payload_bytes

    @classmethod
    async def create(
        cls,
        js: JetStreamContext,
        subjects: Subjects,
        durable: str = "scheduler",
        ack_wait_s: float = 30.0,
        max_deliver: int = -1,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        shard: int = 0,
        shards: int = 1,
    ) -> IntakeConsumer:
        """Bind to the durable consumer ``durable``, creating it if missing (then with these settings);
        with several shards, the consumer takes only its shard's subject."""
        config = ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait_s,
                                max_deliver=max_deliver)
        subscription = await js.pull_subscribe(subjects.intake_for(shard, shards), durable=durable,
                                               stream=subjects.intake_stream, config=config)
        return cls(subscription, max_payload_bytes)

    async def fetch(self, batch: int = 1, timeout_s: float = 1.0) -> list[IntakeDelivery]:
        """Up to ``batch`` requests, waiting at most ``timeout_s`` for the first; empty when none came.

        Returns as soon as one request is there, with whatever else is already waiting (a pull of
        ``batch`` at once would, on an idle stream, hold the first arrival until ``timeout_s`` runs
        out waiting for the rest: admission latency). A message that does not decode is terminated
        (never redelivered) and logged, not returned.
        """
        try:
            msgs = await self._subscription.fetch(1, timeout=timeout_s)
        except TimeoutError:  # nats.errors.TimeoutError, or asyncio's when the pull request itself timed out
            return []
        if batch > 1:
            try:
                msgs += await self._subscription.fetch(batch - 1, timeout=DRAIN_TIMEOUT_S)
            except TimeoutError:
                pass  # nothing else was waiting
        deliveries = []
        for msg in msgs:
            try:
                request = decode(CompletionRequest, msg.data, self.max_payload_bytes)
            except CodecError as exc:
                logger.error("dropping an intake message (stream seq %s): %s", msg.metadata.sequence.stream, exc)
                await msg.term()
                continue
            deliveries.append(IntakeDelivery(request, msg.metadata.num_delivered, dict(msg.headers or {}), msg))
        return deliveries

    async def close(self) -> None:
        """Stop fetching (the durable consumer and its unacked messages stay on the server)."""
        await self._subscription.unsubscribe()
