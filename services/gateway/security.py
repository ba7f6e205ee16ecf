"""Who may use the gateway, and how much: key identities, per-key rate limits in Redis, admission.

- ``key_hash``: the identity a request remembers (``RequestRecord.owner``); a SHA-256 digest, never the
  key itself, so neither Redis nor a log line holds a usable secret. ``ApiKeyMiddleware`` puts the
  caller's hash in the ASGI scope's state (``caller(request)`` reads it back).
- ``RedisRateLimiter``: a fixed one-minute window per identity (``<prefix>:ratelimit:<identity>:<window>``,
  ``INCR`` + ``EXPIRE``), shared by every gateway replica; over ``DLS_GATEWAY_RATE_LIMIT_PER_MIN`` the
  answer is 429 with ``Retry-After`` = seconds to the next window. A Redis that does not answer lets
  requests through (logged once per outage): the limit protects capacity, Redis being down must not
  take serving down with it.
- ``Admission``: at most ``DLS_GATEWAY_MAX_IN_FLIGHT`` requests held open by this gateway; one more
  gets 429 with ``Retry-After`` at once, so a burst beyond what the cluster can serve queues nowhere
  without bound (the scheduler's load control rejects what it cannot serve in time).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Callable

from services.gateway.errors import RATE_LIMIT, ApiError

logger = logging.getLogger(__name__)

STATE_KEY = "dls_caller"  # ASGI scope["state"] entry: the caller's identity (a hash)
WINDOW_S = 60  # the rate limit's window
REDIS_TIMEOUT_S = 1.0  # a rate-limit check slower than this lets the request through


def key_hash(key: str) -> str:
    """The identity of an API key: ``k`` + 32 hex digits of its SHA-256 (not reversible)."""
    return "k" + hashlib.sha256(key.encode()).hexdigest()[:32]


def address_hash(host: str) -> str:
    """The identity of an unauthenticated client (no keys configured): its address, hashed alike."""
    return "a" + hashlib.sha256(host.encode()).hexdigest()[:32]


def caller(request) -> str:
    """The identity ``ApiKeyMiddleware`` found for ``request`` ("" when no keys are configured)."""
    return request.scope.get("state", {}).get(STATE_KEY, "")


def rate_identity(request) -> str:
    """What the rate limit counts: the key's hash, or without keys the client's address."""
    return caller(request) or address_hash(request.client.host if request.client else "unknown")


class RedisRateLimiter:
    """At most ``limit`` hits per identity per minute, counted in Redis."""

    def __init__(self, redis_url: str, prefix: str, limit: int, retry_after_floor_s: int = 1,
                 clock: Callable[[], float] = time.time, client=None) -> None:
        self.redis_url = redis_url
        self.prefix = prefix
        self.limit = limit
        self.retry_after_floor_s = retry_after_floor_s
        self.clock = clock
        self._client = client
        self._own_client = client is None
        self._down_logged = False

    async def start(self) -> None:
        if self._client is None:
            from shared.state import redis_client

            self._client = redis_client(self.redis_url, socket_connect_timeout=REDIS_TIMEOUT_S,
                                        socket_timeout=REDIS_TIMEOUT_S)

    async def close(self) -> None:
        if self._client is not None and self._own_client:
            await self._client.aclose()
            self._client = None

    async def check(self, identity: str) -> None:
        """Count one hit; ``ApiError`` 429 when ``identity`` is over the limit in this window."""
        if self.limit <= 0 or self._client is None:
            return
        now = self.clock()
        window = int(now // WINDOW_S)
        key = f"{self.prefix}:ratelimit:{identity}:{window}"
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                pipe = self._client.pipeline(transaction=True)
                pipe.incr(key)
                pipe.expire(key, WINDOW_S * 2)
                count, _ = await pipe.execute()
        except Exception as exc:  # noqa: BLE001 (Redis down: fail open, said once)
            if not self._down_logged:
                logger.warning("rate limit not enforced: Redis does not answer (%s)", type(exc).__name__)
                self._down_logged = True
            return
        self._down_logged = False
        if int(count) > self.limit:
            retry = max(self.retry_after_floor_s, math.ceil((window + 1) * WINDOW_S - now))
            raise ApiError(429, f"rate limit of {self.limit} requests per minute reached for this API key; "
                           f"retry in {retry} s", None, "rate_limit_exceeded", RATE_LIMIT,
                           {"Retry-After": str(retry)})


class Admission:
    """A bound on the requests held open at once (``enter`` raises 429 when it is reached)."""

    def __init__(self, max_in_flight: int, retry_after_s: int) -> None:
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.num_refused = 0

    def enter(self) -> None:
        if self.in_flight >= self.max_in_flight:
            self.num_refused += 1
            raise ApiError(429, f"the gateway is at its limit of {self.max_in_flight} requests in flight; "
                           f"retry in {self.retry_after_s} s", None, "overloaded", RATE_LIMIT,
                           {"Retry-After": str(max(1, self.retry_after_s))})
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)
