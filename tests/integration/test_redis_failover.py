"""The request-state store on a replicated Redis (a primary, two replicas, three Sentinels: real
redis-server processes): the store's behaviour cases through the Sentinel URL, and a failover under a
stream of writes that loses none of the writes the store acknowledged."""

from __future__ import annotations

import asyncio
import functools
import logging

import msgspec
import pytest

from shared.redis_target import RedisUrlError, parse_redis_url
from shared.retry import retry_transient
from shared.state import RedisStateStore, ReplicationError, RequestExistsError, StaleStateError
from tests.chaos.redis_ha import ReplicatedRedis
from tests.unit.contracts.contract_builders import make_record
from tests.unit.contracts.state_cases import CASES, step_record

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

logger = logging.getLogger("test.failover")


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    redis = ReplicatedRedis(tmp_path_factory.mktemp("redis-ha"))
    try:
        redis.start()
        yield redis
    finally:
        redis.stop()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_the_store_behaves_the_same_through_sentinels(case, replicated, unique_prefix):
    async def main():
        store = RedisStateStore.from_url(replicated.url, prefix=unique_prefix)
        assert store.wait_replicas == 1  # Sentinels: every write waits for a replica
        try:
            await case(store)
            assert store.num_unreplicated == 0
        finally:
            await store.close()

    asyncio.run(main())


def test_a_write_no_replica_confirms_is_not_reported_done(replicated, unique_prefix):
    """Waiting for more replicas than there are: the write is applied on the primary, and the store
    raises ReplicationError (a connection error callers retry) instead of returning it as done."""
    async def main():
        store = RedisStateStore.from_url(f"{replicated.url}?wait_replicas=3&wait_timeout_ms=200", unique_prefix)
        retrying = RedisStateStore.from_url(replicated.url, unique_prefix)
        try:
            with pytest.raises(ReplicationError, match="reached 2 of 3 replica"):
                await store.create(make_record("r1"))
            assert store.num_unreplicated == 1
            with pytest.raises(RequestExistsError):  # the retry finds what the primary kept
                await retrying.create(make_record("r1"))
        finally:
            await store.close()
            await retrying.close()

    asyncio.run(main())


def test_a_failover_loses_no_acknowledged_write(replicated, unique_prefix):
    """Four writers create requests and step them (versioned saves with step records) while the primary
    is SIGKILLed; a Sentinel promotes a replica and the writers carry on against it. Every write the store
    acknowledged is on the new primary: the records at least at that version, their step lists complete."""
    async def main():
        store = RedisStateStore.from_url(replicated.url, prefix=unique_prefix)
        acked: dict[str, int] = {}  # request id -> highest version the store acknowledged
        failed_over = asyncio.Event()
        num_after_failover = 0  # writes acknowledged once the replica was promoted
        stop = asyncio.Event()

        async def write(k: int) -> None:
            nonlocal num_after_failover
            i = 0
            while not stop.is_set():
                rid = f"r{k}-{i}"
                i += 1
                try:
                    record = await retry_transient(functools.partial(store.create, make_record(rid)), "create",
                                                   logger)
                except RequestExistsError:  # applied, and the reply lost with the connection
                    record = await retry_transient(functools.partial(store.load, rid), "load", logger)
                acked[rid] = record.version
                for step in range(1, 4):
                    changed = msgspec.structs.replace(record, num_steps=step)
                    try:
                        record = await retry_transient(functools.partial(store.save, changed, [step_record(step)]),
                                                       "save", logger)
                    except StaleStateError:  # applied, reply lost: carry on from what is stored
                        record = await retry_transient(functools.partial(store.load, rid), "load", logger)
                    acked[rid] = record.version
                    num_after_failover += failed_over.is_set()

        writers = [asyncio.create_task(write(k)) for k in range(4)]
        try:
            await asyncio.sleep(1.0)
            old = await asyncio.to_thread(replicated.kill_primary)
            new = await asyncio.to_thread(replicated.wait_failover, old)
            failed_over.set()
            await asyncio.sleep(1.5)
        finally:
            stop.set()
            await asyncio.gather(*writers)
        assert new != old and num_after_failover > 0, "no write went to the new primary"
        records = await store.load_many(sorted(acked))
        for rid, record in zip(sorted(acked), records, strict=True):
            assert record is not None, f"{rid}: acknowledged, then lost in the failover"
            assert record.version >= acked[rid], f"{rid}: version {record.version} < acknowledged {acked[rid]}"
            steps = await store.load_steps(rid)
            assert [s.step_index for s in steps] == list(range(1, record.num_steps + 1)), rid
        await store.close()
        await asyncio.to_thread(replicated.restart, old)  # back as a replica, for whatever runs next
        return len(acked)

    assert asyncio.run(main()) > 20


def test_sentinel_urls_are_parsed_and_bad_ones_refused():
    target = parse_redis_url("redis+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2/mymaster/2?wait_timeout_ms=250")
    assert target.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379))
    assert (target.master, target.db, target.password, target.wait_replicas, target.wait_timeout_ms) == \
        ("mymaster", 2, "s3cret", 1, 250)
    plain = parse_redis_url("redis://:pw@host:6380/1?wait_replicas=2")
    assert not plain.replicated and plain.wait_replicas == 2 and plain.url == "redis://:pw@host:6380/1"
    assert parse_redis_url("redis://host:6379/0").wait_replicas == 0
    for bad, says in [("redis+sentinel://h:1", "master name"), ("redis+sentinel://h:x/m", "port"),
                      ("redis+sentinel://h:1/m/zero", "database"), ("redis+sentinel://h:1/m?db=2", "unknown"),
                      ("redis://h/0?wait_replicas=-1", "negative"), ("http://h/0", "scheme")]:
        with pytest.raises(RedisUrlError, match=says):
            parse_redis_url(bad)
