"""Per-request events to the gateway (subject ``events.<request id>``).

``seq`` orders a request's events without coordination between publishers: ``RequestAccepted`` is 1,
the ``RequestProgress`` of step n is n + 1, and the final event is num_steps + 2. The gateway drops
duplicates and reorders by it; gaps are normal (progress is sent only for streaming requests). A
request ends with exactly one ``RequestFinished`` or ``RequestFailed``.
"""

from __future__ import annotations

from enum import IntEnum

from shared.messages.base import Message, Part


class FailureReason(IntEnum):
    """Why a request ended without an answer. 1-3 mirror the scheduler's ``RejectReason``."""

    DEADLINE_INFEASIBLE = 1  # even the lowest allowed threshold cannot meet the deadline
    FLOOR_UNSATISFIABLE = 2  # no candidate threshold is at or above the request's quality floor
    NO_INSTANCE = 3  # the cluster has no live instance that could ever hold it
    CANCELLED = 4  # the client or an operator cancelled it
    INVALID = 5  # the request could not be run (prompt too long, unknown model, ...)
    WORKER_ERROR = 6  # a worker failed on it and it could not be retried
    INTERNAL = 7  # anything else; ``detail`` says what


class RequestAccepted(Message, kw_only=True):
    """The scheduler admitted the request and stored it (the intake message is acked)."""

    request_id: str  # the request
    seq: int  # order among this request's events (see the module docstring)
    prompt_tokens: int  # prompt length in tokens
    deadline: float  # unix time (s) the request should finish by


class TokenLogprobs(Part, kw_only=True):
    """Per answer token (the ``token_ids`` it goes with, in order): the probability the model committed
    it with (its confidence when the step committed it; ``log`` of it is the logprob) and, when asked
    for, the most likely tokens at that position in that step."""

    probs: list[float]  # probability of each token, when it was committed
    top_token_ids: list[list[int]] = []  # per token: the most likely tokens there (empty: not asked for)
    top_probs: list[list[float]] = []  # per token: their probabilities, in the same order


class RequestProgress(Message, kw_only=True):
    """A step committed tokens (sent only for streaming requests)."""

    request_id: str  # the request
    seq: int  # order among this request's events (see the module docstring)
    num_steps: int  # steps done so far
    block_index: int  # the block the step decoded
    committed_positions: list[int]  # canvas indices committed by this step
    committed_token_ids: list[int]  # the tokens committed there
    num_committed: int  # committed canvas positions so far
    gen_length: int  # canvas length
    text_delta: str = ""  # text of blocks completed by this step, in order (what SSE streams)
    threshold: float  # the threshold the step ran at
    instance_id: str  # the instance that ran the step
    delta_token_ids: list[int] = []  # the answer tokens whose text is text_delta
    logprobs: TokenLogprobs | None = None  # of delta_token_ids, when the request asked for logprobs


class Usage(Part, kw_only=True):
    """What a finished request cost and how it was served."""

    prompt_tokens: int  # prompt length in tokens
    completion_tokens: int  # generated tokens (up to EOS)
    num_steps: int  # denoising steps
    num_recompute_steps: int  # of which full forwards
    thresholds: list[float]  # threshold of every step, in order
    instance_ids: list[str]  # instances it ran on, in order of first visit
    num_migrations: int  # moves between instances
    latency_s: float  # arrival to finish
    slo_met: bool  # latency_s within the SLO

    @property
    def num_cache_steps(self) -> int:
        return self.num_steps - self.num_recompute_steps


class RequestFinished(Message, kw_only=True):
    """The request completed; the final answer."""

    request_id: str  # the request
    seq: int  # order among this request's events (see the module docstring)
    text: str  # the generated text, up to EOS
    token_ids: list[int]  # the generated tokens, up to EOS
    finish_reason: str = "stop"  # "stop" (EOS or a stop string) or "length" (the cap, or the canvas filled up)
    usage: Usage  # steps, thresholds, instances, SLO
    logprobs: TokenLogprobs | None = None  # of token_ids, when the request asked for logprobs


class RequestFailed(Message, kw_only=True):
    """The request ended without an answer."""

    request_id: str  # the request
    seq: int  # order among this request's events (see the module docstring)
    reason: FailureReason  # the kind of failure
    detail: str = ""  # human-readable numbers behind the reason


# What a gateway decodes on an events subject.
RequestEvent = RequestAccepted | RequestProgress | RequestFinished | RequestFailed
