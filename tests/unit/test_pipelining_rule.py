"""``shared.pipelining.held_step``: when an instance (the worker, or the simulator's) goes straight on to
the command it holds."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest

from shared.messages.steps import StepCommand, StepItem
from shared.pipelining import held_step, next_step, repeat_step

STEP = StepCommand(instance_id="i0", step_id=1, issued_at=0.0, items=[
    StepItem(request_id="a", threshold=0.9, state_version=4), StepItem(request_id="b", threshold=0.9, state_version=7)])


@dataclass
class Stepped:
    request_id: str
    finished: bool = False
    block_done: bool = False
    num_masked: int = 10
    state_version: int = 0


def held(drop_finished: bool = True, min_masked: int = 0, **item_changes) -> StepCommand:
    items = [StepItem(request_id="a", threshold=0.8, state_version=5, **item_changes),
             StepItem(request_id="b", threshold=0.7, state_version=8, **item_changes)]
    return StepCommand(instance_id="i0", step_id=2, issued_at=0.0, items=items, after_step_id=1,
                       drop_finished=drop_finished, min_masked=min_masked)


def outcomes(**changes) -> list[Stepped]:
    return [Stepped("a", state_version=5, **changes.get("a", {})), Stepped("b", state_version=8, **changes.get("b", {}))]


def test_an_unchanged_batch_goes_on_at_the_held_thresholds():
    nxt = held_step(STEP, held(), outcomes())
    assert nxt is not None and [it.threshold for it in nxt.items] == [0.8, 0.7]


@pytest.mark.parametrize(("command", "stepped", "num_failed"), [
    (held(), outcomes(), 1),  # a request failed
    (held(), outcomes()[:1], 0),  # one did not step
    (held(), [Stepped("a", state_version=5), Stepped("b", state_version=9)], 0),  # another writer's version
    (held(), outcomes(a={"block_done": True}), 0),  # a block start the policy was not asked about
    (held(drop_finished=False), outcomes(b={"finished": True}), 0),  # a finished slot someone waits for
    (held(min_masked=20), outcomes(), 0),  # too few tokens to go
    (held(load_state=True), outcomes(), 0),  # its state must be loaded first
    (held(), outcomes(a={"finished": True}, b={"finished": True}), 0),  # nothing left to run
])
def test_anything_changed_waits_for_the_scheduler(command, stepped, num_failed):
    assert held_step(STEP, command, stepped, num_failed) is None


def test_block_starts_and_finished_requests_where_the_command_allows_them():
    assert held_step(STEP, held(may_start_block=True), outcomes(a={"block_done": True})) is not None
    nxt = held_step(STEP, held(), outcomes(b={"finished": True}))
    assert [it.request_id for it in nxt.items] == ["a"]


def test_block_starts_beyond_the_commands_recompute_room_wait_for_the_scheduler():
    """One block start always goes; more go only where their contexts fit ``recompute_tokens``."""
    capped = msgspec.structs.replace(held(may_start_block=True, context_tokens=300), recompute_tokens=500)
    both = outcomes(a={"block_done": True}, b={"block_done": True})
    assert held_step(STEP, capped, both) is None  # 600 tokens of block starts in a room of 500
    assert held_step(STEP, capped, outcomes(a={"block_done": True})) is not None  # one always goes
    roomy = msgspec.structs.replace(capped, recompute_tokens=600)
    assert held_step(STEP, roomy, both) is not None
    uncapped = msgspec.structs.replace(capped, recompute_tokens=0)
    assert held_step(STEP, uncapped, both) is not None
    assert repeat_step(msgspec.structs.replace(capped, repeats=1), both) is None  # a repeat keeps to it


def joined(load_state: bool = True, drop: str = "") -> StepCommand:
    """The held command with request ``c``, placed on the instance while the step ran (less ``drop``)."""
    command = held()
    items = [it for it in command.items if it.request_id != drop]
    items.append(StepItem(request_id="c", threshold=0.6, state_version=1, load_state=load_state))
    return StepCommand(instance_id="i0", step_id=2, issued_at=0.0, items=items, after_step_id=1, drop_finished=True)


def test_a_request_placed_while_the_step_ran_joins_the_batch_from_the_store():
    nxt = held_step(STEP, joined(), outcomes())
    assert nxt is not None and [(it.request_id, it.load_state) for it in nxt.items] == [
        ("a", False), ("b", False), ("c", True)]
    only = held_step(STEP, joined(), outcomes(a={"finished": True}, b={"finished": True}))
    assert [it.request_id for it in only.items] == ["c"]  # the stepped ones finished: the newcomer goes on


@pytest.mark.parametrize("command", [
    joined(load_state=False),  # not in the step, yet not loaded: a state this instance cannot have
    joined(drop="b"),  # a request of the step is missing (it moved): the scheduler decides
])
def test_a_newcomer_does_not_hide_a_changed_batch(command):
    assert held_step(STEP, command, outcomes()) is None


# --- repeats and chains --------------------------------------------------------------------------


def test_with_none_in_hand_a_command_with_repeats_runs_again_under_the_next_reserved_id():
    step = held(may_start_block=True)
    step = StepCommand(instance_id="i0", step_id=2, issued_at=0.0, items=step.items, after_step_id=1,
                       drop_finished=True, repeats=2, drop_request_ids=["gone"])
    after = [Stepped("a", state_version=6), Stepped("b", state_version=9, finished=True)]
    again = next_step(step, None, after)
    assert again is not None and (again.step_id, again.after_step_id, again.repeats) == (3, 2, 1)
    assert [(it.request_id, it.threshold, it.state_version) for it in again.items] == [("a", 0.8, 6)]
    assert again.drop_request_ids == []  # dropped once, by the command that carried them
    last = next_step(again, None, [Stepped("a", state_version=7)])
    assert last is not None and (last.step_id, last.repeats) == (4, 0)
    assert next_step(last, None, [Stepped("a", state_version=8)]) is None  # repeats spent: wait
    assert next_step(STEP, None, outcomes()) is None  # a command without repeats never runs again


@pytest.mark.parametrize(("stepped", "num_failed"), [
    (outcomes(), 1),  # a request failed
    (outcomes(a={"block_done": True}), 0),  # a block start its command did not allow
    ([Stepped("a", state_version=5, finished=True), Stepped("b", state_version=8)], 0),  # no drop_finished
])
def test_a_repeat_keeps_the_rule(stepped, num_failed):
    step = StepCommand(instance_id="i0", step_id=1, issued_at=0.0, items=STEP.items, repeats=3)
    assert repeat_step(step, stepped, num_failed) is None


def test_a_joiner_of_the_repeated_step_repeats_from_its_own_copy():
    step = StepCommand(instance_id="i0", step_id=5, issued_at=0.0, repeats=1, after_step_id=4, items=[
        StepItem(request_id="c", threshold=0.6, state_version=1, load_state=True)])
    again = repeat_step(step, [Stepped("c", state_version=2)])
    assert [(it.load_state, it.state_version) for it in again.items] == [(False, 2)]


def test_a_held_command_for_an_earlier_step_of_the_chain_applies_to_its_latest():
    """Sent after step 1; the worker meanwhile repeated step 2 as step 3 (b finished there): it goes
    on after step 3 with a only, from the version step 3 wrote, and with the newcomer c."""
    late = msgspec.structs.replace(joined(), step_id=9)  # after_step_id=1: a, b and the newcomer c
    chain_step = StepCommand(instance_id="i0", step_id=3, issued_at=0.0, after_step_id=2, drop_finished=True,
                             items=[StepItem(request_id="a", threshold=0.8, state_version=6)])
    nxt = next_step(chain_step, late, [Stepped("a", state_version=7)])
    assert nxt is not None and nxt.step_id == 9
    assert [(it.request_id, it.state_version, it.load_state) for it in nxt.items] == [("a", 7, False), ("c", 1, True)]
    # the chain's step has a request the late command does not name: the scheduler decides
    wider = StepCommand(instance_id="i0", step_id=3, issued_at=0.0, after_step_id=2, items=[
        StepItem(request_id="a", threshold=0.8, state_version=6), StepItem(request_id="d", threshold=0.8,
                                                                          state_version=3)])
    assert next_step(wider, late, [Stepped("a", state_version=7), Stepped("d", state_version=4)]) is None
