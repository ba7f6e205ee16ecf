"""The rule of a held step command (``StepCommand.after_step_id``): whether an instance goes straight on
to it the moment the step it follows ends, with no round trip to the scheduler. One definition, for
the worker and for the simulator's instances.

It goes on only if nothing about the batch changed: every request of the step stepped and none
failed; the held command names all of those requests, at the state versions the step wrote, none to
be loaded; a request that completed its block goes on only if its item says ``may_start_block``; one
that finished is left out if the command says ``drop_finished`` (otherwise the instance waits for a
scheduling pass); each has at least ``min_masked`` masked positions left. Its other items are
requests placed on the instance while the step ran (``load_state``: they join from the store), so a
new arrival does not cost the instance a round trip.

When it is judged: the moment the step ends, on the latest held command that has come; or, where
none had come by then (the results say ``awaits_held``), on each one for that step as it arrives, the
first that passes running at once. The scheduler, which knows what it sent and in which order,
judges the same commands by the same rule on the results, so both sides agree on the step that runs
without a message between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

from shared.messages.steps import StepCommand


class SteppedRequest(Protocol):
    """One request's outcome of the step that ended (``RequestStepResult`` has these fields)."""

    request_id: str
    finished: bool
    block_done: bool
    num_masked: int
    state_version: int


def held_step(step: StepCommand, held: StepCommand, stepped: Sequence[SteppedRequest],
              num_failed: int = 0) -> StepCommand | None:
    """The held command to run now (without the requests that finished), or None to wait for the scheduler."""
    return held_step_after(len(step.items), held, stepped, num_failed)


def held_step_after(num_step_items: int, held: StepCommand, stepped: Sequence[SteppedRequest],
                    num_failed: int = 0) -> StepCommand | None:
    """``held_step`` for a step of ``num_step_items`` items (what the scheduler knows of the step it sent)."""
    by_id = {r.request_id: r for r in stepped}
    if num_failed or len(by_id) != num_step_items:
        return None
    joining = [it for it in held.items if it.request_id not in by_id]  # placed here while the step ran
    if len(held.items) - len(joining) != len(by_id) or not all(it.load_state for it in joining):
        return None
    items = [it for it in held.items if it.request_id not in by_id or not by_id[it.request_id].finished]
    if not items or (len(items) < len(held.items) and not held.drop_finished):
        return None
    for it in items:
        r = by_id.get(it.request_id)
        if r is not None and (it.load_state or it.state_version != r.state_version
                              or (r.block_done and not it.may_start_block) or r.num_masked < held.min_masked):
            return None
    return held if len(items) == len(held.items) else msgspec.structs.replace(held, items=items)
