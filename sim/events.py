"""The simulator's event kinds, in the scheduler core's event queue: an explicit ``(time, kind, seq)`` order.

At equal times, events run in ``SimEvent`` order; it extends the scheduler core's order
(``services.scheduler.core.events``: step results, predictions, instance changes, arrivals, ticks)
with the simulator's own kinds:

1. ``STEP_END``: a batched step finished; frees batch slots and brings progress (scheduler: step result)
2. ``PREDICTION``: an asynchronous remaining-step prediction lands
3. ``MIGRATION_DONE``: a migrated request's state reached its destination
4. ``INSTANCE_UP`` / ``INSTANCE_DRAINED``: cluster changes (scheduler: instance change)
5. ``RECONFIG``: the reconfigurator's periodic planning pass (may drain and start instances)
6. ``ARRIVAL``: a request arrives
7. ``STEP_START``: an idle instance starts its next batched step; after every same-time scheduling
   event, so that a step takes everything placed at that instant
8. ``SAMPLE``: a timeline sample (configuration, thresholds), after everything else at that time

Among events of one kind and time, the one pushed first runs first (``seq``). Completions happen at
``STEP_END`` (a request finishes when its last step does) and are recorded there.
"""

from __future__ import annotations

from enum import IntEnum

from services.scheduler.core.events import Event, EventQueue

__all__ = ["Event", "EventQueue", "SimEvent"]


class SimEvent(IntEnum):
    STEP_END = 0
    PREDICTION = 1
    MIGRATION_DONE = 2
    INSTANCE_UP = 3
    INSTANCE_DRAINED = 4
    RECONFIG = 5
    ARRIVAL = 6
    STEP_START = 7
    SAMPLE = 8
