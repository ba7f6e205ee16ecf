"""The gateway's HTTP app: OpenAI-shaped completions over DiLaServe's step-level scheduler.

``create_app(settings, bus=None)`` loads the served model's tokenizer and the default-SLO estimator,
and wires the routes to a ``Bus`` (``GatewayBus`` on NATS and Redis unless one is given; a given bus
is the caller's to start and close). A request is validated and tokenized here
(``RequestPreparer``), submitted, and answered from its events: one JSON object, or server-sent
events when ``stream`` is set. No torch: the gateway never loads weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.answers import DONE, StreamFormatter, final_answer, model_card, request_info
from services.gateway.bus import Bus, BusUnavailableError, GatewayBus
from services.gateway.dashboard import mount_dashboard
from services.gateway.edge import ApiKeyMiddleware, BodyLimitMiddleware
from services.gateway.errors import SERVER_ERROR, ApiError, error_body, failure_error, invalid
from services.gateway.models import ModelCatalogue, UnknownModelError, load_served_model
from services.gateway.observability import install_observability, intake_headers
from services.gateway.prepare import PreparedRequest, RequestPreparer, new_request_id
from services.gateway.recovery import TrackedEvents, event_from_record
from services.gateway.schemas import (
    ChatCompletionBody,
    CompletionBody,
    ErrorResponse,
    ModelList,
    RequestInfo,
)
from services.gateway.security import Admission, RedisRateLimiter, caller, rate_identity
from services.gateway.slo import load_slo_estimator
from shared.messages.codec import PayloadTooLargeError
from shared.messages.control import WorkerStatus
from shared.messages.events import (
    RequestAccepted,
    RequestEvent,
    RequestFailed,
    RequestFinished,
    RequestProgress,
)
from shared.settings import GatewaySettings

logger = logging.getLogger(__name__)

CANCEL_WAIT_S = 2.0  # most time spent publishing a cancellation for a client that left
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first" (never seen by it)
MAX_REQUEST_ID_CHARS = 200

ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 401, 404, 409, 429, 500, 503, 504)}


class Gateway:
    """The request handling behind the routes: prepare, submit, answer."""

    def __init__(self, settings: GatewaySettings, preparer: RequestPreparer, bus: Bus,
                 rate_limiter: RedisRateLimiter | None = None) -> None:
        self.settings = settings
        self.preparer = preparer
        self.bus = bus
        self.rate_limiter = rate_limiter  # per-key limit in Redis (None: no limit)
        self.admission = Admission(settings.max_in_flight, settings.retry_after_s)

    # --- completions --------------------------------------------------------------------------

    async def complete(self, body: CompletionBody | ChatCompletionBody, request: Request) -> Response:
        self._refuse_without_workers()
        if self.rate_limiter is not None:
            await self.rate_limiter.check(rate_identity(request))
        self.admission.enter()  # 429 when this gateway holds max_in_flight requests already
        try:
            prepared = self.preparer.prepare(body, new_request_id(), time.time())
            owner = caller(request)
            if owner:
                prepared = dataclasses.replace(prepared, request=msgspec.structs.replace(prepared.request,
                                                                                          owner=owner))
        except BaseException:
            self.admission.leave()
            raise
        trace = intake_headers(prepared.request)  # the trace continues in the scheduler (observability.py)
        events = TrackedEvents(self.bus.submit(prepared.request, trace or None), prepared.request_id,
                               lambda rid: self._stored_event(rid, prepared), self.settings.result_poll_s,
                               self.admission.leave)
        deadline = asyncio.get_running_loop().time() + self.settings.request_timeout_s
        answer = self._open_stream if prepared.request.stream else self._answer
        return await self._unless_client_leaves(request, prepared, answer(prepared, events, deadline))

    async def _open_stream(self, prepared: PreparedRequest, events: AsyncIterator[RequestEvent],
                           deadline: float) -> Response:
        """The SSE response, once the request got past admission (a refusal is still a plain status)."""
        try:
            first = await self._next_event(prepared, events, deadline)
            while isinstance(first, RequestAccepted):  # admission may still refuse it: wait for more
                first = await self._next_event(prepared, events, deadline)
            if isinstance(first, RequestFailed):
                raise failure_error(first, self.settings.retry_after_s)
        except BaseException:
            await events.aclose()
            raise
        return StreamingResponse(self._stream(prepared, first, events, deadline), media_type="text/event-stream",
                                 headers={"X-Request-Id": prepared.request_id, "Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    async def _answer(self, prepared: PreparedRequest, events: AsyncIterator[RequestEvent],
                      deadline: float) -> Response:
        try:
            while True:
                event = await self._next_event(prepared, events, deadline)
                if isinstance(event, RequestFinished):
                    return JSONResponse(final_answer(prepared, event), headers={"X-Request-Id": prepared.request_id})
                if isinstance(event, RequestFailed):
                    raise failure_error(event, self.settings.retry_after_s)
        finally:
            await events.aclose()

    async def _stream(self, prepared: PreparedRequest, first: RequestEvent, events: AsyncIterator[RequestEvent],
                      deadline: float) -> AsyncIterator[str]:
        """SSE chunks; a client that leaves before the end gets its request cancelled."""
        formatter = StreamFormatter(prepared)
        event, ended = first, False
        try:
            while True:
                if isinstance(event, RequestProgress):
                    chunks = formatter.progress(event)
                elif isinstance(event, RequestFinished):
                    chunks, ended = formatter.finished(event), True
                elif isinstance(event, RequestFailed):
                    chunks, ended = [formatter.error(failure_error(event, self.settings.retry_after_s))], True
                else:
                    chunks = []  # RequestAccepted: nothing to show
                for chunk in chunks:
                    yield chunk
                if ended:
                    break
                try:
                    event = await self._next_event(prepared, events, deadline)
                except ApiError as error:  # timeout, NATS gone: said in-band, the status is already sent
                    ended = True
                    yield formatter.error(error)
                    break
            yield DONE
        finally:
            with anyio.CancelScope(shield=True):
                if not ended:
                    await self._cancel(prepared.request_id, "client disconnected")
                await events.aclose()

    async def _next_event(self, prepared: PreparedRequest, events: AsyncIterator[RequestEvent],
                          deadline: float) -> RequestEvent:
        rid = prepared.request_id
        try:
            async with asyncio.timeout_at(deadline):
                return await anext(events)
        except TimeoutError:
            raise ApiError(504, f"request {rid} did not finish within {self.settings.request_timeout_s:g} s; "
                           f"it may still be running: poll GET /v1/requests/{rid}", None, "timeout",
                           SERVER_ERROR) from None
        except StopAsyncIteration:
            raise ApiError(500, f"request {rid}: the event stream ended without a final event", None,
                           "internal", SERVER_ERROR) from None
        except BusUnavailableError as exc:
            raise ApiError(503, f"request {rid}: {exc}", None, "unavailable", SERVER_ERROR,
                           {"Retry-After": str(self.settings.retry_after_s)}) from None
        except PayloadTooLargeError as exc:
            raise invalid("prompt", f"prompt: request {rid} is too large to send ({exc})", "too_large") from None

    async def _unless_client_leaves(self, request: Request, prepared: PreparedRequest, answer) -> Response:
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
        await self._cancel(prepared.request_id, "client disconnected")
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def _cancel(self, request_id: str, reason: str) -> None:
        with anyio.move_on_after(CANCEL_WAIT_S):
            await self.bus.cancel(request_id, reason)

    def _refuse_without_workers(self) -> None:
        """503 with Retry-After, at once, when no READY instance of a served model is alive (nothing is
        queued for workers that are not there; the bus says None while it cannot tell yet)."""
        workers = self.bus.ready_workers()
        served = {model.name for model in self.preparer.catalogue.models}
        if workers is None or any(hb.model in served for hb in workers):
            return
        raise ApiError(503, f"no model instance serving {', '.join(sorted(served))} is up; retry after "
                       f"{self.settings.retry_after_s} s", None, "no_instance", SERVER_ERROR,
                       {"Retry-After": str(self.settings.retry_after_s)})

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
        # them the gateway still answers, with 503 + Retry-After (see _refuse_without_workers)
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


def _param(loc) -> str | None:
    """``('body', 'messages', 0, 'role')`` -> ``messages[0].role``."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
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


