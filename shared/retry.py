"""Retrying a call to Redis (or JetStream) while the server restarts, fails over or elects a leader.

The Redis client (``shared.state.redis_client``) already reconnects and retries each call a few times
within about 15 s; ``retry_transient`` is the service-level loop around that for the paths that must
not give up (a worker's step write, a scheduler's reload of a request): it keeps retrying a
connection error with exponential back-off, logging once per outage, for up to ``give_up_after_s``.
Anything but a connection problem (a stale write, a missing record) is raised at once.

The same loop serves JetStream's API (``shared.jetstream.JETSTREAM_TRANSIENT_ERRORS``): while a NATS
node is down, or the cluster elects a new meta leader, its requests time out or answer 503 for a few
seconds, and a service starting then must wait for it rather than exit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

T = TypeVar("T")

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, ConnectionError,
                                                      TimeoutError)
FIRST_DELAY_S = 0.1
MAX_DELAY_S = 2.0
GIVE_UP_AFTER_S = 300.0


async def retry_transient(call: Callable[[], Awaitable[T]], what: str, logger: logging.Logger, *,
                          give_up_after_s: float = GIVE_UP_AFTER_S,
                          errors: tuple[type[BaseException], ...] = TRANSIENT_ERRORS, peer: str = "Redis") -> T:
    """``await call()``, retried on ``errors`` (by default Redis's connection errors) with back-off; the
    last error after the deadline. ``peer`` names what is unreachable in the log lines."""
    deadline = time.monotonic() + give_up_after_s
    delay = FIRST_DELAY_S
    failures = 0
    while True:
        try:
            result = await call()
        except errors as exc:
            failures += 1
            if failures == 1:
                logger.warning("%s: %s unreachable (%s: %s); retrying with back-off", what, peer, type(exc).__name__,
                               exc)
            if time.monotonic() + delay > deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(MAX_DELAY_S, delay * 2)
            continue
        if failures:
            logger.info("%s: %s answered again after %d failed attempt(s)", what, peer, failures)
        return result
