"""RedisStateStore against a real redis-server: the shared behaviour cases, TTL, layout."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import redis.asyncio as aioredis

from shared.state import RedisStateStore, RequestStatus, StateStore
from tests.unit.contracts.contract_builders import make_record
from tests.unit.contracts.state_cases import CASES, step_record

pytestmark = pytest.mark.integration


def run_with_store(redis_url: str, prefix: str, scenario, completed_ttl_s: float = 3600.0):
    async def main():
        store = RedisStateStore.from_url(redis_url, prefix=prefix, completed_ttl_s=completed_ttl_s)
        try:
            return await scenario(store)
        finally:
            await store.close()

    return asyncio.run(main())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_redis_store(case, redis_server, unique_prefix):
    run_with_store(redis_server.url, unique_prefix, case)


def test_redis_store_is_a_state_store(redis_server):
    async def check(store):
        assert isinstance(store, StateStore)

    run_with_store(redis_server.url, "x", check)


def test_completed_requests_expire_after_the_ttl(redis_server, unique_prefix):
    async def scenario(store: RedisStateStore):
        raw = aioredis.from_url(redis_server.url)
        v1 = await store.create(make_record("r1"))
        v2 = await store.save(msgspec.structs.replace(v1, num_steps=1), [step_record(1)])
        assert await raw.pttl(store.record_key("r1")) == -1  # in flight: no TTL
        await store.save(msgspec.structs.replace(v2, status=RequestStatus.CANCELLED, detail="client left"))
        await store.append_steps("r1", [step_record(2)])  # a late step record gets the same TTL
        for key in (store.record_key("r1"), store.steps_key("r1")):
            assert 0 < await raw.pttl(key) <= 400
        assert await store.list_in_flight() == []
        await asyncio.sleep(0.6)
        assert await store.load("r1") is None and await store.load_steps("r1") == []
        assert await raw.exists(store.record_key("r1"), store.steps_key("r1")) == 0
        await raw.aclose()

    run_with_store(redis_server.url, unique_prefix, scenario, completed_ttl_s=0.4)


def test_key_layout(redis_server, unique_prefix):
    async def scenario(store: RedisStateStore):
        raw = aioredis.from_url(redis_server.url)
        await store.create(make_record("r1", arrival_time=12.5))
        assert await raw.hget(f"{unique_prefix}:req:r1", "version") == b"1"
        assert await raw.zscore(f"{unique_prefix}:inflight", "r1") == 12.5
        await raw.aclose()

    run_with_store(redis_server.url, unique_prefix, scenario)


def test_many_processes_worth_of_writers_on_separate_connections(redis_server, unique_prefix):
    """Writers with their own connections (as scheduler and workers have): still exactly one winner."""

    async def scenario(store: RedisStateStore):
        v1 = await store.create(make_record("r1"))
        others = [RedisStateStore.from_url(redis_server.url, prefix=unique_prefix) for _ in range(4)]
        outcomes = await asyncio.gather(
            *(o.save(msgspec.structs.replace(v1, last_instance_id=f"w{i}")) for i, o in enumerate(others)),
            return_exceptions=True)
        for other in others:
            await other.close()
        assert sum(not isinstance(o, Exception) for o in outcomes) == 1

    run_with_store(redis_server.url, unique_prefix, scenario)


def test_scripts_reload_after_a_script_flush(redis_server, unique_prefix):
    """A restarted Redis has no cached scripts: single and pipelined writes must load them again."""

    async def scenario(store: RedisStateStore):
        raw = aioredis.from_url(redis_server.url)
        await raw.script_flush()
        created = await store.create(make_record("r1"))
        await raw.script_flush()
        result = await store.save_many([msgspec.structs.replace(created, num_steps=1)])
        assert result.ok and result.saved[0].version == 2
        await raw.script_flush()
        assert await store.append_steps("r1", [step_record(1)]) == 1
        await raw.aclose()

    run_with_store(redis_server.url, unique_prefix, scenario)
