"""The contract every scheduling policy follows, and small helpers the policies share."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from services.scheduler.core.decisions import BatchOutcome, Decisions
from services.scheduler.core.view import AppendLog, ClusterView


@runtime_checkable
class Policy(Protocol):
    """A pure scheduling policy: a snapshot in, decisions out.

    ``schedule(now, view)`` is called once per scheduling event (an arrival, a step result, a tick)
    after the driver has recorded the event in ``view``; it returns step assignments (with their
    thresholds), migrations and rejections, which the driver applies with ``view.apply``.
    ``on_step_result(now, result)`` tells the policy about a finished step before that call.
    Policies never read a clock (``now`` is passed in) and draw randomness only from the generator
    they were built with.
    """

    name: str

    def schedule(self, now: float, view: ClusterView) -> Decisions: ...

    def on_step_result(self, now: float, result: BatchOutcome) -> None: ...


class LogCursor:
    """Reads a view's append-only log (arrivals or removals) from where it last stopped."""

    def __init__(self) -> None:
        self.position = 0  # absolute: the number of entries read so far

    def take(self, log: AppendLog) -> list[str]:
        new, self.position = log.since(self.position)
        return new
