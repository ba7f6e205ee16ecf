"""What a policy returns, and the step results it is told about. Plain data, no logic."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from services.scheduler.core.request import Prediction


class RejectReason(IntEnum):
    DEADLINE_INFEASIBLE = 1  # even the lowest allowed threshold cannot meet the deadline
    FLOOR_UNSATISFIABLE = 2  # no candidate threshold is at or above the request's quality floor
    NO_INSTANCE = 3  # the cluster has no live instance that could ever hold it


@dataclass(frozen=True, slots=True)
class StepAssignment:
    """Run the request's next step on ``instance_id`` at ``threshold``."""

    request_id: str
    instance_id: str
    threshold: float
    is_migration: bool = False  # the state moves from ``from_instance_id`` before the step
    recompute: bool = True  # the step is a full forward (block start, or no cache)
    from_instance_id: str | None = None
    estimated_remaining_s: float = 0.0  # Algorithm 1's estimate at the chosen threshold
    max_allowed_threshold: float | None = None  # top of the range load control allowed (None: no control)


@dataclass(frozen=True, slots=True)
class Rejection:
    request_id: str
    reason: RejectReason
    detail: str = ""  # human-readable numbers behind the reason


@dataclass(frozen=True, slots=True)
class Preemption:
    """A request yields its KV memory: back to the queue, its cache dropped (it resumes from its stored
    state with a recompute step)."""

    request_id: str
    instance_id: str  # where it was
    for_request_id: str = ""  # the queued request it makes room for ("": its step did not fit the worker's budget)
    holder_id: str | None = None  # the instance that held its copy and KV cache (to drop them)


@dataclass(slots=True)
class Decisions:
    """Everything one ``schedule`` call decided."""

    assignments: list[StepAssignment] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    # requests that yielded their KV memory (back to the queue; their holder drops the cache), decided
    # by the loop before the policy's pass (services/scheduler/core/memory.py)
    preemptions: list[Preemption] = field(default_factory=list)

    @property
    def migrations(self) -> list[StepAssignment]:
        return [a for a in self.assignments if a.is_migration]

    def __len__(self) -> int:
        return len(self.assignments) + len(self.rejections) + len(self.preemptions)


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """One request's part of a finished step."""

    request_id: str
    num_committed: int  # tokens committed by this step
    block_done: bool = False  # the current block has no masks left
    finished: bool = False  # the whole generation is done
    recompute: bool = True  # the step was a full forward
    prediction: Prediction | None = None  # fresh remaining-step prediction, if one came with it
    state_version: int = 0  # version of the stored state after the step (0: not told)
    confidence: tuple[float, ...] | None = None  # (min, q25, median, mean, q75) of the block still masked
    num_masked: int = 0  # masked positions left in its canvas (0: not told; the held-step rule reads it)
    predicted_end: int | None = None  # canvas position where the engine expects its EOS (None: not told)


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """One instance finished one batched step: its requests' outcomes (the engine's per-request
    ``StepResult``s, as the scheduler sees them)."""

    instance_id: str
    outcomes: tuple[StepOutcome, ...]
    duration_s: float = 0.0
    step_id: int = 0  # the command it answers (``StepScheduler`` checks it is the one in flight)
    failed_ids: tuple[str, ...] = ()  # requests of the command that did not step (stale or missing state)
    kv_full_ids: tuple[str, ...] = ()  # requests the worker refused: their KV cache would not fit its budget
    continued_step_id: int = 0  # the instance went straight on to this held command (pipelining)
    awaits_held: bool = False  # no held command had come when the step ended: the first that passes runs on arrival
