"""The scheduler and worker services over real NATS and Redis, step by step: answers, concurrency,
migration, streaming order, a lost worker. Requests are published to the intake as the gateway does."""

from __future__ import annotations

import asyncio

import pytest

from services.worker.engine.engine import CacheMode
from shared.messages.base import CacheMode as WireCacheMode
from shared.messages.events import RequestAccepted, RequestFinished, RequestProgress
from shared.state import RedisStateStore, RequestStatus
from shared.tasks import Split, TaskGenerator, check_answer
from tests.integration.live import H100_PROFILE, LiveCluster, engine, offline_tokens

pytestmark = pytest.mark.integration


def problems(count: int, max_shots: int = 2, seed: int = 7):
    return TaskGenerator(seed=seed).problems(count, max_shots=max_shots, split=Split.HELD_OUT)


def run(coro):
    return asyncio.run(coro)


def test_a_request_is_answered_correctly(nats_server, redis_server, unique_prefix):
    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix, policy="fixed")
        await cluster.start(num_workers=1)
        try:
            prompt = "12+30="
            outcome = await cluster.submit(engine().encode(prompt))
            final = outcome.final
            assert isinstance(outcome.events[0], RequestAccepted)
            assert isinstance(final, RequestFinished), final
            assert final.text.strip() == "42"
            assert final.usage.num_steps == len(final.usage.thresholds) >= 1
            assert set(final.usage.thresholds) == {0.9}  # the fixed policy's threshold
            store = RedisStateStore.from_url(redis_server.url, unique_prefix)
            record = await store.load(outcome.request_id)
            steps = await store.load_steps(outcome.request_id)
            assert record.status == RequestStatus.FINISHED and len(steps) == final.usage.num_steps
            await store.close()
        finally:
            await cluster.close()

    run(main())


def test_fifty_concurrent_requests_get_the_engines_answers(nats_server, redis_server, unique_prefix):
    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix)
        await cluster.start(num_workers=2)
        try:
            batch = problems(50)
            outcomes = await asyncio.gather(*[cluster.submit(engine().encode(p.prompt)) for p in batch])
            num_correct = 0
            for p, outcome in zip(batch, outcomes, strict=True):
                final = outcome.final
                assert isinstance(final, RequestFinished), final
                expected = offline_tokens(engine().encode(p.prompt), final.usage.thresholds)
                assert final.token_ids == expected, p.prompt
                num_correct += check_answer(p, final.text)
            assert num_correct >= 35  # the model is right far more often than not at these thresholds
            assert len({iid for o in outcomes for iid in o.final.usage.instance_ids}) == 2  # both instances served
        finally:
            await cluster.close()

    run(main())


@pytest.mark.parametrize("pipeline", [False, True], ids=["overlap", "pipelined"])
def test_overlapped_steps_keep_the_engines_answers(nats_server, redis_server, unique_prefix, pipeline):
    """Overlap (a step continued before the scheduling pass, thresholds replanned one step late) and
    pipelining (the worker runs the step after at once from a command sent in advance), made to apply
    to the bundled model's short answers: every request still ends with the engine's tokens at the
    thresholds its steps ran with."""
    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix,
                              scheduler_overrides={"overlap_min_tokens": 2, "pipeline_steps": pipeline})
        await cluster.start(num_workers=1)
        try:
            batch = problems(12, seed=5)
            outcomes = []
            for k in range(0, len(batch), 2):  # two at a time: a step continues only if no request on it starts a block
                outcomes += await asyncio.gather(*[cluster.submit(engine().encode(p.prompt)) for p in batch[k:k + 2]])
            for p, outcome in zip(batch, outcomes, strict=True):
                final = outcome.final
                assert isinstance(final, RequestFinished), final
                assert final.token_ids == offline_tokens(engine().encode(p.prompt), final.usage.thresholds), p.prompt
            assert cluster.scheduler.counters["continued_steps"] > 0
            worker = next(iter(cluster.workers.values()))
            assert (cluster.scheduler.counters["pipelined_steps"] > 0) == pipeline
            # a repeat (none in hand: the scheduler lagged) is a step the worker went on to by itself too
            assert worker.held.num_repeated == cluster.scheduler.counters["repeated_steps"]
            assert worker.held.num_continued == (cluster.scheduler.counters["pipelined_steps"]
                                                 + cluster.scheduler.counters["repeated_steps"])
        finally:
            await cluster.close()

    run(main())


