"""The gateway's ports to the cluster: NATS (intake, events, cancel, heartbeats) and Redis (request state).

``Bus`` is the interface the HTTP app uses; ``GatewayBus`` implements it on a real NATS connection
and a Redis client. Protocol (``shared/README.md``): ``submit`` subscribes to ``events.<id>`` *before*
it publishes the request on the JetStream intake, so no event can be missed, and yields the
request's events in ``seq`` order (``EventSequencer``) up to and including the terminal one.
``cancel`` publishes ``CancelRequest`` on ``cancel``. Heartbeats on ``heartbeat`` feed a
``WorkerRegistry`` so readiness knows whether any worker is alive.

The gateway starts while NATS is down: the connection is made (and remade) in the background, and
until it is up ``submit`` raises ``BusUnavailableError`` and ``/readyz`` says what is missing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from redis.exceptions import RedisError

from services.gateway.sequencing import EventSequencer
from services.gateway.workers import WorkerRegistry
from shared.jetstream import IntakeError, ensure_intake_stream, publish_request
from shared.messages.codec import CodecError, PayloadTooLargeError, decode, encode
from shared.messages.control import WorkerHeartbeat
from shared.messages.events import RequestEvent
from shared.messages.intake import CancelRequest, CompletionRequest
from shared.messages.predictor import PredictReply, PredictRequest
from shared.settings import ServiceSettings, redact_urls
from shared.state import RedisStateStore, RequestRecord, StateError, StepRecord, redis_client
from shared.subjects import Subjects

logger = logging.getLogger(__name__)

EVENT_GAP_WAIT_S = 0.5  # how long later events wait for a missing one before it is given up as lost
PUBLISH_TIMEOUT_S = 5.0  # wait this long for JetStream to store a request
CANCEL_TIMEOUT_S = 2.0  # wait this long to publish a cancellation (the client is gone anyway)
PREDICT_TIMEOUT_S = 0.5  # wait this long for the predictor service's one-shot estimate (default SLOs)
REDIS_TIMEOUT_S = 2.0  # a Redis call slower than this counts as Redis not answering
RECONNECT_WAIT_S = 1.0  # between attempts to reach NATS or to set up the intake stream
# heard heartbeats for this long (longer than a worker's lease, DLS_WORKER_LEASE_TTL_S = 6 s by default)
# before "no READY worker" is believed: a gateway that just (re)started has not heard the workers yet
HEARTBEAT_GRACE_S = 8.0


class BusUnavailableError(RuntimeError):
    """NATS or Redis cannot be used right now (the HTTP answer is 503)."""


@dataclass(frozen=True)
class Readiness:
    """What the gateway can reach now."""

    nats_connected: bool  # NATS connection up and the intake stream in place
    redis_ok: bool  # Redis answered PING
    workers: list[WorkerHeartbeat] = field(default_factory=list)  # live worker leases (any status)
    detail: dict[str, str] = field(default_factory=dict)  # component -> what is wrong with it
    heard_s: dict[str, float] = field(default_factory=dict)  # instance id -> seconds since its heartbeat arrived


class Bus(Protocol):
    """What the HTTP app needs from the cluster (``GatewayBus``, or a fake in tests)."""

    def submit(self, request: CompletionRequest,
               headers: dict[str, str] | None = None) -> AsyncIterator[RequestEvent]:
        """Publish ``request`` and yield its events in order, the terminal one last.

        Raises ``BusUnavailableError`` (on the first iteration) if the request could not be published.
        """
        ...

    def follow(self, request: CompletionRequest) -> AsyncIterator[RequestEvent]:
        """Yield the events of ``request``, already submitted (a retry joining it), from now on, in order."""
        ...

    async def cancel(self, request_id: str, reason: str) -> None:
        """Ask the scheduler to stop ``request_id`` (best effort)."""
        ...

    async def load_request(self, request_id: str) -> tuple[RequestRecord, list[StepRecord]] | None:
        """The stored state of a request and its step records; None if not stored."""
        ...

    async def predict(self, request: PredictRequest) -> PredictReply:
        """The predictor service's answer (request/reply); raises when it does not answer in time."""
        ...

    async def readiness(self) -> Readiness:
        ...

    def ready_workers(self) -> list[WorkerHeartbeat] | None:
        """READY instances within their lease now; None while the bus cannot tell (not yet listening to
        heartbeats for a lease length): the gateway then lets the scheduler decide."""
        ...


