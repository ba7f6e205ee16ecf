"""A worker busy with steps longer than its lease TTL stays alive to the scheduler and the gateway: its
heartbeats go from a thread of their own (``services.worker.service.heartbeat``), which nothing on its event loop can
delay. The worker runs on an event loop of its own thread (as in a process of its own) with a FAKE engine
that holds that loop for longer than the lease at every step; the scheduler and the gateway's bus run on
the test's loop against real nats-server and redis-server. The same worker with its heartbeats on its
event loop (as before) is declared dead mid-step: that half shows the test can fail. A loop wedged
outside any step still lets the lease lapse: the beat thread withholds heartbeats then."""

from __future__ import annotations

import asyncio
import threading
import time

import nats
import pytest

from services.gateway.bus import GatewayBus
from services.worker.engine.fake import ZeroComputeEngine
from services.worker.service.service import WorkerService
from shared.messages.events import RequestFinished
from shared.settings import GatewaySettings, WorkerSettings
from shared.state import RedisStateStore
from tests.integration.live import LiveCluster

pytestmark = pytest.mark.integration

LEASE_TTL_S = 1.5
HOLD_S = 2.5  # each step holds the worker's event loop this long: beyond the lease


class LoopHoldingEngine(ZeroComputeEngine):
    """FAKE: a zero-compute engine whose every step holds the calling thread (the worker's event loop,
    as ``blocking = False`` runs it there) for ``HOLD_S``."""

    name = "loop-holding"

    def step(self, batch):
        time.sleep(HOLD_S)
        return super().step(batch)


class ThreadedWorker:
    """A worker service on an event loop of its own thread."""

    def __init__(self, cluster: LiveCluster, instance_id: str, threaded_beats: bool) -> None:
        self.cluster, self.instance_id, self.threaded_beats = cluster, instance_id, threaded_beats
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.service: WorkerService | None = None

    def call(self, coro):
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def _start(self) -> None:
        url = self.cluster.nats_url
        settings = WorkerSettings(**self.cluster.common, heartbeat_interval_s=0.3, lease_ttl_s=LEASE_TTL_S)
        self.nc = await nats.connect(url)
        self.store = RedisStateStore.from_url(self.cluster.redis_url, self.cluster.prefix)
        beat_connect = (lambda: nats.connect(url)) if self.threaded_beats else None
        self.service = WorkerService(settings, LoopHoldingEngine(tokens_per_step=4), self.nc, self.store,
                                     instance_id=self.instance_id, beat_connect=beat_connect)
        await self.service.start()

    async def _stop(self) -> None:
        await self.service.stop()
        await self.nc.close()
        await self.store.close()

    async def start(self) -> None:
        await self.call(self._start())

    async def stop(self) -> None:
        await self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def _watch(cluster: LiveCluster, bus: GatewayBus, instance_id: str, until: asyncio.Task) -> list[str]:
    """Where the instance was missing (scheduler's instances, gateway's READY workers) while ``until`` ran."""
    missing = []
    while not until.done():
        if instance_id not in cluster.scheduler.instances:
            missing.append("scheduler")
        ready = bus.ready_workers()
        if ready is not None and instance_id not in {hb.instance_id for hb in ready}:
            missing.append("gateway")
        await asyncio.sleep(0.05)
    return missing


async def _run(nats_url: str, redis_url: str, prefix: str, threaded_beats: bool) -> tuple[list[str], object]:
    cluster = LiveCluster(nats_url, redis_url, prefix, policy="fixed",
                          scheduler_overrides={"step_timeout_s": 30.0})
    await cluster.start(num_workers=0)
    bus = GatewayBus(GatewaySettings(**cluster.common))
    await bus.start()
    worker = ThreadedWorker(cluster, "busy", threaded_beats)
    try:
        await worker.start()
        await cluster.wait_for(lambda: "busy" in cluster.scheduler.instances, what="the worker joined")
        await cluster.wait_for(lambda: bus.ready_workers() is not None, timeout_s=30, what="the gateway's grace")
        assert "busy" in {hb.instance_id for hb in bus.ready_workers()}
        submitted = asyncio.create_task(cluster.submit([5, 6, 7], gen_length=16, block_length=16))
        missing = await _watch(cluster, bus, "busy", submitted)
        return missing, submitted.result() if submitted.exception() is None else submitted.exception()
    finally:
        await worker.stop()
        await bus.close()
        await cluster.close()


def test_a_worker_busy_with_steps_longer_than_its_lease_stays_alive(nats_server, redis_server, unique_prefix):
    missing, outcome = asyncio.run(_run(nats_server.url, redis_server.url, unique_prefix, threaded_beats=True))
    assert missing == []
    final = outcome.final
    assert isinstance(final, RequestFinished), final
    assert final.usage.num_steps == 4 and final.usage.instance_ids == ["busy"]  # 4 steps of HOLD_S each


def test_with_heartbeats_on_its_event_loop_the_same_worker_is_declared_dead_mid_step(nats_server, redis_server,
                                                                                    unique_prefix):
    missing, _ = asyncio.run(_run(nats_server.url, redis_server.url, unique_prefix, threaded_beats=False))
    assert "scheduler" in missing and "gateway" in missing


def test_a_worker_whose_event_loop_is_wedged_outside_any_step_is_declared_dead(nats_server, redis_server,
                                                                               unique_prefix):
    async def main() -> list[str]:
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix, policy="fixed")
        await cluster.start(num_workers=0)
        worker = ThreadedWorker(cluster, "wedged", threaded_beats=True)
        try:
            await worker.start()
            await cluster.wait_for(lambda: "wedged" in cluster.scheduler.instances, what="the worker joined")
            worker.loop.call_soon_threadsafe(time.sleep, 3 * LEASE_TTL_S)  # no step runs: the loop is wedged
            await cluster.wait_for(lambda: "wedged" not in cluster.scheduler.instances, timeout_s=3 * LEASE_TTL_S,
                                   what="the wedged worker's lease lapsing")
            await cluster.wait_for(lambda: "wedged" in cluster.scheduler.instances, timeout_s=10,
                                   what="the worker back once its loop answers")
        finally:
            await worker.stop()
            await cluster.close()

    asyncio.run(main())
