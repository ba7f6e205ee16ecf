"""Behaviour every ``StateStore`` must have; run against the in-memory store here and Redis in
``tests/integration/test_state_store.py``. Each case is ``async def case(store)`` on an empty store
whose completed-request TTL is long (TTL cases live with each implementation's clock)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from shared.messages.base import StepKind
from shared.state import (
    RequestExistsError,
    RequestNotFoundError,
    RequestStatus,
    StaleStateError,
    StateStore,
    StepRecord,
)
from tests.unit.contracts.contract_builders import MASK, make_record

replace = msgspec.structs.replace


def step_record(index: int, instance_id: str = "w0") -> StepRecord:
    return StepRecord(step_index=index, instance_id=instance_id, kind=StepKind.RECOMPUTE, block_index=0,
                      threshold=0.9, committed_positions=[index - 1], started_at=10.0 + index, duration_s=0.01)


async def case_create_and_load(store: StateStore):
    created = await store.create(make_record("r1"))
    assert created.version == 1
    assert await store.load("r1") == created
    assert await store.load("nope") is None


async def case_create_twice_is_refused(store: StateStore):
    await store.create(make_record("r1"))
    with pytest.raises(RequestExistsError, match="r1"):
        await store.create(make_record("r1", priority=5))
    assert (await store.load("r1")).priority == 0


async def case_versioned_save(store: StateStore):
    v1 = await store.create(make_record("r1"))
    canvas = [11] + [MASK] * 7
    v2 = await store.save(replace(v1, canvas=canvas, num_steps=1, num_committed=1, threshold_history=[0.9],
                                  status=RequestStatus.RUNNING, last_instance_id="w0"))
    assert v2.version == 2
    loaded = await store.load("r1")
    assert loaded == v2 and loaded.canvas == canvas and loaded.status is RequestStatus.RUNNING


async def case_stale_save_is_rejected_and_changes_nothing(store: StateStore):
    v1 = await store.create(make_record("r1"))
    v2 = await store.save(replace(v1, num_steps=1))
    with pytest.raises(StaleStateError, match="version 1, stored version is 2") as info:
        await store.save(replace(v1, num_steps=99), [step_record(1)])
    assert (info.value.expected_version, info.value.actual_version) == (1, 2)
    assert await store.load("r1") == v2
    assert await store.load_steps("r1") == []


async def case_save_of_unknown_request(store: StateStore):
    with pytest.raises(RequestNotFoundError, match="ghost"):
        await store.save(make_record("ghost", version=1))
    with pytest.raises(RequestNotFoundError):
        await store.append_steps("ghost", [step_record(1)])


async def case_concurrent_writers_one_wins(store: StateStore):
    v1 = await store.create(make_record("r1"))
    outcomes = await asyncio.gather(
        *(store.save(replace(v1, last_instance_id=f"w{i}")) for i in range(5)), return_exceptions=True)
    winners = [o for o in outcomes if not isinstance(o, Exception)]
    assert len(winners) == 1 and all(isinstance(o, StaleStateError) for o in outcomes if o not in winners)
    assert await store.load("r1") == winners[0]


async def case_retrying_writers_lose_no_update(store: StateStore):
    await store.create(make_record("r1"))

    async def add_step(writer: int) -> None:
        while True:
            current = await store.load("r1")
            try:
                await store.save(replace(current, num_steps=current.num_steps + 1,
                                         threshold_history=[*current.threshold_history, writer / 10]))
                return
            except StaleStateError:
                await asyncio.sleep(0)

    await asyncio.gather(*(add_step(i) for i in range(8)))
    final = await store.load("r1")
    assert final.num_steps == 8 and sorted(final.threshold_history) == [i / 10 for i in range(8)]
    assert final.version == 9


async def case_step_records(store: StateStore):
    v1 = await store.create(make_record("r1"))
    v2 = await store.save(replace(v1, num_steps=1), [step_record(1)])
    await store.save(replace(v2, num_steps=2), [step_record(2, "w1")])
    assert await store.append_steps("r1", [step_record(3), step_record(4)]) == 4
    steps = await store.load_steps("r1")
    assert [s.step_index for s in steps] == [1, 2, 3, 4] and steps[1].instance_id == "w1"
    assert await store.load_steps("nope") == []


async def case_pipelined_batch(store: StateStore):
    ids = [f"r{i}" for i in range(20)]
    for rid in ids:
        await store.create(make_record(rid))
    loaded = await store.load_many([*ids, "missing"])
    assert [r.request_id for r in loaded[:-1]] == ids and loaded[-1] is None
    assert await store.load_many([]) == []
    writes = [replace(r, num_steps=1) for r in loaded[:-1]]
    writes[3] = replace(writes[3], version=7)  # stale
    writes.append(make_record("gone", version=1))  # missing
    result = await store.save_many(writes, {"r0": [step_record(1)], "r3": [step_record(1)]})
    assert not result.ok
    assert [r.request_id for r in result.saved] == [rid for rid in ids if rid != "r3"]
    assert all(r.version == 2 for r in result.saved)
    assert [e.request_id for e in result.stale] == ["r3"] and result.missing_ids == ["gone"]
    assert len(await store.load_steps("r0")) == 1 and await store.load_steps("r3") == []
    assert (await store.load("r3")).version == 1
    assert (await store.save_many([])).ok


async def case_in_flight_listing(store: StateStore):
    for rid, arrival in [("late", 30.0), ("early", 10.0), ("middle", 20.0)]:
        await store.create(make_record(rid, arrival_time=arrival))
    await store.create(make_record("rejected", arrival_time=5.0, status=RequestStatus.REJECTED))
    assert await store.list_in_flight() == ["early", "middle", "late"]
    middle = await store.load("middle")
    await store.save(replace(middle, status=RequestStatus.FINISHED, finished_at=25.0))
    assert await store.list_in_flight() == ["early", "late"]
    assert (await store.load("middle")).status is RequestStatus.FINISHED  # still readable until its TTL


async def case_loaded_records_do_not_alias_the_store(store: StateStore):
    v1 = await store.create(make_record("r1"))
    v1.canvas[0] = 99  # a careless writer mutating its copy
    assert (await store.load("r1")).canvas[0] == MASK


CASES = [value for name, value in sorted(globals().items()) if name.startswith("case_")]
