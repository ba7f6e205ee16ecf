"""Ordering of simultaneous scheduling events, and the one event queue (the simulator's too).

Events are ordered by ``(time, kind, seq)``: at equal times a step result goes first (it frees
batch slots and brings fresh progress), then predictions, then instance changes, then arrivals,
then ticks; among events of one kind the one pushed first goes first (``seq``). The queue takes any
``IntEnum`` of kinds: the simulator's ``SimEvent`` extends this order with its own kinds.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple


class EventKind(IntEnum):
    STEP_RESULT = 0
    PREDICTION = 1
    INSTANCE_CHANGE = 2
    ARRIVAL = 3
    TICK = 4


class EventKey(NamedTuple):
    time: float
    kind: IntEnum  # EventKind, or the simulator's SimEvent
    seq: int  # pushes before this one: the tie-break of last resort


@dataclass(order=True, slots=True)
class Event:
    key: EventKey
    payload: Any = field(compare=False, default=None)

    @property
    def time(self) -> float:
        return self.key.time

    @property
    def kind(self) -> IntEnum:
        return self.key.kind


class EventQueue:
    """A heap of events in ``EventKey`` order."""

    def __init__(self) -> None:
        self._heap: list[Event] = []
        self._num_pushed = 0

    def push(self, time: float, kind: IntEnum, payload: Any = None) -> Event:
        event = Event(EventKey(float(time), kind, self._num_pushed), payload)
        self._num_pushed += 1
        heapq.heappush(self._heap, event)
        return event

    def pop(self) -> Event:
        return heapq.heappop(self._heap)

    def peek_time(self) -> float:
        return self._heap[0].key.time

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)
