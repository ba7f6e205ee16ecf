"""A request's events, with Redis as the fallback when the final event never comes.

Events travel on core NATS (at most once): a worker killed between storing a FINISHED state and
publishing ``RequestFinished``, a NATS node lost while the event was on its way, or a scheduler that
died before telling the gateway about a rejection all leave the gateway waiting. ``TrackedEvents``
wraps the bus's event iterator: when no event came for ``poll_s``, it reads the request's record from
Redis, and a terminal record becomes the event that should have come (``event_from_record``), built
with the served model's tokenizer exactly as the worker builds it. The wait for the next event is a
task kept across polls, so a poll never tears down the subscription.

It also holds the request's admission slot (``release``, called once, when it is closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from services.gateway.bus import BusUnavailableError
from shared.messages.events import FailureReason, RequestEvent, RequestFailed, RequestFinished, Usage
from shared.state import RequestRecord, RequestStatus

logger = logging.getLogger(__name__)


def event_from_record(record: RequestRecord, codec) -> RequestEvent | None:
    """The terminal event a terminal ``record`` stands for; None while it is in flight."""
    if record.status == RequestStatus.FINISHED:
        eos = getattr(getattr(codec, "tokenizer", None), "eos_token_id", None)
        tokens = record.answer(eos).token_ids
        latency = (record.finished_at or record.arrival_time) - record.arrival_time
        usage = Usage(prompt_tokens=len(record.prompt_token_ids), completion_tokens=len(tokens),
                      num_steps=record.num_steps, num_recompute_steps=record.num_recompute_steps,
                      thresholds=list(record.threshold_history), instance_ids=list(record.instance_history),
                      num_migrations=record.num_migrations, latency_s=latency,
                      slo_met=latency * 1000.0 <= record.slo_ms)
        return RequestFinished(request_id=record.request_id, seq=record.num_steps + 2,
                               text=codec.decode([t for t in tokens if t != record.mask_token_id]),
                               token_ids=tokens, finish_reason=record.finish_reason or "stop", usage=usage,
                               logprobs=record.token_logprobs(0, len(tokens)))
    if record.status == RequestStatus.CANCELLED:
        reason = FailureReason.CANCELLED
    elif record.status == RequestStatus.REJECTED:
        reason = next((r for r in FailureReason if r.name in record.detail.upper().replace(" ", "_")),
                      FailureReason.NO_INSTANCE)
    else:
        return None
    return RequestFailed(request_id=record.request_id, seq=record.num_steps + 2, reason=reason,
                         detail=record.detail)


class TrackedEvents:
    """The events of one request: the bus's, else what Redis says after ``poll_s`` of silence."""

    def __init__(self, events: AsyncIterator[RequestEvent], request_id: str,
                 lookup: Callable[[str], Awaitable[RequestEvent | None]], poll_s: float,
                 release: Callable[[], None] = lambda: None, check_first: bool = False) -> None:
        """``check_first``: look in Redis at once, before waiting (a retry joining a request that may have
        finished already: its final event went out before this gateway listened)."""
        self._events = events
        self.request_id = request_id
        self._lookup = lookup
        self.poll_s = poll_s
        self._release = release
        self._pending: asyncio.Future | None = None
        self._closed = False
        self._check_now = check_first
        self.num_recovered = 0  # terminal events built from Redis

    def __aiter__(self) -> TrackedEvents:
        return self

    async def __anext__(self) -> RequestEvent:
        while True:
            if self._pending is None:
                self._pending = asyncio.ensure_future(anext(self._events))
            check_now, self._check_now = self._check_now, False
            if check_now:
                await asyncio.sleep(0)  # let the subscription be made before Redis is read
            done, _ = await asyncio.wait({self._pending}, timeout=0 if check_now else self.poll_s)
            if done:
                pending, self._pending = self._pending, None
                return pending.result()  # StopAsyncIteration, BusUnavailableError pass through
            try:
                event = await self._lookup(self.request_id)
            except BusUnavailableError as exc:
                logger.debug("request %s: no event and Redis unreadable (%s)", self.request_id, exc)
                continue
            if event is not None:
                self.num_recovered += 1
                logger.info("request %s: final event never came; answering from its stored state",
                            self.request_id)
                return event

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._pending is not None and not self._pending.done():
                self._pending.cancel()
                with contextlib.suppress(BaseException):
                    await self._pending
            elif self._pending is not None and not self._pending.cancelled():
                self._pending.exception()  # retrieved: no "never retrieved" warning
            await self._events.aclose()
        finally:
            self._release()

    def __del__(self) -> None:  # a response never iterated: its admission slot is still freed
        if not self._closed:
            self._closed = True
            self._release()