class GatewayBus:
    """``Bus`` on NATS and Redis. ``start`` it inside the event loop; ``close`` it at shutdown."""

    def __init__(self, settings: ServiceSettings, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.subject_prefix)
        self._clock = clock
        self._nc = NATS()
        self._js = None  # JetStream context once connected
        self._intake_ready = False  # the intake stream exists with work-queue retention
        self._intake_problem = "not connected yet"  # why the intake is not ready
        self._workers = WorkerRegistry()
        self._heartbeats_since: float | None = None  # time.monotonic() of the heartbeat subscription
        self._redis = None  # redis.asyncio.Redis once started
        self._store: RedisStateStore | None = None
        self._connect_task: asyncio.Task | None = None
        self._nats_down_logged = False  # log a NATS outage once, not at every reconnect attempt

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._redis = redis_client(self.settings.redis_url, socket_connect_timeout=REDIS_TIMEOUT_S,
                                   socket_timeout=REDIS_TIMEOUT_S)
        self._store = RedisStateStore(self._redis, self.settings.redis_key_prefix)
        self._connect_task = asyncio.create_task(self._connect(), name="gateway-nats-connect")

    async def wait_connected(self, timeout_s: float) -> bool:
        """True once NATS is connected and the intake stream is in place (tests, startup logs)."""
        if self._connect_task is None:
            return False
        try:
            await asyncio.wait_for(asyncio.shield(self._connect_task), timeout_s)
        except TimeoutError:
            return False
        return self.connected

    async def close(self) -> None:
        task = self._connect_task
        while task is not None and not task.done():
            # NOTE: nats-py swallows a cancellation that lands while it tidies up a failed connection
            # attempt (Client._close waits for its reconnection task and passes CancelledError), and then
            # keeps trying forever: cancel again until the task is really gone
            task.cancel()
            await asyncio.wait({task}, timeout=0.5)
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        if not self._nc.is_closed:
            await self._nc.close()
        if self._redis is not None:
            await self._redis.aclose()

    @property
    def connected(self) -> bool:
        return self._nc.is_connected and self._intake_ready

    async def _connect(self) -> None:
        await self._nc.connect(
            servers=[url.strip() for url in self.settings.nats_url.split(",") if url.strip()],
            name="dls-gateway", max_reconnect_attempts=-1, reconnect_time_wait=RECONNECT_WAIT_S,
            error_cb=self._on_nats_error, disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected,
        )
        logger.info("connected to NATS at %s", self._nc.connected_url.netloc if self._nc.connected_url else "?")
        self._nats_down_logged = False
        await self._nc.subscribe(self.subjects.heartbeat, cb=self._on_heartbeat)
        self._heartbeats_since = time.monotonic()
        self._js = self._nc.jetstream()
        while True:
            try:
                await ensure_intake_stream(self._js, self.subjects, num_replicas=self.settings.intake_replicas)
            except (nats.errors.Error, TimeoutError, IntakeError) as exc:
                if self._intake_problem != str(exc):
                    logger.error("intake stream %s is not usable, retrying: %s", self.subjects.intake_stream, exc)
                self._intake_problem = str(exc) or type(exc).__name__
                await asyncio.sleep(RECONNECT_WAIT_S)
                continue
            self._intake_ready = True
            self._intake_problem = ""
            return

    async def _on_nats_error(self, exc: Exception) -> None:
        if not self._nats_down_logged:
            logger.warning("NATS at %s: %s (retrying quietly)", redact_urls(self.settings.nats_url),
                           exc or type(exc).__name__)
            self._nats_down_logged = True

    async def _on_disconnected(self) -> None:
        logger.warning("disconnected from NATS")

    async def _on_reconnected(self) -> None:
        logger.info("reconnected to NATS")
        self._nats_down_logged = False

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            heartbeat = decode(WorkerHeartbeat, msg.data, self.settings.max_payload_bytes)
        except CodecError as exc:
            logger.warning("dropping a heartbeat: %s", exc)
            return
        self._workers.observe(heartbeat, self._clock())

    # --- the port -----------------------------------------------------------------------------

    def submit(self, request: CompletionRequest,
               headers: dict[str, str] | None = None) -> AsyncIterator[RequestEvent]:
        return self._events(request, headers, publish=True)

    def follow(self, request: CompletionRequest) -> AsyncIterator[RequestEvent]:
        return self._events(request, None, publish=False)

    async def _events(self, request: CompletionRequest, headers: dict[str, str] | None,
                      publish: bool) -> AsyncIterator[RequestEvent]:
        if not self.connected:
            raise BusUnavailableError(f"NATS is not reachable or the intake is not ready ({self._problem()})")
        queue: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_event(msg: Msg) -> None:
            queue.put_nowait(msg.data)

        subscription = await self._nc.subscribe(self.subjects.events(request.request_id), cb=on_event)
        try:
            if publish:
                await self._publish(request, headers)
            else:
                try:  # subscribed on the server before the caller reads Redis (else its poll finds the end)
                    await self._nc.flush(timeout=PUBLISH_TIMEOUT_S)
                except (nats.errors.Error, TimeoutError) as exc:
                    logger.debug("following %s: flush failed (%s)", request.request_id, exc)
            sequencer = EventSequencer(contiguous=request.stream)
            while not sequencer.done:
                try:
                    data = await asyncio.wait_for(queue.get(), EVENT_GAP_WAIT_S if sequencer.holding else None)
                except TimeoutError:
                    for event in sequencer.flush():
                        yield event
                    continue
                event = self._decode_event(data, request.request_id)
                for due in sequencer.push(event) if event is not None else ():
                    yield due
        finally:
            with anyio.CancelScope(shield=True):  # runs even when the HTTP task is being cancelled
                try:
                    await subscription.unsubscribe()
                except nats.errors.Error:
                    pass  # the connection is closed or closing: the subscription is gone with it

    async def cancel(self, request_id: str, reason: str) -> None:
        if not self._nc.is_connected:
            logger.warning("cannot cancel %s (%s): NATS is not connected", request_id, reason)
            return
        data = encode(CancelRequest(request_id=request_id, reason=reason), self.settings.max_payload_bytes)
        try:
            await asyncio.wait_for(self._nc.publish(self.subjects.cancel, data), CANCEL_TIMEOUT_S)
        except (nats.errors.Error, TimeoutError) as exc:
            logger.warning("cannot cancel %s (%s): %s", request_id, reason, exc)

    async def predict(self, request: PredictRequest) -> PredictReply:
        if not self._nc.is_connected:
            raise BusUnavailableError("NATS is not connected")
        msg = await self._nc.request(self.subjects.predict, encode(request, self.settings.max_payload_bytes),
                                     timeout=PREDICT_TIMEOUT_S)
        return decode(PredictReply, msg.data, self.settings.max_payload_bytes)

    async def load_request(self, request_id: str) -> tuple[RequestRecord, list[StepRecord]] | None:
        if self._store is None:
            raise BusUnavailableError("the gateway is not started")
        try:
            record = await asyncio.wait_for(self._store.load(request_id), REDIS_TIMEOUT_S)
            if record is None:
                return None
            steps = await asyncio.wait_for(self._store.load_steps(request_id), REDIS_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError, StateError) as exc:
            raise BusUnavailableError(f"cannot read request {request_id} from Redis: {exc}") from None
        return record, steps

    async def readiness(self) -> Readiness:
        detail: dict[str, str] = {}
        if not self.connected:
            detail["nats"] = self._problem()
        redis_ok = await self._ping_redis(detail)
        now = self._clock()
        workers = self._workers.live(now)
        heard = {hb.instance_id: now - self._workers.get(hb.instance_id).received_at for hb in workers}
        return Readiness(self.connected, redis_ok, workers, detail=detail, heard_s=heard)

    def ready_workers(self) -> list[WorkerHeartbeat] | None:
        since = self._heartbeats_since
        if since is None or not self._nc.is_connected or time.monotonic() - since < HEARTBEAT_GRACE_S:
            return None
        return self._workers.ready(self._clock())

    # --- helpers ------------------------------------------------------------------------------

    async def _publish(self, request: CompletionRequest, headers: dict[str, str] | None) -> None:
        try:
            await publish_request(self._js, self.subjects, request, headers, self.settings.max_payload_bytes,
                                  PUBLISH_TIMEOUT_S, shards=self.settings.scheduler_shards)
        except PayloadTooLargeError:
            raise
        except (nats.errors.Error, TimeoutError) as exc:
            raise BusUnavailableError(
                f"could not publish request {request.request_id} to the intake: {type(exc).__name__} {exc}"
            ) from None

    def _decode_event(self, data: bytes, request_id: str) -> RequestEvent | None:
        try:
            event = decode(RequestEvent, data, self.settings.max_payload_bytes)
        except CodecError as exc:
            logger.warning("dropping an event of %s: %s", request_id, exc)
            return None
        if event.request_id != request_id:
            logger.warning("dropping an event of %s published on the subject of %s", event.request_id, request_id)
            return None
        return event

    async def _ping_redis(self, detail: dict[str, str]) -> bool:
        if self._redis is None:
            detail["redis"] = "not started"
            return False
        try:
            await asyncio.wait_for(self._redis.ping(), REDIS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure means "Redis does not answer"
            detail["redis"] = f"{type(exc).__name__}: {exc}"
            return False
        return True

    def _problem(self) -> str:
        if not self._nc.is_connected:
            return f"not connected to {redact_urls(self.settings.nats_url)}"
        return self._intake_problem or "intake stream not ready"
