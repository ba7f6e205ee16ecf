"""Request bookkeeping: one lifecycle enum, monotone counters, transitions in one place.

``RequestStatus`` and ``CacheMode`` are the wire contract's (``shared.messages.base``): one
definition each, shared with the engine, the Redis record and the gateway; the transitions between
statuses live here.

Only ``ClusterView`` (``view.py``) calls the transition methods here; policies read requests and
return decisions, they never change a request themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.messages.base import CacheMode, RequestStatus

# status -> statuses it may move to
_ALLOWED_MOVES: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.QUEUED: frozenset({RequestStatus.RUNNING, RequestStatus.REJECTED, RequestStatus.CANCELLED}),
    RequestStatus.READY: frozenset(
        {RequestStatus.RUNNING, RequestStatus.MIGRATING, RequestStatus.QUEUED, RequestStatus.CANCELLED}
    ),
    RequestStatus.RUNNING: frozenset({RequestStatus.READY, RequestStatus.FINISHED, RequestStatus.CANCELLED}),
    RequestStatus.MIGRATING: frozenset({RequestStatus.READY, RequestStatus.FINISHED, RequestStatus.CANCELLED}),
}


class TransitionError(RuntimeError):
    """A request was asked to move to a status its current one cannot reach."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """Remaining steps per candidate threshold, as the step predictor made them.

    ``threshold_to_steps``: threshold -> (remaining recompute steps, remaining cache steps), counted
    from the step ``made_at_step`` (the request's ``num_steps_done`` when the features were taken).
    With cache mode NONE the split does not matter: their sum is the number of full steps.
    """

    threshold_to_steps: dict[float, tuple[int, int]]
    made_at_step: int = 0


@dataclass(slots=True)
class Request:
    """One generation request and its progress. Counters only grow."""

    request_id: str
    arrival_time: float
    prompt_len: int
    gen_len: int
    slo_s: float
    block_len: int = 32
    priority: int = 0  # larger is more important; see LoadControlConfig.protected_priority
    cache_mode: CacheMode = CacheMode.DUAL
    min_threshold: float = 0.0  # quality floor: no step runs below it
    max_threshold: float = 1.0
    model: str = ""  # the model the client named: it runs only on instances of it (view.serves); "": any
    # set by ClusterView
    seq: int = -1  # admission order, the tie-break of last resort
    status: RequestStatus = RequestStatus.QUEUED
    instance_id: str | None = None  # the instance holding its state
    previous_instance_id: str | None = None
    # monotone counters
    num_steps_done: int = 0
    num_tokens_committed: int = 0
    current_block: int = 0
    num_block_steps: int = 0  # steps done inside the current block (0: next step starts the block)
    num_block_tokens: int = 0  # tokens committed inside the current block
    num_migrations: int = 0
    num_preemptions: int = 0  # times it yielded its KV memory to a queued request
    last_migration_step: int = -(10**9)
    # where its state is (the stored state of the live system, the simulator's emulation of it)
    state_version: int = 0  # version of the stored state its next step starts from
    holder_id: str | None = None  # the instance holding its latest state (local copy, KV cache); None: only the store
    reloading: bool = False  # its last step was lost or failed: its state is reloaded before the next
    confidence: tuple[float, ...] | None = None  # (min, q25, median, mean, q75) after its last step
    predicted_end: int | None = None  # where the engine last said it expects the EOS (a predictor feature)
    # latest decisions and predictions
    threshold: float | None = None
    prediction: Prediction | None = None
    first_prediction: Prediction | None = None
    finish_time: float | None = None
    detail: str = field(default="", repr=False)  # why it was rejected or cancelled

    @property
    def deadline(self) -> float:
        return self.arrival_time + self.slo_s

    @property
    def context_tokens(self) -> int:
        """Tokens a full forward processes: prompt plus the whole generation canvas."""
        return self.prompt_len + self.gen_len

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.gen_len / self.block_len)

    @property
    def num_remaining_tokens(self) -> int:
        return max(self.gen_len - self.num_tokens_committed, 0)

    @property
    def next_step_is_recompute(self) -> bool:
        """A full forward: always without a cache, else at each block start."""
        return self.cache_mode == CacheMode.NONE or self.num_block_steps == 0

    @property
    def max_remaining_recompute_steps(self) -> int:
        """With a cache, at most one per block not started yet: fewer when the answer's EOS ends it
        early (a request stops at the block that completes its EOS)."""
        started = 0 if self.num_block_steps == 0 else 1
        return max(self.num_blocks - self.current_block - started, 0)

    @property
    def min_remaining_recompute_steps(self) -> int:
        """With a cache, at least the step that starts the next block when that is the next step."""
        return int(self.num_remaining_tokens > 0 and self.num_block_steps == 0)

    def budget(self, now: float) -> float:
        """Remaining SLO budget B_r in seconds (negative once the deadline has passed)."""
        return self.deadline - now

    # transitions (called by ClusterView only)

    def move(self, status: RequestStatus) -> None:
        if status not in _ALLOWED_MOVES.get(self.status, frozenset()):
            raise TransitionError(f"request {self.request_id}: {self.status.name} -> {status.name}")
        self.status = status

    @property
    def last_block(self) -> tuple[int, int, int]:
        """(index, size, committed positions) of the block its last step decoded ((0, size, 0) before any)."""
        index = self.current_block - 1 if self.num_block_steps == 0 and self.num_steps_done else self.current_block
        index = max(index, 0)
        size = min(self.block_len, self.gen_len - index * self.block_len)
        committed = size if index < self.current_block else self.num_block_tokens
        return index, size, committed

    def record_step(self, num_committed: int, block_done: bool) -> None:
        self.num_steps_done += 1
        self.num_tokens_committed += num_committed
        if block_done:
            self.current_block += 1
            self.num_block_steps = 0
            self.num_block_tokens = 0
        else:
            self.num_block_steps += 1
            self.num_block_tokens += num_committed

    def catch_up(self, num_steps: int, num_committed: int, current_block: int) -> None:
        """Steps stored by a worker whose results never came (it died): the counters as stored; the
        next step starts its block afresh (a recompute: no instance holds a cache)."""
        self.num_steps_done = max(self.num_steps_done, num_steps)
        self.num_tokens_committed = max(self.num_tokens_committed, num_committed)
        self.current_block = max(self.current_block, current_block)
        self.num_block_steps = 0
        self.num_block_tokens = 0

    def record_prediction(self, prediction: Prediction) -> None:
        if self.first_prediction is None:
            self.first_prediction = prediction
        self.prediction = prediction
