"""The retry-key store (``services/gateway/idempotency.py``): the in-process one and the one on a real
redis-server, through the same cases."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.idempotency import InMemoryIdempotency, RedisIdempotency
from shared.state import redis_client

pytestmark = pytest.mark.integration


async def _claims_joins_and_drops(store) -> None:
    first = await store.claim("k", "print-1", ["a-0", "a-1"], 12.5, ttl_s=30, attach=False)
    assert first.created and first.request_ids == ["a-0", "a-1"] and first.num_joins == 0
    fresh = await store.claim("k", "print-1", ["b-0", "b-1"], 13.0, ttl_s=30, attach=False)  # sent afresh
    assert not fresh.created and fresh.request_ids == ["a-0", "a-1"] and fresh.num_joins == 0
    assert await store.detach("k") == (0, 0)  # the first client left
    joined = await store.claim("k", "print-1", ["c"], 14.0, ttl_s=30, attach=True)  # a retry joins
    assert (joined.created, joined.arrival_time, joined.fingerprint, joined.num_joins) == (False, 12.5, "print-1", 1)
    assert not await store.drop_if_unattached("k", 0)  # attached again
    assert await store.detach("k") == (0, 1)
    assert not await store.drop_if_unattached("k", 0)  # a retry joined since the first left: its own grace runs
    assert await store.drop_if_unattached("k", 1)
    assert await store.detach("k") == (-1, 0)  # gone
    again = await store.claim("k", "print-2", ["d"], 15.0, ttl_s=30, attach=True)
    assert again.created and again.request_ids == ["d"]
    await store.drop("k")
    assert (await store.claim("k", "p", ["e"], 16.0, ttl_s=0.2, attach=False)).created
    await asyncio.sleep(0.4)
    assert (await store.claim("k", "p", ["f"], 17.0, ttl_s=30, attach=True)).created  # expired


def test_in_memory_store():
    asyncio.run(_claims_joins_and_drops(InMemoryIdempotency()))


def test_redis_store(redis_server, unique_prefix):
    async def main():
        client = redis_client(redis_server.url)
        try:
            await _claims_joins_and_drops(RedisIdempotency(client, unique_prefix))
        finally:
            await client.aclose()

    asyncio.run(main())
