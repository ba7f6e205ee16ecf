"""Faults the scheduler must see through, over real NATS and Redis: a worker whose step never returns
while its heartbeats go on (hung), a worker whose clock is a minute off (skewed), and JetStream not
answering while the scheduler starts."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from shared.messages.events import RequestFinished
from shared.runtime import free_port
from tests.integration.conftest import nats_server_binary, start_server, stop_server
from tests.integration.live import H100_PROFILE, LiveCluster, engine, fresh_engine, offline_tokens

pytestmark = pytest.mark.integration

PROMPTS = ["12+30=", "7*6=", "100-58=", "21+21="]


class HangingEngine:
    """FAKE: the bundled model's engine, except that its first step with requests never returns (until
    ``release``); the worker runs steps in a thread, so its heartbeats go on meanwhile."""

    def __init__(self) -> None:
        self._engine = fresh_engine()
        self.hung = threading.Event()  # its step is stuck
        self._release = threading.Event()

    def step(self, batch):
        if batch:
            self.hung.set()
            self._release.wait()
            raise RuntimeError("released after the test")
        return self._engine.step(batch)

    def release(self) -> None:
        self._release.set()

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_a_worker_whose_step_never_returns_loses_no_request(nats_server, redis_server, unique_prefix):
    """Its step is lost after DLS_SCHEDULER_STEP_TIMEOUT_S; its heartbeats then report the stuck step, so
    the scheduler does not take it back; its requests finish on the other worker with the engine's tokens."""
    hanging = HangingEngine()

    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix, policy="fixed",
                              scheduler_overrides={"step_timeout_s": 2.0})
        await cluster.start(num_workers=0)
        stuck = await cluster.add_worker("hung", engine=hanging, pace_profile=H100_PROFILE)
        try:
            prompts = [engine().encode(p) for p in PROMPTS]
            submitted = [asyncio.create_task(cluster.submit(p)) for p in prompts]
            await cluster.wait_for(hanging.hung.is_set, what="the hung worker's first step")
            await cluster.add_worker("healthy", pace_profile=H100_PROFILE)
            outcomes = await asyncio.gather(*submitted)
            for prompt, outcome in zip(prompts, outcomes, strict=True):
                final = outcome.final
                assert isinstance(final, RequestFinished), final
                assert final.token_ids == offline_tokens(prompt, final.usage.thresholds)
                assert final.usage.instance_ids[-1] == "healthy"
            # alive (it still beats) but reporting its stuck step: not taken back
            assert stuck.step_running_s() > 2.0
            await asyncio.sleep(1.0)
            assert "hung" not in cluster.scheduler.instances and "hung" in cluster.scheduler.leases
            assert cluster.scheduler.counters["lost_steps"] >= 1
        finally:
            hanging.release()
            await cluster.close()

    asyncio.run(main())


@pytest.mark.parametrize("offset_s", [-60.0, 60.0])
def test_a_skewed_worker_keeps_serving_and_is_dropped_once_it_dies(nats_server, redis_server, unique_prefix,
                                                                    offset_s):
    """Its heartbeats' sent_at are a minute off the scheduler's clock (DLS_TEST_CLOCK_OFFSET_S): it is
    never dropped while it beats, and dropped within its lease once it goes silent."""
    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix, policy="fixed")
        await cluster.start(num_workers=0)
        worker = await cluster.add_worker("skewed", clock_offset_s=offset_s, pace_profile=H100_PROFILE)
        assert abs(worker.clock() - offset_s - time.time()) < 1.0
        dropped = []

        async def watch():
            while True:
                if "skewed" not in cluster.scheduler.view.instances:
                    dropped.append(True)
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        try:
            for i in range(4):  # several lease lengths (1.5 s) of serving
                prompt = engine().encode(PROMPTS[i])
                final = (await cluster.submit(prompt)).final
                assert isinstance(final, RequestFinished), final
                assert final.usage.instance_ids == ["skewed"]
                await asyncio.sleep(0.5)
            assert not dropped, "the skewed worker was dropped while it was alive"
            watcher.cancel()
            for task in worker._tasks:  # silence, as a killed process
                task.cancel()
            await worker._subscription.unsubscribe()
            await cluster.wait_for(lambda: "skewed" not in cluster.scheduler.view.instances, timeout_s=10.0,
                                   what="the silent worker dropped")
            assert "skewed" not in cluster.scheduler.leases
        finally:
            watcher.cancel()
            await cluster.close()

    asyncio.run(main())


def test_a_scheduler_started_while_jetstream_cannot_answer_waits_for_it(tmp_path, redis_server, unique_prefix):
    """A scheduler (re)started while its NATS server has no JetStream to answer (a node down, a leader
    election: the API times out or answers 503) waits for it instead of exiting, and serves once it is back."""
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    plain = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)]  # core NATS only: the JetStream API is silent
    server = start_server("nats-server", plain, port, url, tmp_path / "plain.log", b"", b"INFO")

    async def main():
        nonlocal server
        cluster = LiveCluster(url, redis_server.url, unique_prefix, policy="fixed")
        starting = asyncio.create_task(cluster.start_scheduler())
        try:
            await asyncio.sleep(3.0)
            assert not starting.done(), f"the scheduler gave up without JetStream: {starting.exception()!r}"
            stop_server(server.process)  # the same port, now with JetStream
            server = start_server("nats-server", [*plain, "-js", "-sd", str(tmp_path / "store")], port, url,
                                  tmp_path / "js.log", b"", b"INFO")
            await asyncio.wait_for(starting, 30.0)
            cluster.client = await cluster._connect()
            cluster.js = cluster.client.jetstream()
            await cluster.add_worker("w0", pace_profile=H100_PROFILE)
            prompt = engine().encode(PROMPTS[0])
            final = (await cluster.submit(prompt)).final
            assert isinstance(final, RequestFinished), final
            assert final.token_ids == offline_tokens(prompt, final.usage.thresholds)
        finally:
            starting.cancel()
            await cluster.close()

    try:
        asyncio.run(main())
    finally:
        stop_server(server.process)
