"""The gateway's per-key rate limit on a real redis-server: over the limit 429 with Retry-After,
counted per key (shared by every gateway replica on the same Redis), another key unaffected."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.gateway.security import RedisRateLimiter, key_hash
from tests.unit.gateway.gateway_builders import FakeBus, settings

pytestmark = pytest.mark.integration

BODY = {"model": "dls-tiny", "prompt": "12+30=", "max_tokens": 8}


def test_over_the_rate_limit_is_429_per_key_counted_in_redis(redis_server, unique_prefix):
    config = settings(api_keys=["key-a", "key-b"], rate_limit_per_min=2, redis_url=redis_server.url,
                      redis_key_prefix=unique_prefix)
    with TestClient(create_app(config, bus=FakeBus())) as app:  # the app owns its limiter: lifespan starts it
        a = {"Authorization": "Bearer key-a"}
        assert [app.post("/v1/completions", json=BODY, headers=a).status_code for _ in range(2)] == [200, 200]
        over = app.post("/v1/completions", json=BODY, headers=a)
        assert over.status_code == 429
        assert over.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(over.headers["Retry-After"]) <= 60
        assert app.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer key-b"}).status_code == 200
        assert app.post("/v1/completions", json=BODY).status_code == 401

    async def counted() -> list[bytes]:
        import redis.asyncio as aioredis

        client = aioredis.from_url(redis_server.url)
        try:
            return sorted(await client.keys(f"{unique_prefix}:ratelimit:*"))
        finally:
            await client.aclose()

    import asyncio

    keys = asyncio.run(counted())
    assert len(keys) == 2 and all(b"key-" not in k for k in keys)  # identities are hashes
    assert any(key_hash("key-a").encode() in k for k in keys)


def test_a_redis_that_does_not_answer_lets_requests_through():
    limiter = RedisRateLimiter("redis://127.0.0.1:1/0", "dls", limit=1)
    with TestClient(create_app(settings(rate_limit_per_min=1), bus=FakeBus(), rate_limiter=limiter)) as app:
        import asyncio

        asyncio.run(limiter.start())
        assert [app.post("/v1/completions", json=BODY).status_code for _ in range(3)] == [200, 200, 200]
