"""Scheduler <-> worker: one batched step command per instance, one results message back.

Pipelining: while a step runs, the scheduler may send the command for the step after it
(``after_step_id``), which the worker runs the moment the step ends when nothing about the batch
changed; the scheduler then learns of it from the results (``continued_step_id``), one step behind
the engine, as an overlap scheduler is.

A command names requests and thresholds only; the request state lives in Redis. A worker that holds
a request's state at ``state_version`` runs from its local copy (and KV cache); otherwise, or when
``load_state`` is set, it loads the state from Redis first. After the step the worker writes the new
state with a versioned write and reports the new version in its result.
"""

from __future__ import annotations

from enum import StrEnum

from shared.messages.base import ConfidenceStats, Message, Part, StepKind


class StepItem(Part, kw_only=True):
    """One request's part of a batched step."""

    request_id: str  # the request to advance by one step
    threshold: float  # confidence threshold for this step (Algorithm 1's choice)
    state_version: int  # version of the request's Redis state that this step starts from
    load_state: bool = False  # True: load the state from Redis (migration, or this worker lacks it)
    may_start_block: bool = False  # conditional command: go on even if the step before completed its block
    context_tokens: int = 0  # conditional command: a block start's cost under StepCommand.recompute_tokens (0: none)


class StepCommand(Message, kw_only=True):
    """Run one denoising step for a batch of requests on one instance (subject ``step.<instance>``)."""

    instance_id: str  # the instance that runs the step
    step_id: int  # scheduler-wide sequence number of this command; the results echo it
    items: list[StepItem]  # the batch; one forward serves them all
    drop_request_ids: list[str] = []  # requests that left this instance: free their local copy and KV cache
    issued_at: float  # unix time (s) the scheduler published the command
    # pipelining: nonzero makes this a conditional command for the step right after step
    # ``after_step_id`` on this instance. The worker keeps it until that step ends, then runs it at once
    # (no round trip to the scheduler) if that step's requests are all in this command, all
    # stepped, none completed its block (unless its item says ``may_start_block``) or finished
    # (unless ``drop_finished``), and each has at least ``min_masked`` masked tokens left; its other
    # items (``load_state``) join from the store; otherwise it discards it. Its results say which
    # happened (``continued_step_id``). A later conditional command for the same step replaces an
    # earlier one. One that comes after its step ended runs on arrival if none had come by then and it
    # passes the rule (``StepResults.awaits_held``; the rule: ``shared.pipelining``).
    after_step_id: int = 0  # 0: run on arrival; else the step this conditional command follows
    min_masked: int = 0  # the condition above (with after_step_id)
    drop_finished: bool = False  # with after_step_id: requests that finished are left out, the rest go on
    # with after_step_id: the most context tokens (items' ``context_tokens``) of block starts the step
    # may carry for the requests of the step it follows, one always allowed (the scheduler's recompute
    # budget less what joining requests take); more, and the worker waits for the scheduler
    recompute_tokens: int = 0  # 0: no cap
    # repeats, with after_step_id: where no held command is in hand when this step ends, it runs
    # again (the same requests and thresholds, less those that finished), up to this many more steps,
    # as step ids step_id + 1, + 2, ... (reserved for it), while the rule holds; a held command sent
    # for an earlier step of that chain, arriving late, applies to its latest (``shared.pipelining``)
    repeats: int = 0  # 0: never runs again by itself
    num_queued: int = 0  # requests queued at the scheduler (placed nowhere) when it composed this; for step records


class FailureKind(StrEnum):
    """Why a request did not step, as far as the scheduler acts on it."""

    STATE = "state"  # stale or missing state, or a write that failed: reload it, then step again
    KV_FULL = "kv_full"  # its KV cache would not fit the instance's budget: back to the queue (preempted)


class StepFailure(Part, kw_only=True):
    """A request the worker could not step (its state is unchanged)."""

    request_id: str  # the request that failed
    reason: str  # why (stale or missing state, engine error, ...)
    kind: FailureKind = FailureKind.STATE  # what the scheduler does about it


class RequestStepResult(Part, kw_only=True):
    """One request's outcome of a step: ``services.worker.engine.request.StepResult`` (``block_done``
    included) plus the state version the worker wrote and the answer's length at finish."""

    request_id: str  # the request this result is for
    kind: StepKind  # recompute (full forward) or cache step
    block_index: int  # the block this step decoded
    committed_positions: list[int]  # canvas indices committed by this step
    committed_token_ids: list[int]  # the tokens committed there, in the same order
    block_done: bool  # the decoded block has no masked position left (the scheduler's StepOutcome needs it)
    finished: bool  # no masked position left (or the block holding EOS is done)
    num_steps: int  # steps done so far, this one included
    num_masked: int  # masked canvas positions left
    confidence: ConfidenceStats  # confidences of the current block's still-masked positions
    threshold: float  # the threshold the step ran at
    state_version: int  # version of the request's Redis state after the worker's write
    blocks_skipped: int = 0  # blocks left undecoded because this step completed one holding an EOS
    num_answer_tokens: int = 0  # finished: the answer's tokens (generation-token metrics); else 0
    predicted_end: int | None = None  # canvas position where the model expects the EOS (step predictor feature)


class StepResults(Message, kw_only=True):
    """One instance finished one batched step (subject ``results``)."""

    instance_id: str  # the instance that ran the step
    step_id: int  # the command's step_id
    results: list[RequestStepResult] = []  # one per request that stepped
    failures: list[StepFailure] = []  # requests of the command that did not step
    started_at: float  # unix time (s) the forward started
    duration_s: float  # forward time, load and save of state included
    num_loaded: int = 0  # requests whose state was loaded from Redis before the step
    continued_step_id: int = 0  # nonzero: the worker went straight on to this conditional command's step
    # the scheduler, judging the conditional commands it sent by the same rule, expects that step's results
    awaits_held: bool = False  # none had come when it ended: the first that comes and passes runs on arrival

    @property
    def batch_size(self) -> int:
        """Requests the step served."""
        return len(self.results)
