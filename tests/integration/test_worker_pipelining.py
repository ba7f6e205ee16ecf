"""Pipelining at the worker, over real NATS and Redis: a conditional command (``after_step_id``) runs
the moment the step it follows ends, only when nothing about the batch changed; otherwise it is
discarded and the results say so. The engine is the FAKE zero-compute one (one token a step), paced
by the H100 profile so that a step lasts long enough for the conditional command to arrive during it."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from services.worker.engine.fake import FILL_ID, ZeroComputeEngine
from services.worker.service.service import WorkerService
from shared.messages import codec
from shared.messages.base import CacheMode
from shared.messages.steps import StepCommand, StepItem, StepResults
from shared.settings import WorkerSettings
from shared.state import RedisStateStore, RequestRecord
from shared.subjects import Subjects
from tests.integration.live import H100_PROFILE

pytestmark = pytest.mark.integration

INSTANCE = "pipe0"


def run(coro):
    return asyncio.run(coro)


class Bench:
    """One worker (FAKE engine), a NATS client posing as the scheduler, and the results it sees."""

    def __init__(self, nats_url: str, redis_url: str, prefix: str) -> None:
        self.nats_url, self.redis_url, self.prefix = nats_url, redis_url, prefix
        self.subjects = Subjects(prefix)
        self.results: list[StepResults] = []
        self.got = asyncio.Event()

    async def start(self) -> None:
        self.store = RedisStateStore.from_url(self.redis_url, self.prefix)
        self.worker_nc = await nats.connect(self.nats_url)
        settings = WorkerSettings(nats_url=self.nats_url, redis_url=self.redis_url, subject_prefix=self.prefix,
                                  redis_key_prefix=self.prefix, pace_profile=H100_PROFILE)
        self.worker = WorkerService(settings, ZeroComputeEngine(), self.worker_nc, self.store, instance_id=INSTANCE)
        await self.worker.start()
        self.nc = await nats.connect(self.nats_url)

        async def on_results(msg):
            self.results.append(codec.decode(StepResults, msg.data))
            self.got.set()

        await self.nc.subscribe(self.subjects.results, cb=on_results)
        await self.nc.flush()

    async def close(self) -> None:
        await self.worker.stop()
        await self.worker_nc.close()
        await self.nc.close()
        await self.store.close()

    async def request(self, rid: str, gen_length: int = 64, committed: int = 0) -> RequestRecord:
        """A stored request whose first ``committed`` canvas positions are filled already."""
        record = RequestRecord(
            request_id=rid, prompt_token_ids=[3, 4, 5], canvas=[FILL_ID] * committed + [1] * (gen_length - committed),
            mask_token_id=1, num_committed=committed,
            gen_length=gen_length, block_length=32, cache_mode=CacheMode.NONE, arrival_time=time.time(),
            deadline=time.time() + 60, slo_ms=60_000.0,
        )
        return await self.store.create(record)

    async def send(self, step_id: int, items: list[StepItem], after: int = 0, min_masked: int = 0,
                   drop: tuple[str, ...] = (), num_queued: int = 0, repeats: int = 0) -> None:
        command = StepCommand(instance_id=INSTANCE, step_id=step_id, items=items, issued_at=time.time(),
                              after_step_id=after, min_masked=min_masked, drop_request_ids=list(drop),
                              num_queued=num_queued, repeats=repeats)
        await self.nc.publish(self.subjects.step(INSTANCE), codec.encode(command))

    async def wait_results(self, count: int, timeout_s: float = 10.0) -> list[StepResults]:
        deadline = time.monotonic() + timeout_s
        while len(self.results) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.results)} of {count} results")
            self.got.clear()
            try:
                await asyncio.wait_for(self.got.wait(), 0.2)
            except TimeoutError:
                pass
        return self.results


def test_a_held_command_runs_right_after_its_step(nats_server, redis_server, unique_prefix):
    async def main():
        bench = Bench(nats_server.url, redis_server.url, unique_prefix)
        await bench.start()
        try:
            a, b = await bench.request("a"), await bench.request("b")
            first = [StepItem(request_id=r.request_id, threshold=0.9, state_version=r.version) for r in (a, b)]
            after = [StepItem(request_id=r.request_id, threshold=0.7, state_version=r.version + 1) for r in (a, b)]
            await bench.send(10, first, num_queued=3)
            await bench.send(11, after, after=10, min_masked=32)
            results = await bench.wait_results(2)
            assert results[0].step_id == 10 and results[0].continued_step_id == 11
            assert results[1].step_id == 11 and results[1].continued_step_id == 0
            assert [r.threshold for r in results[1].results] == [0.7, 0.7]  # the held command's thresholds
            assert [r.num_steps for r in results[1].results] == [2, 2]
            stored = await bench.store.load("a")
            assert stored.version == 3 and stored.threshold_history == [0.9, 0.7]
            assert bench.worker.held.num_continued == 1
            # each step record keeps what the scheduler had queued when it composed the step
            assert [s.queued for s in await bench.store.load_steps("a")] == [3, 0]
        finally:
            await bench.close()

    run(main())


def test_a_held_command_whose_batch_changed_is_discarded(nats_server, redis_server, unique_prefix):
    async def main():
        bench = Bench(nats_server.url, redis_server.url, unique_prefix)
        await bench.start()
        try:
            a, b = await bench.request("a"), await bench.request("b")
            item_a = StepItem(request_id="a", threshold=0.9, state_version=a.version)
            # too few tokens left for the condition
            await bench.send(20, [item_a])
            await bench.send(21, [StepItem(request_id="a", threshold=0.9, state_version=2)], after=20, min_masked=64)
            results = await bench.wait_results(1)
            # a request the step did not have
            await bench.send(22, [StepItem(request_id="a", threshold=0.9, state_version=2)])
            await bench.send(23, [StepItem(request_id="a", threshold=0.9, state_version=3),
                                  StepItem(request_id="b", threshold=0.9, state_version=b.version)],
                             after=22, min_masked=1)
            results = await bench.wait_results(2)
            # late: its step's results are out already
            await bench.send(24, [StepItem(request_id="a", threshold=0.9, state_version=3)], after=22, min_masked=1)
            await asyncio.sleep(0.5)
            assert [(r.step_id, r.continued_step_id) for r in results] == [(20, 0), (22, 0)]
            assert len(bench.results) == 2 and bench.worker.held.num_continued == 0
            assert bench.worker.held.num_late_next == 1
            assert (await bench.store.load("a")).num_steps == 2
        finally:
            await bench.close()

    run(main())


def test_a_block_start_goes_on_only_where_the_scheduler_said_it_would_stay(nats_server, redis_server, unique_prefix):
    async def main():
        bench = Bench(nats_server.url, redis_server.url, unique_prefix)
        await bench.start()
        try:
            # 31 of block 0's 32 positions filled: the next step completes the block
            a = await bench.request("a", committed=31)
            await bench.send(30, [StepItem(request_id="a", threshold=0.9, state_version=a.version)])
            await bench.send(31, [StepItem(request_id="a", threshold=0.9, state_version=2)], after=30)
            b = await bench.request("b", committed=31)
            await bench.send(32, [StepItem(request_id="b", threshold=0.9, state_version=b.version)])
            await bench.send(33, [StepItem(request_id="b", threshold=0.9, state_version=2, may_start_block=True)],
                             after=32)
            results = await bench.wait_results(3)
            assert [(r.step_id, r.continued_step_id) for r in results] == [(30, 0), (32, 33), (33, 0)]
            assert results[0].results[0].block_done and results[1].results[0].block_done
            assert results[2].results[0].block_index == 1  # the continued step started block 1
        finally:
            await bench.close()

    run(main())


def test_finished_requests_are_left_out_only_when_allowed(nats_server, redis_server, unique_prefix):
    async def main():
        bench = Bench(nats_server.url, redis_server.url, unique_prefix)
        await bench.start()
        try:
            # "last" has one masked position left: it finishes in the first step
            for k, drop in enumerate((False, True)):
                last, other = await bench.request(f"last{k}", committed=63), await bench.request(f"other{k}")
                first = [StepItem(request_id=r.request_id, threshold=0.9, state_version=r.version)
                         for r in (last, other)]
                after = [StepItem(request_id=r.request_id, threshold=0.9, state_version=r.version + 1)
                         for r in (last, other)]
                await bench.send(40 + 2 * k, first)
                command = StepCommand(instance_id=INSTANCE, step_id=41 + 2 * k, items=after, issued_at=time.time(),
                                      after_step_id=40 + 2 * k, drop_finished=drop)
                await bench.nc.publish(bench.subjects.step(INSTANCE), codec.encode(command))
                await bench.wait_results(1 + 2 * k)
            results = bench.results
            assert [(r.step_id, r.continued_step_id) for r in results] == [(40, 0), (42, 43), (43, 0)]
            assert [r.finished for r in results[1].results] == [True, False]
            assert [r.request_id for r in results[2].results] == ["other1"]  # the rest went on alone
        finally:
            await bench.close()

    run(main())


def test_a_held_command_that_comes_after_its_step_ended_runs_on_arrival(nats_server, redis_server, unique_prefix):
    """None in hand when the step ended (the results say ``awaits_held``): the first one that comes and
    passes the rule runs at once (the scheduler judges the same); a request new to the instance joins
    it from the store."""
    async def main():
        bench = Bench(nats_server.url, redis_server.url, unique_prefix)
        await bench.start()
        try:
            a, b = await bench.request("a"), await bench.request("b")
            await bench.send(30, [StepItem(request_id="a", threshold=0.9, state_version=a.version)])
            [first] = await bench.wait_results(1)
            assert first.awaits_held and first.continued_step_id == 0
            joined = [StepItem(request_id="a", threshold=0.7, state_version=a.version + 1),
                      StepItem(request_id="b", threshold=0.9, state_version=b.version, load_state=True)]
            await bench.send(31, joined, after=30)
            results = await bench.wait_results(2)
            assert results[1].step_id == 31 and [r.request_id for r in results[1].results] == ["a", "b"]
            assert [r.threshold for r in results[1].results] == [0.7, 0.9]
            assert bench.worker.held.num_late_held == 1 and bench.worker.held.num_continued == 0
            # another one for the same step: that step went on already
            await bench.send(32, [StepItem(request_id="a", threshold=0.7, state_version=a.version + 1)], after=30)
            await asyncio.sleep(0.5)
            assert len(bench.results) == 2 and bench.worker.held.num_late_next == 1
            assert (await bench.store.load("a")).num_steps == 2
        finally:
            await bench.close()

    run(main())


def test_a_held_command_drops_the_requests_that_left_the_instance(nats_server, redis_server, unique_prefix):
    """A request that moved away (migrated, preempted, cancelled) while the instance goes from one held
    step to the next: the held command that runs drops its copy and KV cache, as a plain command would."""
    async def main():
        bench = Bench(nats_server.url, redis_server.url, unique_prefix)
        await bench.start()
        try:
            a, gone = await bench.request("a"), await bench.request("gone")
            await bench.send(40, [StepItem(request_id="gone", threshold=0.9, state_version=gone.version)])
            await bench.wait_results(1)
            assert "gone" in bench.worker.resident
            await bench.send(41, [StepItem(request_id="a", threshold=0.9, state_version=a.version, load_state=True)])
            await bench.send(42, [StepItem(request_id="a", threshold=0.9, state_version=a.version + 1)], after=41,
                             drop=("gone",))
            results = await bench.wait_results(3)
            assert results[1].continued_step_id == 42 and results[2].step_id == 42
            assert "gone" not in bench.worker.resident and "a" in bench.worker.resident
        finally:
            await bench.close()

    run(main())


def test_with_none_in_hand_a_step_repeats_and_a_late_command_takes_over(nats_server, redis_server, unique_prefix):
    """A command with repeats runs again under the next ids while no held command has come (the
    scheduler lags); one sent after an earlier step of that chain, arriving late, runs after its latest."""
    async def main():
        bench = Bench(nats_server.url, redis_server.url, unique_prefix)
        await bench.start()
        try:
            a = await bench.request("a")
            await bench.send(10, [StepItem(request_id="a", threshold=0.9, state_version=a.version)], repeats=2)
            results = await bench.wait_results(3)
            assert [(r.step_id, r.continued_step_id) for r in results] == [(10, 11), (11, 12), (12, 0)]
            assert results[2].awaits_held  # repeats spent: it waits for a command
            assert [r.results[0].threshold for r in results] == [0.9, 0.9, 0.9]
            assert (await bench.store.load("a")).version == a.version + 3
            assert bench.worker.held.num_repeated == 2

            b = await bench.request("b")
            await bench.send(20, [StepItem(request_id="b", threshold=0.9, state_version=b.version)], repeats=5)
            await bench.wait_results(4)  # B's first step is out: 21, its repeat, runs now
            await bench.send(30, [StepItem(request_id="b", threshold=0.6, state_version=b.version + 1)], after=20)
            while not any(r.step_id == 30 for r in bench.results):
                await bench.wait_results(len(bench.results) + 1)
            results = bench.results
            chain = [r for r in results[3:] if r.step_id < 30]
            assert [r.step_id for r in chain] == list(range(20, 20 + len(chain)))  # repeats, in order
            assert chain[-1].continued_step_id == 30 and not chain[-1].awaits_held
            after = next(r for r in results if r.step_id == 30)
            assert after.results[0].threshold == 0.6  # the scheduler's command took over
            assert after.results[0].state_version == b.version + len(chain) + 1
        finally:
            await bench.close()

    run(main())
