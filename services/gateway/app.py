"""The gateway's HTTP app: OpenAI-shaped completions over DiLaServe's step-level scheduler.

``create_app(settings, bus=None)`` loads the served model's tokenizer and the latency profile of
default SLOs (whose step estimates come from the predictor service, over the bus), and wires the routes to a ``Bus`` (``GatewayBus`` on NATS and Redis unless one is given; a given bus
is the caller's to start and close). A request is validated and tokenized here
(``RequestPreparer``), submitted, and answered from its events: one JSON object, or server-sent
events when ``stream`` is set. No torch: the gateway never loads weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.answers import (
    DONE,
    KEEPALIVE,
    StreamFormatter,
    final_answer,
    model_card,
    model_state,
    request_info,
)
from services.gateway.bus import Bus, BusUnavailableError, GatewayBus
from services.gateway.dashboard import mount_dashboard
from services.gateway.edge import ApiKeyMiddleware, BodyLimitMiddleware
from services.gateway.errors import SERVER_ERROR, ApiError, error_body, failure_error, invalid
from services.gateway.idempotency import (
    IdempotencyStore,
    InMemoryIdempotency,
    RedisIdempotency,
    RetryKey,
    retry_key,
)
from services.gateway.models import (
    ModelCatalogue,
    ModelLoadError,
    ServedModel,
    UnknownModelError,
    load_served_model,
)
from services.gateway.observability import install_observability, intake_headers
from services.gateway.prepare import PreparedRequest, RequestPreparer, new_request_id
from services.gateway.recovery import TrackedEvents, event_from_record
from services.gateway.schemas import (
    COMPLETION_ERRORS,
    LISTING_ERRORS,
    READ_ERRORS,
    ChatCompletionBody,
    ChatCompletionResponse,
    CompletionBody,
    CompletionResponse,
    ModelList,
    RequestInfo,
    constrain_openapi,
)
from services.gateway.security import Admission, RedisRateLimiter, caller, rate_identity
from services.gateway.sequencing import is_terminal
from services.gateway.slo import DefaultSlo, SloEstimator
from shared.messages.codec import PayloadTooLargeError
from shared.messages.control import WorkerStatus
from shared.messages.events import (
    RequestAccepted,
    RequestEvent,
    RequestFailed,
    RequestFinished,
    RequestProgress,
)
from shared.metrics import GatewayMetrics
from shared.profiles import LatencyProfile, ProfileError
from shared.served import DuplicateModelName, served_models_of
from shared.settings import GatewaySettings

logger = logging.getLogger(__name__)

CANCEL_WAIT_S = 2.0  # most time spent publishing a cancellation for a client that left
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first" (never seen by it)
MAX_REQUEST_ID_CHARS = 200
COLD_START_HEADER = "X-DLS-Cold-Start-Ms"  # how long a request waited for its model's first instance
COLD_START_POLL_S = 0.1  # how often a cold start looks for a READY instance among the heartbeats heard


class ChoiceEvents:
    """The events of a request's choices (one request each), merged in arrival order as (choice index,
    event); ends once every choice got its terminal event. Closing it closes them all and frees the
    admission slot (``release``)."""

    def __init__(self, streams: list[TrackedEvents], release: Callable[[], None] = lambda: None) -> None:
        self._streams = streams
        self._queue: asyncio.Queue = asyncio.Queue()  # (index, event or the exception that ended its stream)
        self._tasks: list[asyncio.Task] | None = None
        self._num_open = len(streams)  # choices without their terminal event yet
        self._release = release
        self._closed = False
        self.settled = False  # a choice's terminal event, or the error that ended its stream, is waiting

    def __aiter__(self) -> ChoiceEvents:
        return self

    def start(self) -> None:
        """Submit (or follow) every choice now; their events wait here until read."""
        if self._tasks is None:
            self._tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(self._streams)]

    async def __anext__(self) -> tuple[int, RequestEvent]:
        self.start()
        if self._num_open == 0:
            raise StopAsyncIteration
        index, item = await self._queue.get()  # cancel-safe: a timeout around it loses nothing
        if isinstance(item, BaseException):
            raise item  # StopAsyncIteration (no terminal event), BusUnavailableError, PayloadTooLargeError
        if is_terminal(item):
            self._num_open -= 1
        return index, item

    async def _pump(self, index: int, stream: TrackedEvents) -> None:
        try:
            async for event in stream:
                self._queue.put_nowait((index, event))
                if is_terminal(event):
                    self.settled = True
                    return
            self._queue.put_nowait((index, StopAsyncIteration()))
        except Exception as exc:  # noqa: BLE001 (handed to the reader, who turns it into a status)
            self._queue.put_nowait((index, exc))
        self.settled = True

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            for task in self._tasks or ():
                task.cancel()
            await asyncio.gather(*(self._tasks or ()), return_exceptions=True)
            for stream in self._streams:
                await stream.aclose()
        finally:
            self._release()

    def __del__(self) -> None:  # a response never iterated: its admission slot is still freed
        if not self._closed:
            self._closed = True
            self._release()


class Gateway:
    """The request handling behind the routes: prepare, submit (or join), answer, and no orphan work."""

    def __init__(self, settings: GatewaySettings, preparer: RequestPreparer, bus: Bus,
                 rate_limiter: RedisRateLimiter | None = None, idempotency: IdempotencyStore | None = None,
                 metrics: GatewayMetrics | None = None) -> None:
        self.settings = settings
        self.preparer = preparer
        self.bus = bus
        self.rate_limiter = rate_limiter  # per-key limit in Redis (None: no limit)
        self.admission = Admission(settings.max_in_flight, settings.retry_after_s)
        self.idempotency = idempotency or InMemoryIdempotency()  # retry keys (see idempotency.py)
        self.metrics = metrics or GatewayMetrics()
        self._grace_tasks: set[asyncio.Task] = set()  # requests whose client left, waiting for a retry

    # --- completions --------------------------------------------------------------------------

    async def complete(self, body: CompletionBody | ChatCompletionBody, request: Request) -> Response:
        cold = self._cold_start(body.model)  # or a 503 at once
        if self.rate_limiter is not None:
            await self.rate_limiter.check(rate_identity(request))
        self.admission.enter()  # 429 when this gateway holds max_in_flight requests already
        try:
            prepared = await self.preparer.prepare(body, new_request_id(), time.time())
            owner = caller(request)
            if owner:
                prepared = prepared.with_requests(tuple(msgspec.structs.replace(r, owner=owner)
                                                        for r in prepared.choice_requests))
            key, joined = await self._retry_key(body, request, prepared)
            if joined is not None:
                prepared = joined
        except BaseException:
            self.admission.leave()
            raise
        trace = intake_headers(prepared.request)  # the trace continues in the scheduler (observability.py)
        streams = [TrackedEvents(self.bus.follow(r) if joined else self.bus.submit(r, trace or None), r.request_id,
                                 lambda rid: self._stored_event(rid, prepared), self.settings.result_poll_s,
                                 check_first=joined is not None)
                   for r in prepared.choice_requests]
        events = ChoiceEvents(streams, self.admission.leave)
        deadline = asyncio.get_running_loop().time() + self.settings.request_timeout_s
        answer = self._open_stream if prepared.request.stream else self._answer
        headers = {"X-Request-Id": prepared.response_id}
        if joined is not None:
            self.metrics.idempotent_joins.inc()
            headers["Idempotent-Replayed"] = "true"
        def answered():
            return answer(prepared, events, deadline, key, headers)

        work = self._after_cold_start(prepared, events, key, headers, answered) if cold else answered()
        return await self._unless_client_leaves(request, prepared, key, work)

    async def _retry_key(self, body, request: Request,
                         prepared: PreparedRequest) -> tuple[RetryKey | None, PreparedRequest | None]:
        """The request's retry key (None: its client does not retry) and, when it retries one that runs or
        ran, the prepared request rebuilt around that one's requests (to join them)."""
        try:
            key = retry_key(request.headers, rate_identity(request), request.url.path,
                            body.model_dump(mode="json", exclude_unset=True))
        except ValueError as exc:
            raise invalid("Idempotency-Key", f"Idempotency-Key: {exc}", "invalid_idempotency_key") from None
        if key is None:
            return None, None
        ids = [r.request_id for r in prepared.choice_requests]
        try:
            claim = await self.idempotency.claim(key.key, key.fingerprint, ids, prepared.request.arrival_time,
                                                 self.settings.idempotency_ttl_s, attach=key.join)
        except Exception as exc:  # noqa: BLE001 (Redis down: serve it as new work, cancelled when its client leaves)
            logger.warning("retry keys unavailable (%s): request %s runs without one", type(exc).__name__,
                           prepared.request_id)
            return None, None
        if claim.created:
            return key, None
        if not key.join:
            return None, None  # an identical body sent afresh: new work, not joinable
        if claim.fingerprint != key.fingerprint:
            await self._detach(key)
            raise ApiError(422, "Idempotency-Key was used with another request body; use a new key for a new "
                           "request", "Idempotency-Key", "idempotency_key_reused")
        requests = tuple(msgspec.structs.replace(r, request_id=rid, arrival_time=claim.arrival_time)
                         for r, rid in zip(prepared.choice_requests, claim.request_ids, strict=False))
        if len(requests) != len(prepared.choice_requests):
            await self._detach(key)
            raise ApiError(422, "Idempotency-Key stands for a request with another number of choices", "n",
                           "idempotency_key_reused")
        answer_id = claim.request_ids[0] if len(requests) == 1 else claim.request_ids[0].rsplit("-", 1)[0]
        logger.info("request %s joins %s (a retry)", prepared.request_id, answer_id)
        return key, prepared.with_requests(requests, answer_id)

    async def _open_stream(self, prepared: PreparedRequest, events: ChoiceEvents, deadline: float,
                           key: RetryKey | None, headers: dict[str, str]) -> Response:
        """The SSE response, once the request got past admission (a refusal is still a plain status), or
        once it has waited ``sse_keepalive_s`` after the scheduler accepted it (queued behind others: the
        stream opens with keep-alives, and anything that fails it later is said in-band)."""
        try:
            first = await self._next_event(prepared, events, deadline)
            while first is not None and isinstance(first[1], RequestAccepted):  # admission may still refuse it
                try:
                    first = await self._next_or_keepalive(prepared, events, deadline)
                except _KeepAlive:
                    first = None
            if first is not None and isinstance(first[1], RequestFailed):
                await self._failed(prepared, key)
                raise failure_error(first[1], self.settings.retry_after_s)
        except ApiError as error:
            await events.aclose()
            if error.status_code == 504:
                await self._abandon(prepared, key, "timed out")
            raise
        except BaseException:
            await events.aclose()
            raise
        return StreamingResponse(self._stream(prepared, first, events, deadline, key), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _answer(self, prepared: PreparedRequest, events: ChoiceEvents, deadline: float,
                      key: RetryKey | None, headers: dict[str, str]) -> Response:
        finals: dict[int, RequestFinished] = {}  # choice index -> its answer
        try:
            while len(finals) < len(prepared.choice_requests):
                try:
                    index, event = await self._next_event(prepared, events, deadline)
                except ApiError as error:
                    if error.status_code == 504:
                        await self._abandon(prepared, key, "timed out")
                    raise
                if isinstance(event, RequestFinished):
                    finals[index] = event
                elif isinstance(event, RequestFailed):
                    await self._failed(prepared, key)
                    raise failure_error(event, self.settings.retry_after_s)
        finally:
            await events.aclose()
        await self._detach(key)
        self._observe_answer(prepared, finals.values())
        return JSONResponse(final_answer(prepared, [finals[i] for i in sorted(finals)]), headers=headers)

    async def _stream(self, prepared: PreparedRequest, first: tuple[int, RequestEvent] | None, events: ChoiceEvents,
                      deadline: float, key: RetryKey | None) -> AsyncIterator[str]:
        """SSE chunks (keep-alive comments while nothing comes; ``first`` None: the request is queued, and
        the stream starts with one); a client that leaves before the end gets its request cancelled
        (unless a retry joins it)."""
        formatter = StreamFormatter(prepared)
        clock = _ChunkClock(self.metrics, prepared)
        (index, event), ended, failed = first or (0, None), False, False
        try:
            if first is None:
                yield KEEPALIVE
            while True:
                chunks, text = [], False
                if isinstance(event, RequestProgress):
                    chunks, text = formatter.progress(event, index), bool(event.text_delta)
                elif isinstance(event, RequestFinished):
                    chunks = formatter.finished(event, index)
                    text = len(chunks) > 1  # text no progress event carried
                elif isinstance(event, RequestFailed):
                    chunks, ended, failed = [formatter.error(failure_error(event, self.settings.retry_after_s))], True, True
                if text:
                    clock.text_sent()
                for chunk in chunks:
                    yield chunk
                if not ended and formatter.all_finished:
                    ended = True
                    usage = formatter.usage_chunk()  # include_usage: the last chunk, choices []
                    if usage is not None:
                        yield usage
                    clock.done()
                if ended:
                    break
                event = None
                while event is None:
                    try:
                        index, event = await self._next_or_keepalive(prepared, events, deadline)
                    except _KeepAlive:
                        yield KEEPALIVE
                    except ApiError as error:  # timeout, NATS gone: said in-band, the status is already sent
                        yield formatter.error(error)
                        break
                if event is None:
                    break
            yield DONE
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()
                if failed:
                    await self._failed(prepared, key)
                elif ended:
                    await self._detach(key)
                else:
                    await self._abandon(prepared, key, "client disconnected")

    async def _next_or_keepalive(self, prepared: PreparedRequest, events: ChoiceEvents,
                                 deadline: float) -> tuple[int, RequestEvent]:
        """The next event; ``_KeepAlive`` when none came for ``sse_keepalive_s`` (0: wait as long as it takes)."""
        if not self.settings.sse_keepalive_s:
            return await self._next_event(prepared, events, deadline)
        try:
            async with asyncio.timeout(self.settings.sse_keepalive_s):
                return await self._next_event(prepared, events, deadline)
        except TimeoutError:
            raise _KeepAlive() from None

    async def _next_event(self, prepared: PreparedRequest, events: ChoiceEvents,
                          deadline: float) -> tuple[int, RequestEvent]:
        rid = prepared.response_id
        try:
            async with asyncio.timeout_at(deadline):
                return await anext(events)
        except TimeoutError:
            grace = self.settings.retry_grace_s
            raise ApiError(504, f"request {rid} did not finish within {self.settings.request_timeout_s:g} s; it is "
                           f"cancelled unless a retry with the same Idempotency-Key (or the OpenAI SDK's own retry) "
                           f"joins it within {grace:g} s", None, "timeout", SERVER_ERROR) from None
        except StopAsyncIteration:
            raise ApiError(500, f"request {rid}: the event stream ended without a final event", None,
                           "internal", SERVER_ERROR) from None
        except BusUnavailableError as exc:
            raise ApiError(503, f"request {rid}: {exc}", None, "unavailable", SERVER_ERROR,
                           {"Retry-After": str(self.settings.retry_after_s)}) from None
        except PayloadTooLargeError as exc:
            raise invalid("prompt", f"prompt: request {rid} is too large to send ({exc})", "too_large") from None

    async def _unless_client_leaves(self, request: Request, prepared: PreparedRequest, key: RetryKey | None,
                                    answer) -> Response:
        """Await ``answer``, but cancel the request if the HTTP client disconnects first."""
        work = asyncio.ensure_future(answer)
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if not work.cancelled():
            return work.result()
        await self._abandon(prepared, key, "client disconnected")
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    # --- no orphan work (idempotency.py) --------------------------------------------------------

    async def _abandon(self, prepared: PreparedRequest, key: RetryKey | None, reason: str) -> None:
        """The client left (``reason``): cancel the request now, or, under a retry key, once no client is
        attached and none joined within ``retry_grace_s``."""
        if key is not None:
            try:
                attached, joins = await self.idempotency.detach(key.key)
                if attached > 0:
                    return  # a retry is attached: it answers (and cancels) from here on
                if attached == 0 and self.settings.retry_grace_s > 0:
                    task = asyncio.create_task(self._cancel_after_grace(prepared, key, joins, reason))
                    self._grace_tasks.add(task)
                    task.add_done_callback(self._grace_tasks.discard)
                    return
                if attached == 0 and not await self.idempotency.drop_if_unattached(key.key, joins):
                    return
            except Exception as exc:  # noqa: BLE001 (Redis down: cancel now rather than leave work behind)
                logger.warning("retry key of %s unavailable (%s): cancelling now", prepared.response_id, exc)
        await self._cancel_all(prepared, reason)

    async def _cancel_after_grace(self, prepared: PreparedRequest, key: RetryKey, joins: int, reason: str) -> None:
        try:
            await asyncio.sleep(self.settings.retry_grace_s)
            dropped = await self.idempotency.drop_if_unattached(key.key, joins)
        except asyncio.CancelledError:  # the gateway stops: nobody can join any more
            dropped = True
        except Exception as exc:  # noqa: BLE001
            logger.warning("retry key of %s unavailable (%s): cancelling", prepared.response_id, exc)
            dropped = True
        if dropped:
            with anyio.CancelScope(shield=True):
                await self._cancel_all(prepared, f"{reason}; no retry joined within {self.settings.retry_grace_s:g} s")

    async def _detach(self, key: RetryKey | None) -> None:
        """This client got its answer (the key stays: a later retry gets the stored answer)."""
        if key is None:
            return
        try:
            await self.idempotency.detach(key.key)
        except Exception as exc:  # noqa: BLE001 (the answer went out; the count only matters to cancels)
            logger.warning("retry key: detach failed (%s)", exc)

    async def _failed(self, prepared: PreparedRequest, key: RetryKey | None) -> None:
        """A choice failed: the others are cancelled, and a retry starts afresh (the key is dropped)."""
        if len(prepared.choice_requests) > 1:
            await self._cancel_all(prepared, "another choice of the request failed")
        if key is not None:
            try:
                await self.idempotency.drop(key.key)
            except Exception as exc:  # noqa: BLE001
                logger.warning("retry key: drop failed (%s)", exc)

    async def _cancel_all(self, prepared: PreparedRequest, reason: str) -> None:
        self.metrics.abandoned.inc()
        for choice in prepared.choice_requests:
            await self._cancel(choice.request_id, reason)

    async def _cancel(self, request_id: str, reason: str) -> None:
        with anyio.move_on_after(CANCEL_WAIT_S):
            await self.bus.cancel(request_id, reason)

    async def shutdown(self) -> None:
        """Cancel at once the requests still waiting for a retry (nobody can join once this gateway stops)."""
        tasks = list(self._grace_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _observe_answer(self, prepared: PreparedRequest, finals) -> None:
        elapsed = max(time.time() - prepared.request.arrival_time, 0.0)
        self.metrics.e2e.labels(prepared.model.name).observe(elapsed)

    def _cold_start(self, model: str) -> bool:
        """Whether a request for ``model`` waits for its first instance (a cold start, ``_after_cold_start``).

        A served model with no READY instance is scaled to zero while a worker of another served model is
        READY (the cluster serves, so its scheduler queues the request, and the reconfigurator starts an
        instance on its arrival): its request is admitted. With no READY worker of any served model (the
        cluster is down or still starting), or cold starts off (``cold_start_timeout_s`` 0), it gets a 503
        with Retry-After at once. False where an instance is up, the bus cannot tell yet (None: the
        scheduler decides), or the model is not served (its 404 follows)."""
        workers = self.bus.ready_workers()
        catalogue = self.preparer.catalogue
        if workers is None or model not in catalogue or any(hb.model == model for hb in workers):
            return False
        serving = any(hb.model in catalogue for hb in workers)
        if serving and self.settings.cold_start_timeout_s > 0:
            return True
        why = ("DLS_GATEWAY_COLD_START_TIMEOUT_S is 0: no cold start" if serving else
               "nor one of any served model: the cluster is not serving")
        raise ApiError(503, f"no model instance serving {model} is up ({why}); retry after "
                       f"{self.settings.retry_after_s} s", None, "no_instance", SERVER_ERROR,
                       {"Retry-After": str(self.settings.retry_after_s)})

    async def _after_cold_start(self, prepared: PreparedRequest, events: ChoiceEvents, key: RetryKey | None,
                                headers: dict[str, str], answered: Callable[[], Awaitable[Response]]) -> Response:
        """A request for a model scaled to zero: submitted at once (the scheduler queues it, and its arrival in
        the workload stats makes the reconfigurator start an instance), answered (``answered``) once an
        instance of its model is READY (a stream opens then), with the wait in ``COLD_START_HEADER``, the
        log and ``dls_gateway_cold_start_seconds``. Past ``cold_start_timeout_s`` it is cancelled and a
        503 names the model and the wait. A choice that ends first (refused, failed) is answered at once.
        The request's deadline (``request_timeout_s``) counts from its arrival, the wait included."""
        model, limit = prepared.model.name, self.settings.cold_start_timeout_s
        started = time.monotonic()
        events.start()
        try:
            async with asyncio.timeout(limit):
                while not events.settled and not self._instance_ready(model):
                    await asyncio.sleep(COLD_START_POLL_S)
        except TimeoutError:
            await events.aclose()
            self.metrics.cold_start_seconds.labels(model, "timed_out").observe(time.monotonic() - started)
            await self._abandon(prepared, key, f"no instance of {model} was READY within the cold start's {limit:g} s")
            raise ApiError(503, f"request {prepared.response_id}: {model} is scaled to zero, and no instance of it "
                           f"was READY within {limit:g} s of the request (DLS_GATEWAY_COLD_START_TIMEOUT_S); it is "
                           f"cancelled: retry after {self.settings.retry_after_s} s", None, "cold_start_timeout",
                           SERVER_ERROR, {"Retry-After": str(self.settings.retry_after_s)}) from None
        except BaseException:
            await events.aclose()
            raise
        waited = time.monotonic() - started
        outcome = "served" if self._instance_ready(model) else "ended"  # ended: refused or failed while it waited
        self.metrics.cold_start_seconds.labels(model, outcome).observe(waited)
        headers[COLD_START_HEADER] = str(round(waited * 1000))
        logger.info("request %s waited %.1f s for an instance of %s (a cold start)", prepared.response_id, waited,
                    model)
        return await answered()

    def _instance_ready(self, model: str) -> bool:
        return any(hb.model == model for hb in self.bus.ready_workers() or ())

    # --- state and health ---------------------------------------------------------------------

    async def _stored_event(self, request_id: str, prepared: PreparedRequest) -> RequestEvent | None:
        """The terminal event Redis holds for a request whose final event did not come (else None)."""
        loaded = await self.bus.load_request(request_id)
        return None if loaded is None else event_from_record(loaded[0], prepared.model.codec)

    async def request_state(self, request_id: str, owner: str = "") -> dict:
        loaded = None
        if len(request_id) <= MAX_REQUEST_ID_CHARS:
            try:
                loaded = await self.bus.load_request(request_id)
            except BusUnavailableError as exc:
                raise ApiError(503, str(exc), None, "unavailable", SERVER_ERROR,
                               {"Retry-After": str(self.settings.retry_after_s)}) from None
        if loaded is not None and self.settings.api_keys and loaded[0].owner != owner:
            loaded = None  # another key's request: as unknown as one that never existed
        if loaded is None:
            raise ApiError(404, f"request {request_id} not found (unknown, or expired after it finished)",
                           "request_id", "request_not_found")
        record, steps = loaded
        try:
            model = self.preparer.catalogue.get(record.model)
        except UnknownModelError:
            model = self.preparer.catalogue.models[0]  # an older record without a model name
        return request_info(record, steps, model.codec).model_dump()

    async def readiness(self) -> tuple[bool, dict]:
        state = await self.bus.readiness()
        served = {model.name for model in self.preparer.catalogue.models}
        ready = [hb for hb in state.workers if hb.status == WorkerStatus.READY and hb.model in served]
        # ready = this process can serve: NATS and Redis. Workers are the cluster's business: without
        # them the gateway still answers, with 503 + Retry-After (see _cold_start)
        missing = [name for name, ok in (("nats", state.nats_connected), ("redis", state.redis_ok)) if not ok]
        detail = dict(state.detail)
        if not ready:
            detail["worker"] = (f"no READY worker serving {', '.join(sorted(served))} was heard from within its "
                                f"lease ({len(state.workers)} live worker(s) of any status or model); "
                                f"completions get 503 with Retry-After")
        return not missing, {
            "ready": not missing, "missing": missing, "serving": bool(ready), "detail": detail,
            "workers": [{"instance_id": hb.instance_id, "model": hb.model, "status": WorkerStatus(hb.status).name,
                         "tp": hb.tp, "num_resident": hb.num_resident} for hb in state.workers],
        }


class _KeepAlive(Exception):
    """No event for ``sse_keepalive_s``: time for a keep-alive comment."""


class _ChunkClock:
    """The serving latencies of a stream as its client sees them: TTFT (the first text chunk), the gaps
    between text chunks, end to end (``GatewayMetrics``, label ``model_name``)."""

    def __init__(self, metrics: GatewayMetrics, prepared: PreparedRequest) -> None:
        self.metrics = metrics
        self.model = prepared.model.name
        self.arrival = prepared.request.arrival_time
        self.last: float | None = None  # when the last text chunk went out

    def text_sent(self) -> None:
        now = time.time()
        if self.last is None:
            self.metrics.ttft.labels(self.model).observe(max(now - self.arrival, 0.0))
        else:
            self.metrics.itl.labels(self.model).observe(now - self.last)
        self.last = now

    def done(self) -> None:
        self.metrics.e2e.labels(self.model).observe(max(time.time() - self.arrival, 0.0))


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (ASGI ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# --- errors --------------------------------------------------------------------------------------


def validation_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's 422 as OpenAI's 400, naming the first offending field."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    kind = first.get("type", "")
    if kind == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return ApiError(400, f"request body is not valid JSON ({reason})" if reason else
                        "request body is not valid JSON", None, "invalid_json")
    param = _param(first.get("loc", ()))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        if kind == "missing":
            return ApiError(400, "request body is required (a JSON object)", None, "missing_body")
        return ApiError(400, f"request body must be a JSON object ({message})", None, "invalid_body")
    if kind == "extra_forbidden":
        return ApiError(400, f"unknown field '{param}'", param, "unknown_field")
    if kind == "missing":
        return ApiError(400, f"{param}: field required", param, "missing_field")
    return ApiError(400, f"{param}: {message}", param, "invalid_value")


_UNION_TAGS = {"str", "int", "float", "bool", "none"}  # pydantic's names of a union's members in error locations


def _param(loc) -> str | None:
    """``('body', 'messages', 0, 'role')`` -> ``messages[0].role``; a union member's tag (``('body', 'stop',
    'list[str]', 0)``) is left out: the field is ``stop``."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, str) and (part in _UNION_TAGS or "[" in part):
            break  # the rest locates the value inside one of the union's members
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or None


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc)
        return JSONResponse(error.body(), status_code=error.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = SERVER_ERROR if exc.status_code >= 500 else "invalid_request_error"
        body = error_body(f"{request.method} {request.url.path}: {exc.detail}", error_type, None,
                          str(exc.status_code))
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        body = error_body(f"internal error: {type(exc).__name__}", SERVER_ERROR, None, "internal")
        return JSONResponse(body, status_code=500)


# --- the app -------------------------------------------------------------------------------------


SSE_EVENT = {  # one server-sent event of a streamed answer, as the OpenAPI 3.2 SSE item (data: JSON or [DONE])
    "type": "object",
    "properties": {"event": {"type": "string", "description": "'message' (a chunk), 'progress' or 'error'"},
                   "data": {"type": "string", "description": "a JSON chunk, or [DONE] at the end"},
                   "id": {"type": "string"}, "retry": {"type": "integer"}},
}


def _answered(body: type) -> dict:
    """OpenAPI 200 of a completion route: ``body`` as JSON, or server-sent events with ``stream``."""
    return {"model": body, "description": "the answer; with `stream: true`, server-sent events (`data:` lines "
            "of chunks, then `data: [DONE]`)", "content": {"text/event-stream": {"schema": SSE_EVENT}}}


def slo_estimator(settings: GatewaySettings, model: ServedModel) -> SloEstimator | None:
    """Default SLOs from the profile (``DLS_GATEWAY_PROFILE`` where one model is served, else the model's
    calibration's), or None (logged) if there is none or it is unusable: every request then gets
    ``DLS_GATEWAY_DEFAULT_SLO_MS``."""
    own = str(model.calibration.profile_path) if model.calibration is not None else ""
    path = (settings.profile if len(settings.served_model_dirs) == 1 else "") or own
    if not path:
        logger.warning("default SLOs are DLS_GATEWAY_DEFAULT_SLO_MS (%.0f ms): %s is uncalibrated, so no profile "
                       "times its steps", settings.default_slo_ms, model.name)
        return None
    try:
        profile = LatencyProfile.load(path).scaled(settings.profile_scale)
        return SloEstimator(profile, settings.default_slo_factor, settings.min_default_slo_ms)
    except ProfileError as exc:
        logger.warning("default SLOs are DLS_GATEWAY_DEFAULT_SLO_MS: the profile %s is unusable (%s)", path, exc)
        return None


def served_models(settings: GatewaySettings) -> ModelCatalogue:
    """Every model the settings serve (``DLS_GATEWAY_MODEL_DIRS``, else ``DLS_GATEWAY_MODEL_DIR``; named and
    calibrated as ``shared.served`` says); ``ModelLoadError`` naming the directory, or the setting, that is wrong."""
    try:
        served = served_models_of(settings, "DLS_GATEWAY_MODEL_DIRS")  # names, DLS_CALIBRATION_DIR the first's
    except DuplicateModelName as exc:
        raise ModelLoadError(str(exc)) from None
    models = [load_served_model(m.directory, settings.default_gen_length, settings.default_block_length,
                                settings.chat_template, settings.trust_remote_code, m.calibration_dir)
              for m in served]
    names = [m.name for m in models]
    unknown = sorted(set(settings.slo_ms_by_model) - set(names))
    if unknown:
        raise ModelLoadError(f"DLS_GATEWAY_MODEL_SLO_MS names {', '.join(unknown)}, which is not served "
                             f"(served: {', '.join(names)})")
    return ModelCatalogue(models)


def default_slos_of(settings: GatewaySettings, catalogue: ModelCatalogue, ask) -> dict[str, DefaultSlo]:
    """Each served model's default SLOs: the configured figure (``DLS_GATEWAY_MODEL_SLO_MS``), else timed
    with its profile."""
    fixed = settings.slo_ms_by_model
    return {m.name: DefaultSlo(None, ask, fixed[m.name], time.time, model=m.name) if m.name in fixed
            else DefaultSlo(slo_estimator(settings, m), ask, settings.default_slo_ms, time.time, model=m.name)
            for m in catalogue.models}


def create_app(settings: GatewaySettings, bus: Bus | None = None,
               rate_limiter: RedisRateLimiter | None = None, idempotency: IdempotencyStore | None = None) -> FastAPI:
    """The gateway app; ``bus``: a started ``Bus`` owned by the caller, or None for a ``GatewayBus``;
    ``rate_limiter``: a started one owned by the caller, or None for one on ``DLS_REDIS_URL`` when
    ``DLS_GATEWAY_RATE_LIMIT_PER_MIN`` is set; ``idempotency``: where retry keys live (None: in Redis with
    the ``GatewayBus``, in this process with a given bus)."""
    catalogue = served_models(settings)
    own_bus = GatewayBus(settings) if bus is None else None
    default_slos = default_slos_of(settings, catalogue, (bus or own_bus).predict)
    own_limiter = None
    if rate_limiter is None and settings.rate_limit_per_min > 0:
        own_limiter = RedisRateLimiter(settings.redis_url, settings.redis_key_prefix, settings.rate_limit_per_min,
                                       settings.retry_after_s)
    own_keys_client = None
    if idempotency is None and own_bus is not None:
        from shared.state import redis_client

        own_keys_client = redis_client(settings.redis_url, socket_connect_timeout=2.0, socket_timeout=2.0)
        idempotency = RedisIdempotency(own_keys_client, settings.redis_key_prefix)
    metrics = GatewayMetrics()
    gateway = Gateway(settings, RequestPreparer(settings, catalogue, default_slos), bus or own_bus,
                      rate_limiter or own_limiter, idempotency, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if own_bus is not None:
            await own_bus.start()
        if own_limiter is not None:
            await own_limiter.start()
        try:
            yield
        finally:
            await gateway.shutdown()
            if own_limiter is not None:
                await own_limiter.close()
            if own_keys_client is not None:
                await own_keys_client.aclose()
            if own_bus is not None:
                await own_bus.close()

    app = FastAPI(title="DiLaServe gateway", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions served by SLO-aware step-level scheduling")
    app.state.gateway = gateway
    _install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(ApiKeyMiddleware, api_keys=settings.api_keys)
    install_observability(app, metrics)  # added last: runs first (server span, request metrics, GET /metrics)

    @app.post("/v1/completions", response_model=None, responses={200: _answered(CompletionResponse),
                                                                  **COMPLETION_ERRORS})
    async def completions(body: CompletionBody, request: Request) -> Response:
        """A text completion (``stream``: server-sent events)."""
        return await gateway.complete(body, request)

    @app.post("/v1/chat/completions", response_model=None, responses={200: _answered(ChatCompletionResponse),
                                                                       **COMPLETION_ERRORS})
    async def chat_completions(body: ChatCompletionBody, request: Request) -> Response:
        """A chat completion (``stream``: server-sent events)."""
        return await gateway.complete(body, request)

    @app.get("/v1/models", response_model=ModelList, responses=LISTING_ERRORS)
    async def list_models() -> ModelList:
        """Every served model, with its state now (what its live workers' heartbeats say) and calibration."""
        workers = (await gateway.bus.readiness()).workers
        return ModelList(data=[model_card(m, model_state(m.name, workers)) for m in gateway.preparer.catalogue.models])

    @app.get("/v1/requests/{request_id}", response_model=RequestInfo, responses=READ_ERRORS)
    async def get_request(request_id: str, request: Request) -> dict:
        """A request's state from the request-state store (also after a 504)."""
        return await gateway.request_state(request_id, caller(request))

    @app.get("/health")
    async def health() -> dict:
        """Liveness: 200 while the process serves HTTP (as vLLM's and SGLang's ``/health``)."""
        return {"status": "ok"}

    @app.get("/healthz")
    async def healthz() -> dict:
        """The same as ``/health``."""
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"description": "what is missing"}})
    async def readyz() -> JSONResponse:
        """Readiness: 200 when this process can serve (NATS connected, intake in place, Redis answers),
        whether or not workers are up (``serving`` says whether a READY worker of the served model is
        alive; without one, completions get 503 with Retry-After)."""
        ready, body = await gateway.readiness()
        return JSONResponse(body, status_code=200 if ready else 503)

    mount_dashboard(app, gateway)  # /dashboard, /requests/{id}, /v1/cluster, /v1/requests/{id}/timeline
    derive_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            models = gateway.preparer.catalogue.models
            alphabets = {m.codec.alphabet for m in models}  # one closed alphabet for all, or none written
            alphabet = alphabets.pop() if len(alphabets) == 1 else None
            app.openapi_schema = constrain_openapi(derive_openapi(), [m.name for m in models],
                                                   settings.min_block_length, alphabet)
        return app.openapi_schema

    app.openapi = openapi
    return app
