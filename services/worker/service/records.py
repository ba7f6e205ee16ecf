"""A request's durable record (``shared.state.RequestRecord``, in Redis) and the engine's working copy of
it (``RequestState``): the one place that maps the one onto the other.

A worker steps a request from its local copy (``ResidentRequest``) when it holds the version the
command names; otherwise it loads the record and builds the state from it (``state_of``: a
migration, a restart, a lost result). After a step, the record it writes is the one it loaded, moved
on by what the step did (``advanced``). The fields both sides hold under one meaning are listed once
(``STATE_FROM_RECORD``, ``STEPPED``), so the mapping is not written out field by field in each
direction.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from services.worker.decoding.sampling import SamplingParams
from services.worker.engine.request import RequestState, StepResult
from shared.messages.base import StepKind
from shared.messages.steps import StepItem
from shared.state import RequestRecord, RequestStatus

# RequestState field -> the RequestRecord field it copies (the same value; lists copied, not shared)
STATE_FROM_RECORD = {
    "request_id": "request_id", "prompt_ids": "prompt_token_ids", "canvas": "canvas",
    "block_length": "block_length", "cache_mode": "cache_mode", "num_steps": "num_steps",
    "ignore_eos": "ignore_eos", "max_tokens": "max_tokens", "stop_length": "stop_length",
    "confidences": "confidences", "top_token_ids": "top_token_ids", "top_probs": "top_probs",
}
# the fields of both that a step changes (one name on both sides): copied back into the record it writes
# (``top_token_ids`` and ``top_probs`` stay empty on both sides unless the request asked for logprobs)
STEPPED = ("canvas", "confidences", "top_token_ids", "top_probs", "stop_length")


@dataclass
class ResidentRequest:
    """A request this worker stepped last: its engine state and the record it wrote."""

    state: RequestState
    record: RequestRecord  # as stored after this worker's last write (its version is the stored one)


def state_of(record: RequestRecord) -> RequestState:
    """The engine's state of a stored request (it continues on any engine from this)."""
    copied = {name: _copied(getattr(record, source)) for name, source in STATE_FROM_RECORD.items()}
    return RequestState(**copied, stop=tuple(record.stop), num_top_logprobs=record.logprobs or 0,
                        sampling=SamplingParams(record.temperature, record.top_p, record.top_k, record.seed))


def advanced(record: RequestRecord, state: RequestState, outcome: StepResult, threshold: float, *,
             instance_id: str, mask_id: int, eos_id: int, now: float) -> RequestRecord:
    """``record`` moved on by one step of ``instance_id`` (``state``: the engine's copy after it)."""
    history = list(record.instance_history)
    if instance_id not in history:
        history.append(instance_id)
    moved = record.last_instance_id is not None and record.last_instance_id != instance_id
    changes = {name: _copied(getattr(state, name)) for name in STEPPED}
    changes.update(
        num_steps=record.num_steps + 1, num_committed=len(state.canvas) - state.canvas.count(mask_id),
        current_block=state.current_block(mask_id),
        threshold_history=[*record.threshold_history, threshold], last_instance_id=instance_id,
        instance_history=history, num_migrations=record.num_migrations + int(moved),
        num_recompute_steps=record.num_recompute_steps + int(outcome.kind == StepKind.RECOMPUTE),
        status=RequestStatus.RUNNING,
    )
    if outcome.finished:
        changes.update(status=RequestStatus.FINISHED, finished_at=now, finish_reason=state.answer(eos_id).finish_reason)
    return msgspec.structs.replace(record, **changes)


def load_problem(item: StepItem, record: RequestRecord | None) -> str:
    """Why a loaded record cannot step as ``item`` says ("" when it can)."""
    if record is None:
        return "state missing in Redis (expired or never stored)"
    if record.is_terminal:
        return f"request is {record.status.name}"
    if record.version != item.state_version:
        return f"stale state: command names version {item.state_version}, Redis holds {record.version}"
    return ""


def _copied(value):
    """A list (and the lists in it) copied, so that a change on one side never shows on the other."""
    if not isinstance(value, list):
        return value
    if value and isinstance(value[0], list):
        return [list(inner) for inner in value]
    return list(value)
