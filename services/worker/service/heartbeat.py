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

``Heartbeats`` is a worker's side of it: what a heartbeat says (``WorkerHeartbeat``, with the KV pool's
memory, ``kv_beat``), numbered under one lock whichever thread sends it; from the beat thread when the
worker has a connection of its own for heartbeats, else from a task on the worker's loop. The beat
thread withholds heartbeats while the worker's loop is wedged outside any step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from shared.messages import codec
from shared.messages.control import KVMemory as KVMemoryBeat
from shared.messages.control import WorkerHeartbeat

if TYPE_CHECKING:
    from services.worker.kv.pages import KVMemory
    from services.worker.service.service import WorkerService

logger = logging.getLogger(__name__)
worker_logger = logging.getLogger("dls.worker")

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


class Heartbeats:
    """The heartbeats of one worker service, each a snapshot of what it reads of the service (it changes
    nothing there). ``connect``: makes a NATS connection of their own, for the beat thread; None: they go
    from a task on the worker's loop over the service's connection."""

    def __init__(self, service: WorkerService, connect: Callable[[], Awaitable] | None) -> None:
        self.service = service
        self._connect = connect
        self._lock = threading.Lock()  # numbers heartbeats built on the worker's loop and on the beat thread
        self.num_sent = 0  # built by this process (each heartbeat's seq)
        self._thread: BeatThread | None = None
        self._loop_tick = time.monotonic()  # when the worker's loop last ran its tick task (the beat thread reads it)
        self._wedged_logged = False

    def start(self) -> asyncio.Task:
        """The periodic heartbeats begin; the task returned keeps them (or the loop's tick) going."""
        service = self.service
        interval_s = service.settings.heartbeat_interval_s
        if self._connect is None:
            return asyncio.create_task(self._loop(interval_s), name="heartbeat")
        self._thread = BeatThread(self._connect, service.subjects.heartbeat, interval_s, self._live_bytes,
                                  name=f"heartbeat-{service.instance_id}")
        task = asyncio.create_task(self._tick_loop(interval_s), name="loop-tick")
        self._thread.start()
        return task

    async def stop(self) -> None:
        """No periodic heartbeat after this returns."""
        if self._thread is not None:
            await asyncio.to_thread(self._thread.stop)

    async def send(self) -> None:
        """One heartbeat now, from the worker's loop (a change of status)."""
        await self.service.nc.publish(self.service.subjects.heartbeat, self.encoded())

    def encoded(self) -> bytes:
        """The next heartbeat, encoded (called on the worker's loop and on the beat thread: numbered under a lock)."""
        with self._lock:
            beat = self._payload(self.num_sent + 1)
            self.num_sent += 1
        return codec.encode(beat, self.service.settings.max_payload_bytes)

    def _payload(self, seq: int) -> WorkerHeartbeat:
        service, settings = self.service, self.service.settings
        paced = service.pace is not None
        metrics_server = service.metrics_server
        return WorkerHeartbeat(
            instance_id=service.instance_id, node=settings.node, tp=settings.tp, gpu_ids=list(settings.gpu_ids),
            max_batch=settings.max_batch, model=service.engine.name, profile=service.profile_name,
            profile_scale=settings.pace_scale if paced else 1.0,
            profile_context_tokens=(settings.pace_context_tokens or 0) if paced else 0,
            status=service.status, num_resident=len(service.resident),
            ttl_s=settings.lease_ttl_s, sent_at=service.clock(), started_at=service.started_at,
            metrics_port=metrics_server.server_port if metrics_server is not None else 0,
            shard=service.shard, seq=seq, step_running_s=service.step_running_s(),
            kv=kv_beat(service.engine.kv_memory(), settings.max_batch),
            measured=service.online.wire() if service.online is not None else None,
        )


    def _live_bytes(self) -> bytes | None:
        """The beat thread's next heartbeat, or None while the worker's loop is wedged outside any step: not
        ticked for a lease while no engine step computes. A step that holds the loop keeps the lease (its
        ``step_running_s`` reports it, and the scheduler's step timeout deals with a step that never
        returns); a loop stuck anywhere else lets the lease lapse, as a silent worker's does."""
        service = self.service
        computing = service.step_running_s() > 0
        wedged = not computing and time.monotonic() - self._loop_tick > service.settings.lease_ttl_s
        if wedged != self._wedged_logged:
            self._wedged_logged = wedged
            (worker_logger.warning if wedged else worker_logger.info)(
                "worker %s: event loop %s", service.instance_id,
                "wedged outside any step: heartbeats withheld" if wedged else "answers again: heartbeats resume")
        return None if wedged else self.encoded()

    async def _loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.send()
            except Exception as exc:  # noqa: BLE001 (NATS reconnecting: the next beat retries)
                worker_logger.warning("heartbeat failed: %s", exc)

    async def _tick_loop(self, interval_s: float) -> None:
        while True:
            self._loop_tick = time.monotonic()
            await asyncio.sleep(interval_s)


def kv_beat(memory: KVMemory, max_batch: int) -> KVMemoryBeat | None:
    """The KV pool as the heartbeat reports it (plain counter reads: safe from the beat thread); None for
    an engine that keeps none (no bytes per position: the zero-compute fake)."""
    m = memory
    if not m.bytes_per_token:
        return None
    return KVMemoryBeat(
        budget_bytes=m.budget_bytes, pool_bytes=m.pool_bytes, used_bytes=m.used_bytes, free_bytes=m.free_bytes,
        used_tokens=m.used_tokens, free_tokens=m.free_bytes // m.bytes_per_token if m.bytes_per_token else 0,
        capacity_tokens=m.capacity_tokens(max_batch), bytes_per_token=m.bytes_per_token,
        page_tokens=m.page_tokens)
