"""A request's events, published by the worker that stepped it: a ``RequestProgress`` per step for
streaming requests (``text_delta``: the text of the block this step completed) and ``RequestFinished``
with the answer and its ``Usage`` when a request finishes; the worker has the tokenizer and the canvas
at hand, so it is the one that publishes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.worker.engine.protocol import Engine
from services.worker.engine.request import ConfidenceStats, RequestState, StepResult
from shared.generation import stream_release
from shared.messages import codec
from shared.messages.base import ConfidenceStats as WireConfidence
from shared.messages.events import RequestFinished, RequestProgress, TokenLogprobs, Usage
from shared.state import RequestRecord
from shared.subjects import Subjects


@dataclass
class EventPublisher:
    """Publishes the events of the requests one worker steps, on each request's events subject."""

    nc: object  # the worker's NATS connection
    subjects: Subjects
    engine: Engine  # the worker's engine: its ``eos_id``, ``mask_id`` and ``decode``
    instance_id: str
    clock: Callable[[], float]  # the worker's unix time (a finished request's latency without ``finished_at``)
    max_payload_bytes: int

    async def publish(self, record: RequestRecord, state: RequestState, outcome: StepResult, threshold: float) -> None:
        """The events of one request's step at ``threshold`` (``record``: as stored after it)."""
        subject = self.subjects.events(record.request_id)
        if record.stream:
            delta, delta_ids, logprobs = "", [], None
            if outcome.block_done or outcome.finished:
                delta, delta_ids, logprobs = self._stream_delta(record, state, outcome)
            progress = RequestProgress(
                request_id=record.request_id, seq=record.num_steps + 1, num_steps=record.num_steps,
                block_index=outcome.block_index, committed_positions=list(outcome.committed_positions),
                committed_token_ids=list(outcome.committed_token_ids), num_committed=record.num_committed,
                gen_length=record.gen_length, text_delta=delta, threshold=threshold,
                instance_id=self.instance_id, delta_token_ids=delta_ids, logprobs=logprobs,
            )
            await self.nc.publish(subject, codec.encode(progress, self.max_payload_bytes))
        if outcome.finished:
            await self.nc.publish(subject, codec.encode(self._finished(record), self.max_payload_bytes))

    def _finished(self, record: RequestRecord) -> RequestFinished:
        tokens = record.answer(self.engine.eos_id).token_ids
        latency = (record.finished_at or self.clock()) - record.arrival_time
        usage = Usage(
            prompt_tokens=len(record.prompt_token_ids), completion_tokens=len(tokens),
            num_steps=record.num_steps, num_recompute_steps=record.num_recompute_steps,
            thresholds=list(record.threshold_history), instance_ids=list(record.instance_history),
            num_migrations=record.num_migrations, latency_s=latency,
            slo_met=latency * 1000.0 <= record.slo_ms,
        )
        return RequestFinished(
            request_id=record.request_id, seq=record.num_steps + 2, text=self._text(tokens),
            token_ids=tokens, finish_reason=record.finish_reason or "stop", usage=usage,
            logprobs=record.token_logprobs(0, len(tokens)),
        )

    def _stream_delta(self, record: RequestRecord, state: RequestState,
                      outcome: StepResult) -> tuple[str, list[int], TokenLogprobs | None]:
        """The text a stream gets at this step (its block done, or the request finished): the answer's
        tokens in the canvas up to the block's end, less what the step that completed the block before
        released, less (until the end) the last tokens a stop string could still take back."""
        start, end = state.block_bounds(outcome.block_index)
        eos = self.engine.eos_id
        if outcome.finished:
            tokens = record.answer(eos).token_ids
        else:
            tokens = state.answer(eos, upto=end).token_ids
        before = state.answer(eos, upto=start).token_ids
        released_before = stream_release(len(before), record.stop, finished=False)
        released = max(stream_release(len(tokens), record.stop, outcome.finished), released_before)
        text = self._text(tokens[:released])[len(self._text(tokens[:released_before])):]
        return text, tokens[released_before:released], record.token_logprobs(released_before, released)

    def _text(self, ids: list[int]) -> str:
        return self.engine.decode([i for i in ids if i != self.engine.mask_id])


def wire_confidence(stats: ConfidenceStats) -> WireConfidence:
    """The engine's confidence statistics as the wire carries them."""
    return WireConfidence(min=stats.min, q25=stats.q25, median=stats.median, mean=stats.mean, q75=stats.q75)