def test_a_migrated_request_finishes_with_the_same_tokens(nats_server, redis_server, unique_prefix):
    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix, policy="fixed")
        await cluster.start(num_workers=1, pace_profile=H100_PROFILE)
        first = next(iter(cluster.workers.values()))
        p = problems(1, max_shots=3, seed=11)[0]
        drained = asyncio.Event()

        async def on_event(event):
            if isinstance(event, RequestProgress) and not drained.is_set():
                drained.set()
                await cluster.add_worker(pace_profile=H100_PROFILE)
                first.drain()

        try:
            outcome = await cluster.submit(engine().encode(p.prompt), stream=True, on_event=on_event)
            final = outcome.final
            assert isinstance(final, RequestFinished), final
            assert final.usage.num_migrations >= 1 and len(final.usage.instance_ids) == 2
            assert final.usage.instance_ids[0] == first.instance_id
            assert final.token_ids == offline_tokens(engine().encode(p.prompt), final.usage.thresholds)
            await cluster.wait_for(lambda: first.instance_id not in cluster.scheduler.view.instances,
                                   what="the drained instance leaves")
            await asyncio.wait_for(first.wait_stopped(), 5)
        finally:
            await cluster.close()

    run(main())


def test_streaming_progress_arrives_in_order_and_builds_the_answer(nats_server, redis_server, unique_prefix):
    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix)
        await cluster.start(num_workers=1)
        try:
            p = problems(1, seed=3)[0]
            outcome = await cluster.submit(engine().encode(p.prompt), stream=True, cache=WireCacheMode.DUAL)
            final = outcome.final
            assert isinstance(final, RequestFinished)
            seqs = [e.seq for e in outcome.events]
            assert seqs == sorted(seqs) and seqs[0] == 1 and seqs[-1] == final.usage.num_steps + 2
            progress = outcome.progress
            assert [e.num_steps for e in progress] == list(range(1, final.usage.num_steps + 1))
            assert "".join(e.text_delta for e in progress) == final.text
            assert final.usage.num_recompute_steps < final.usage.num_steps  # the dual cache was used
        finally:
            await cluster.close()

    run(main())


def test_a_lost_worker_costs_no_request(nats_server, redis_server, unique_prefix):
    """A worker that stops answering (its lease expires) mid-generation: its requests resume on the
    other instance from their state in Redis and finish with the engine's tokens."""
    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix, policy="fixed")
        await cluster.start(num_workers=1, pace_profile=H100_PROFILE)
        victim = next(iter(cluster.workers.values()))
        killed = asyncio.Event()

        async def on_event(event):
            if isinstance(event, RequestProgress) and not killed.is_set():
                killed.set()
                await cluster.add_worker(pace_profile=H100_PROFILE)
                # silence: no more heartbeats, commands unanswered (as a SIGKILLed process)
                for task in victim._tasks:
                    task.cancel()
                await victim._subscription.unsubscribe()

        try:
            batch = problems(4, seed=5)
            outcomes = await asyncio.gather(*[
                cluster.submit(engine().encode(p.prompt), stream=True, on_event=on_event) for p in batch
            ])
            for p, outcome in zip(batch, outcomes, strict=True):
                final = outcome.final
                assert isinstance(final, RequestFinished), final
                assert final.token_ids == offline_tokens(engine().encode(p.prompt), final.usage.thresholds)
            assert victim.instance_id not in cluster.scheduler.view.instances
        finally:
            await cluster.close()

    run(main())


def test_cache_modes_agree_with_the_engine_offline(nats_server, redis_server, unique_prefix):
    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix, policy="fixed")
        await cluster.start(num_workers=1)
        try:
            p = problems(1, seed=9)[0]
            ids = engine().encode(p.prompt)
            for wire, mode in ((WireCacheMode.DUAL, CacheMode.DUAL), (WireCacheMode.PREFIX, CacheMode.PREFIX)):
                final = (await cluster.submit(ids, cache=wire)).final
                assert final.token_ids == offline_tokens(ids, final.usage.thresholds, cache=mode)
        finally:
            await cluster.close()

    run(main())


def test_a_tensor_parallel_instance_gives_the_tokens_of_tp1(nats_server, redis_server, unique_prefix):
    """A TP-2 worker (two processes over gloo) serves requests with exactly the tokens of TP-1."""
    from services.worker.parallel.build import make_engine

    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix)
        await cluster.start(num_workers=0)
        tp_engine = make_engine("models/dls-tiny", tp=2)
        try:
            await cluster.add_worker(engine=tp_engine, tp=2, profile=H100_PROFILE)
            batch = problems(6, seed=13)
            outcomes = await asyncio.gather(*[cluster.submit(engine().encode(p.prompt)) for p in batch])
            for p, outcome in zip(batch, outcomes, strict=True):
                final = outcome.final
                assert isinstance(final, RequestFinished), final
                assert final.token_ids == offline_tokens(engine().encode(p.prompt), final.usage.thresholds)
        finally:
            await cluster.close()
            tp_engine.close()

    run(main())


def test_a_paced_worker_with_an_anchor_is_planned_with_that_context(nats_server, redis_server, unique_prefix):
    """`DLS_WORKER_PACE_CONTEXT_TOKENS`: the scheduler plans the instance with the profile scaled and
    anchored as the worker paces it (as the simulator anchors its profile at the workload's context)."""
    from shared.profiles import LatencyProfile

    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix)
        await cluster.start(num_workers=0)
        try:
            worker = await cluster.add_worker(pace_profile=H100_PROFILE, pace_scale=3.0, pace_context_tokens=64)
            planned = cluster.scheduler.view.instances[worker.instance_id].profile
            raw = LatencyProfile.load(H100_PROFILE)
            assert planned.context_tokens == 64 == worker.pace.context_tokens
            assert planned.alpha(1, 4) == pytest.approx(3.0 * raw.alpha(1, 4))
            final = (await cluster.submit(engine().encode("12+30="))).final
            assert isinstance(final, RequestFinished) and final.text.strip() == "42"
        finally:
            await cluster.close()

    run(main())


