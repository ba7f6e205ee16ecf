"""The in-memory StateStore: the shared behaviour cases, plus TTL on an injected clock."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from shared.state import InMemoryStateStore, RequestStatus, StateStore
from tests.unit.contracts.contract_builders import make_record
from tests.unit.contracts.state_cases import CASES, step_record


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_in_memory_store(case):
    asyncio.run(case(InMemoryStateStore()))


def test_in_memory_store_is_a_state_store():
    assert isinstance(InMemoryStateStore(), StateStore)


def test_completed_requests_expire_after_the_ttl():
    clock = FakeClock(100.0)
    store = InMemoryStateStore(completed_ttl_s=60.0, clock=clock)

    async def scenario():
        v1 = await store.create(make_record("r1"))
        clock.now = 10_000.0  # in-flight requests never expire
        assert await store.load("r1") == v1
        done = await store.save(msgspec.structs.replace(v1, status=RequestStatus.FINISHED), [step_record(1)])
        clock.now += 59.0
        assert await store.load("r1") == done and len(await store.load_steps("r1")) == 1
        clock.now += 1.0
        assert await store.load("r1") is None and await store.load_steps("r1") == []
        assert await store.list_in_flight() == []
        await store.create(make_record("r1"))  # the id is free again

    asyncio.run(scenario())