def create_app(settings: GatewaySettings, bus: Bus | None = None,
               rate_limiter: RedisRateLimiter | None = None) -> FastAPI:
    """The gateway app; ``bus``: a started ``Bus`` owned by the caller, or None for a ``GatewayBus``;
    ``rate_limiter``: a started one owned by the caller, or None for one on ``DLS_REDIS_URL`` when
    ``DLS_GATEWAY_RATE_LIMIT_PER_MIN`` is set."""
    model = load_served_model(settings.model_dir, settings.default_gen_length, settings.default_block_length,
                              settings.chat_template, settings.trust_remote_code)
    estimator = load_slo_estimator(model.directory, settings.profile, settings.default_slo_factor,
                                   settings.min_default_slo_ms, settings.profile_scale)
    own_bus = GatewayBus(settings) if bus is None else None
    own_limiter = None
    if rate_limiter is None and settings.rate_limit_per_min > 0:
        own_limiter = RedisRateLimiter(settings.redis_url, settings.redis_key_prefix, settings.rate_limit_per_min,
                                       settings.retry_after_s)
    gateway = Gateway(settings, RequestPreparer(settings, ModelCatalogue([model]), estimator), bus or own_bus,
                      rate_limiter or own_limiter)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if own_bus is not None:
            await own_bus.start()
        if own_limiter is not None:
            await own_limiter.start()
        try:
            yield
        finally:
            if own_limiter is not None:
                await own_limiter.close()
            if own_bus is not None:
                await own_bus.close()

    app = FastAPI(title="DiLaServe gateway", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions served by SLO-aware step-level scheduling")
    app.state.gateway = gateway
    _install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(ApiKeyMiddleware, api_keys=settings.api_keys)
    install_observability(app)  # added last: runs first (server span, request metrics, GET /metrics)

    @app.post("/v1/completions", response_model=None, responses=ERROR_RESPONSES)
    async def completions(body: CompletionBody, request: Request) -> Response:
        """A text completion (``stream``: server-sent events)."""
        return await gateway.complete(body, request)

    @app.post("/v1/chat/completions", response_model=None, responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionBody, request: Request) -> Response:
        """A chat completion (``stream``: server-sent events)."""
        return await gateway.complete(body, request)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[model_card(m) for m in gateway.preparer.catalogue.models])

    @app.get("/v1/requests/{request_id}", response_model=RequestInfo, responses=ERROR_RESPONSES)
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
    return app