def test_a_draining_worker_with_nowhere_to_send_its_requests_leaves_after_its_timeout(
        nats_server, redis_server, unique_prefix):
    """The only instance drains mid-generation: its request cannot move, so the worker leaves after
    `drain_timeout_s`; the request waits in the queue and finishes, from its state in Redis, on the
    instance that comes next, with the engine's tokens."""
    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix, policy="fixed")
        await cluster.start(num_workers=1, pace_profile=H100_PROFILE, pace_scale=3.0, drain_timeout_s=0.5)
        only = next(iter(cluster.workers.values()))
        p = problems(1, max_shots=3, seed=17)[0]
        drained = asyncio.Event()

        async def on_event(event):
            if isinstance(event, RequestProgress) and not drained.is_set():
                drained.set()
                only.drain()
                await asyncio.wait_for(only.wait_stopped(), 10)  # left with the request still on it
                await cluster.add_worker(pace_profile=H100_PROFILE)

        try:
            outcome = await cluster.submit(engine().encode(p.prompt), stream=True, on_event=on_event)
            final = outcome.final
            assert isinstance(final, RequestFinished), final
            assert final.usage.instance_ids[0] == only.instance_id and len(final.usage.instance_ids) == 2
            assert final.token_ids == offline_tokens(engine().encode(p.prompt), final.usage.thresholds)
        finally:
            await cluster.close()

    run(main())


def test_a_worker_killed_mid_pipeline_loses_no_request(nats_server, redis_server, unique_prefix):
    """One of two paced workers dies without a goodbye while the other pipelines, and comes back under
    the same instance id: the lost steps run again from Redis and every request finishes (a pass that
    assigns requests to a busy instance must see them dispatched once it frees)."""
    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix)
        await cluster.start(num_workers=2, pace_profile=H100_PROFILE)
        victim_id, victim = next(iter(cluster.workers.items()))
        try:
            tasks = [asyncio.create_task(cluster.submit(engine().encode(p.prompt), gen_length=64, block_length=32))
                     for p in problems(16, seed=3)]
            await asyncio.sleep(0.6)
            for task in [*victim._tasks, *victim._step_tasks]:  # SIGKILL: no STOPPING heartbeat, no results
                task.cancel()
            await victim.nc.close()
            await asyncio.sleep(0.5)
            await cluster.add_worker(instance_id=victim_id, wait=False, pace_profile=H100_PROFILE)  # restarted
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert all(isinstance(o.final, RequestFinished) for o in outcomes)
            assert cluster.scheduler.counters["pipelined_steps"] > 0
        finally:
            await cluster.close()

    run(main())


def test_two_scheduler_shards_split_requests_and_instances(nats_server, redis_server, unique_prefix):
    """Two scheduler replicas (DLS_SCHEDULER_SHARDS=2): each takes the requests and instances whose ids
    hash to it, so every request runs only on its own shard's instances, and all finish."""
    import nats

    from services.scheduler.service import SchedulerService
    from shared.settings import SchedulerSettings
    from shared.subjects import shard_of

    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix,
                              scheduler_overrides={"scheduler_shards": 2, "shard": 0})
        await cluster.start(num_workers=0)
        nc = await nats.connect(nats_server.url)
        cluster._connections.append(nc)
        second = SchedulerService(SchedulerSettings(**{**cluster.scheduler_settings.model_dump(), "shard": 1}), nc,
                                  nc.jetstream(), RedisStateStore.from_url(redis_server.url, unique_prefix))
        await second.start()
        schedulers = [cluster.scheduler, second]
        names = iter(f"w{k}" for k in range(100))
        ids = [next(n for n in names if shard_of(n, 2) == shard) for shard in (0, 1)]  # one instance per shard
        for iid in ids:
            await cluster.add_worker(instance_id=iid, wait=False, scheduler_shards=2)
        try:
            await cluster.wait_for(lambda: [list(s.view.instances) for s in schedulers] == [[iid] for iid in ids],
                                   what="each shard's instance joined it alone")
            outcomes = await asyncio.gather(*[cluster.submit(engine().encode(p.prompt)) for p in problems(12, seed=9)])
            for outcome in outcomes:
                assert isinstance(outcome.final, RequestFinished), outcome.final
                assert outcome.final.usage.instance_ids == [ids[shard_of(outcome.request_id, 2)]]
            assert {shard_of(o.request_id, 2) for o in outcomes} == {0, 1}  # both shards had work
        finally:
            await second.stop()
            await cluster.close()

    run(main())
