"""The rule of a held step command (``StepCommand.after_step_id``): whether an instance goes straight on
to it the moment the step it follows ends, with no round trip to the scheduler. One definition, for
the worker and for the simulator's instances.

It goes on only if nothing about the batch changed: every request of the step stepped and none
failed; the held command names all of those requests, at the state versions the step wrote, none to
be loaded; a request that completed its block goes on only if its item says ``may_start_block``, and
the block starts together fit the command's ``recompute_tokens`` (each item's ``context_tokens``; one
always does: the scheduler's recompute budget, which it composes the other steps under); one
that finished is left out if the command says ``drop_finished`` (otherwise the instance waits for a
scheduling pass); each has at least ``min_masked`` masked positions left. Its other items are
requests placed on the instance while the step ran (``load_state``: they join from the store), so a
new arrival does not cost the instance a round trip.

When it is judged: the moment the step ends, on the latest held command that has come; or, where
none had come by then (the results say ``awaits_held``), on each one for that step as it arrives, the
first that passes running at once. The scheduler, which knows what it sent and in which order,
judges the same commands by the same rule on the results, so both sides agree on the step that runs
without a message between them.

Repeats (``StepCommand.repeats``): with no held command in hand when its step ends, a held command
runs again, as it is, up to ``repeats`` more steps (``repeat_step``: the same requests at the same
thresholds, less those that finished, at the versions the worker wrote, under the step ids the
scheduler reserved after it), as long as the rule holds. Such a run of steps is a chain; a held
command the scheduler sent for an earlier step of the chain, arriving after that step ended, applies
to the chain's latest step (``rebase``: its requests that finished meanwhile are left out, the others
go on from the versions the chain wrote). So where the scheduler's command lags a step or two behind
a worker that steps faster than it answers, the worker goes on instead of waiting, and takes up the
command when it comes; the scheduler learns which ran from the results (``continued_step_id``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import msgspec

from shared.messages.steps import StepCommand

# how many more steps a held command may run by itself (``StepCommand.repeats``): a worker that steps
# faster than the scheduler answers goes on at the thresholds it has, up to this many steps behind the
# policy, instead of waiting (``StepConfig.held_repeats``, ``DLS_SCHEDULER_HELD_REPEATS``)
DEFAULT_HELD_REPEATS = 16


class SteppedRequest(Protocol):
    """One request's outcome of the step that ended (``RequestStepResult`` has these fields)."""

    request_id: str
    finished: bool
    block_done: bool
    num_masked: int
    state_version: int


def next_step(step: StepCommand, held: StepCommand | None, stepped: Sequence[SteppedRequest],
              num_failed: int = 0) -> StepCommand | None:
    """What follows ``step`` when it ends: the held command in hand (for this step, or for an earlier
    one of its chain), or, with none, the step again (``repeat_step``); None: wait for the scheduler."""
    if held is not None:
        return held_step(step, held, stepped, num_failed)
    return repeat_step(step, stepped, num_failed)


def held_step(step: StepCommand, held: StepCommand, stepped: Sequence[SteppedRequest],
              num_failed: int = 0) -> StepCommand | None:
    """The held command to run now (without the requests that finished), or None to wait for the
    scheduler. One sent for an earlier step of ``step``'s chain is rebased onto it."""
    return held_step_after(len(step.items), held, stepped, num_failed, rebase=held.after_step_id != step.step_id)


def repeat_step(step: StepCommand, stepped: Sequence[SteppedRequest], num_failed: int = 0) -> StepCommand | None:
    """``step`` once more (one of its ``repeats``), if the rule holds: its requests at their thresholds,
    at the versions this step wrote, none to load, under the next step id (reserved by the scheduler)."""
    if step.repeats <= 0:
        return None
    again = msgspec.structs.replace(
        step, step_id=step.step_id + 1, after_step_id=step.step_id, repeats=step.repeats - 1, drop_request_ids=[],
        items=[msgspec.structs.replace(it, load_state=False) if it.load_state else it for it in step.items])
    return held_step_after(len(step.items), again, stepped, num_failed, rebase=True)


def _rebase(held: StepCommand, by_id: Mapping[str, SteppedRequest]) -> StepCommand:
    """``held`` (sent for an earlier step of a chain) as the command after the chain's step that just
    ended (``by_id``: its results): requests that finished in the chain are left out, the others go on
    from the versions the chain wrote; those to load (joining) are unchanged."""
    items = []
    for it in held.items:
        r = by_id.get(it.request_id)
        if it.load_state or (r is not None and r.state_version == it.state_version):
            items.append(it)
        elif r is not None:
            items.append(msgspec.structs.replace(it, state_version=r.state_version))
    return msgspec.structs.replace(held, items=items)


def held_step_after(num_step_items: int, held: StepCommand, stepped: Sequence[SteppedRequest],
                    num_failed: int = 0, *, rebase: bool = False) -> StepCommand | None:
    """``held_step`` for a step of ``num_step_items`` items (what the scheduler knows of the step it
    sent); ``rebase``: ``held`` follows an earlier step of the chain (or repeats the step)."""
    by_id = {r.request_id: r for r in stepped}
    if num_failed or len(by_id) != num_step_items:
        return None
    if rebase:
        held = _rebase(held, by_id)
    joining = [it for it in held.items if it.request_id not in by_id]  # placed here while the step ran
    if len(held.items) - len(joining) != len(by_id) or not all(it.load_state for it in joining):
        return None
    items = [it for it in held.items if it.request_id not in by_id or not by_id[it.request_id].finished]
    if not items or (len(items) < len(held.items) and not held.drop_finished):
        return None
    starting, starting_tokens = 0, 0
    for it in items:
        r = by_id.get(it.request_id)
        if r is not None and (it.load_state or it.state_version != r.state_version
                              or (r.block_done and not it.may_start_block) or r.num_masked < held.min_masked):
            return None
        if r is not None and r.block_done and it.context_tokens:
            starting, starting_tokens = starting + 1, starting_tokens + it.context_tokens
    if held.recompute_tokens and starting > 1 and starting_tokens > held.recompute_tokens:
        return None  # more block starts than the recompute budget has room for: the scheduler composes
    return held if len(items) == len(held.items) else msgspec.structs.replace(held, items=items)
