"""The rule of a held step command (``StepCommand.after_step_id``): whether an instance goes straight on
to it the moment the step it follows ends, with no round trip to the scheduler. One definition, for
the worker and for the simulator's instances.

It goes on only if nothing about the batch changed: every request of the step stepped and none
failed; the held command names exactly those requests, at the state versions the step wrote, none to
be loaded; a request that completed its block goes on only if its item says ``may_start_block``; one
that finished is left out if the command says ``drop_finished`` (otherwise the instance waits for a
scheduling pass); each has at least ``min_masked`` masked positions left.
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
    by_id = {r.request_id: r for r in stepped}
    if num_failed or not len(by_id) == len(step.items) == len(held.items):
        return None
    if any(it.request_id not in by_id for it in held.items):
        return None
    items = [it for it in held.items if not by_id[it.request_id].finished]
    if not items or (len(items) < len(held.items) and not held.drop_finished):
        return None
    for it in items:
        r = by_id[it.request_id]
        if (it.load_state or it.state_version != r.state_version or (r.block_done and not it.may_start_block)
                or r.num_masked < held.min_masked):
            return None
    return held if len(items) == len(held.items) else msgspec.structs.replace(held, items=items)
