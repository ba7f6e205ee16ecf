"""The simulator's event kinds, in the scheduler core's event queue: an explicit ``(time, kind, seq)`` order.

At equal times, events run in ``SimEvent`` order; it extends the scheduler core's order
(``services.scheduler.core.events``: step results, predictions, instance changes, arrivals, ticks)
with the simulator's own kinds:

1. ``STEP_END``: a batched step finished; frees batch slots and brings progress (scheduler: step result)
2. ``PREDICTION``: an asynchronous remaining-step prediction lands
3. ``INSTANCE_UP``: a started instance joins (scheduler: instance change)
4. ``RECONFIG``: the reconfigurator's periodic planning pass (may drain and start instances)
5. ``ARRIVAL``: a request arrives
6. ``SAMPLE``: a timeline sample (configuration, thresholds), after everything else at that time

Among events of one kind and time, the one pushed first runs first (``seq``). A step starts when the
scheduling core's command for it is carried out, inside the event that led to it (as a worker starts
on receipt); completions happen at ``STEP_END`` (a request finishes when its last step does).
"""

from __future__ import annotations

from enum import IntEnum

from services.scheduler.core.events import Event, EventQueue

__all__ = ["Event", "EventQueue", "SimEvent"]


class SimEvent(IntEnum):
    STEP_END = 0
    PREDICTION = 1
    INSTANCE_UP = 2
    RECONFIG = 3
    ARRIVAL = 4
    SAMPLE = 5
