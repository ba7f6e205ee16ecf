"""Heartbeats on a thread of their own, so that a worker's liveness never waits for its compute.

A worker's event loop runs its steps' bookkeeping, and with an engine that runs on the loop (or a step
that holds the loop for any reason) a heartbeat task on the same loop would wait for the step: a step
longer than the lease TTL would then let the lease lapse while the worker is alive and working, and
the gateway would answer "no instance is up". ``BeatThread`` runs its own event loop and its own NATS
connection on a daemon thread and publishes the heartbeat that ``build`` returns every
``interval_s``; nothing the worker's loop does can delay it. ``build`` is called on this thread: it
reads the worker's status and counters (plain attribute reads) and numbers the beat under a lock
shared with the beats the worker sends itself (drain, stop), so the receivers' order by ``seq``
(``shared.leases``) holds across both connections.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 5.0  # longest ``stop`` waits for the thread to close its connection


class BeatThread:
    """Publishes ``build()`` on ``subject`` every ``interval_s`` from a daemon thread, over a NATS
    connection made by ``connect`` (a coroutine function, run on the thread's own loop)."""

    def __init__(self, connect: Callable[[], Awaitable], subject: str, interval_s: float,
                 build: Callable[[], bytes | None], name: str = "heartbeat") -> None:
        self._connect = connect
        self._subject = subject
        self._interval_s = interval_s
        self._build = build  # the next heartbeat's bytes; None: send nothing this time (the worker's loop is wedged)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.num_sent = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No beat after this returns (unless the thread is stuck past ``JOIN_TIMEOUT_S``, logged)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("heartbeat thread did not stop within %.0f s", JOIN_TIMEOUT_S)

    def _main(self) -> None:
        asyncio.run(self._loop())

    async def _loop(self) -> None:
        nc = None
        try:
            while not self._stop.is_set():
                try:
                    if nc is None:
                        nc = await self._connect()
                    data = None if self._stop.is_set() else self._build()
                    if data is not None:
                        await nc.publish(self._subject, data)
                        await nc.flush(timeout=self._interval_s)
                        self.num_sent += 1
                except Exception as exc:  # noqa: BLE001 (NATS reconnecting or not up yet: the next beat retries)
                    logger.warning("heartbeat failed: %s", exc)
                await asyncio.to_thread(self._stop.wait, self._interval_s)
        finally:
            if nc is not None:
                try:
                    await nc.close()
                except Exception as exc:  # noqa: BLE001
                    logger.debug("heartbeat connection close: %s", exc)
