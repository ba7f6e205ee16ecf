"""Answer bodies and server-sent-event chunks, from a request's events (pure: no I/O).

A non-streaming answer is one ``text_completion`` or ``chat.completion`` object. A stream is a
sequence of ``data:`` chunks, one per non-empty ``RequestProgress.text_delta`` (``choices[0].text``,
or ``choices[0].delta.content`` for chat, whose first chunk also carries ``delta.role``), optional
``event: progress`` lines (step, threshold, instance, canvas), a final chunk with ``finish_reason``
and ``usage``, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from services.gateway.errors import ApiError
from services.gateway.models import ServedModel, TextCodec
from services.gateway.prepare import PreparedRequest
from services.gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    ModelCard,
    ProgressInfo,
    RequestInfo,
    StepInfo,
    UsageInfo,
)
from shared.messages.events import RequestFinished, RequestProgress, Usage
from shared.state import RequestRecord, RequestStatus, StepRecord

DONE = "data: [DONE]\n\n"


def usage_info(usage: Usage, slo_ms: float) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens, steps=usage.num_steps,
        recompute_steps=usage.num_recompute_steps, thresholds=list(usage.thresholds),
        instances=list(usage.instance_ids), migrations=usage.num_migrations, latency_ms=usage.latency_s * 1000.0,
        slo_ms=slo_ms, slo_met=usage.slo_met,
    )


def created_at(prepared: PreparedRequest) -> int:
    return int(prepared.request.arrival_time)


def final_answer(prepared: PreparedRequest, finished: RequestFinished) -> dict:
    """The whole (non-streaming) answer."""
    usage = usage_info(finished.usage, prepared.request.slo_ms)
    common = {"id": prepared.request_id, "created": created_at(prepared), "model": prepared.model.name,
              "usage": usage}
    if prepared.chat:
        choice = ChatChoice(message=AssistantMessage(content=finished.text), finish_reason=finished.finish_reason)
        return ChatCompletionResponse(choices=[choice], **common).model_dump()
    choice = CompletionChoice(text=finished.text, finish_reason=finished.finish_reason)
    return CompletionResponse(choices=[choice], **common).model_dump()


def sse_data(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class CanvasTracker:
    """The generation canvas as progress events fill it in (masked where nothing was committed yet)."""

    def __init__(self, gen_length: int, mask_token_id: int) -> None:
        self.token_ids = [mask_token_id] * gen_length  # canvas position -> committed token or the mask

    def apply(self, progress: RequestProgress) -> None:
        for position, token_id in zip(progress.committed_positions, progress.committed_token_ids, strict=False):
            if 0 <= position < len(self.token_ids):
                self.token_ids[position] = token_id


class StreamFormatter:
    """SSE chunks of one streamed request, in OpenAI's delta format."""

    def __init__(self, prepared: PreparedRequest) -> None:
        self.prepared = prepared
        self.canvas = CanvasTracker(prepared.request.gen_length, prepared.model.codec.mask_token_id)
        self.streamed_text = ""  # concatenated deltas sent so far
        self._role_sent = False  # chat: the first chunk carries delta.role

    def progress(self, event: RequestProgress) -> list[str]:
        """Chunks for one progress event: its text delta, and the progress line when asked for."""
        self.canvas.apply(event)
        chunks = []
        if self.prepared.include_progress:
            info = ProgressInfo(request_id=event.request_id, step=event.num_steps, threshold=event.threshold,
                                instance_id=event.instance_id,
                                canvas=self.prepared.model.codec.render_canvas(self.canvas.token_ids))
            chunks.append(f"event: progress\n{sse_data(info.model_dump())}")
        if event.text_delta:
            chunks.append(self._text_chunk(event.text_delta))
        return chunks

    def finished(self, event: RequestFinished) -> list[str]:
        """The text no delta carried (lost progress events), then the final chunk with usage."""
        chunks = []
        if event.text.startswith(self.streamed_text) and len(event.text) > len(self.streamed_text):
            chunks.append(self._text_chunk(event.text[len(self.streamed_text):]))
        usage = usage_info(event.usage, self.prepared.request.slo_ms)
        chunks.append(sse_data(self._chunk("", event.finish_reason, usage)))
        return chunks

    @staticmethod
    def error(error: ApiError) -> str:
        return sse_data(error.body())

    def _text_chunk(self, text: str) -> str:
        self.streamed_text += text
        return sse_data(self._chunk(text, None, None))

    def _chunk(self, text: str, finish_reason: str | None, usage: UsageInfo | None) -> dict:
        common = {"id": self.prepared.request_id, "created": created_at(self.prepared),
                  "model": self.prepared.model.name, "usage": usage}
        if self.prepared.chat:
            delta = ChatDelta(role=None if self._role_sent else "assistant", content=text or None)
            self._role_sent = True
            chunk = ChatCompletionChunk(choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)],
                                        **common).model_dump()
            chunk["choices"][0]["delta"] = delta.model_dump(exclude_none=True)  # OpenAI omits absent keys
        else:
            choice = CompletionChoice(text=text, finish_reason=finish_reason)
            chunk = CompletionResponse(choices=[choice], **common).model_dump()
        if usage is None:
            del chunk["usage"]
        return chunk


def model_card(model: ServedModel) -> ModelCard:
    return ModelCard(id=model.name, created=model.created, max_sequence_length=model.max_sequence_length,
                     max_model_len=model.max_sequence_length, default_max_tokens=model.default_gen_length,
                     default_block_length=model.default_block_length, max_canvas=model.limits.max_gen_length)


def request_info(record: RequestRecord, steps: Sequence[StepRecord], codec: TextCodec) -> RequestInfo:
    """A stored request as the API shows it (text decoded with the served model's tokenizer)."""
    finished = record.status == RequestStatus.FINISHED
    return RequestInfo(
        id=record.request_id, status=record.status.name.lower(), model=record.model,
        prompt=codec.decode(record.prompt_token_ids), canvas=codec.render_canvas(record.canvas),
        output=codec.decode(record.canvas) if finished else None, finish_reason=record.finish_reason or None,
        gen_length=record.gen_length, block_length=record.block_length, cache=str(record.cache_mode.value),
        priority=record.priority, min_threshold=record.min_threshold, max_threshold=record.max_threshold,
        num_committed=record.num_committed, thresholds=list(record.threshold_history),
        instances=list(record.instance_history), num_steps=record.num_steps,
        num_recompute_steps=record.num_recompute_steps, num_migrations=record.num_migrations,
        steps=[step_info(step) for step in steps], arrival_time=record.arrival_time, deadline=record.deadline,
        slo_ms=record.slo_ms, finished_at=record.finished_at,
        slo_met=None if not finished or record.finished_at is None else record.finished_at <= record.deadline,
        detail=record.detail,
    )


def step_info(step: StepRecord) -> StepInfo:
    return StepInfo(step_index=step.step_index, instance_id=step.instance_id, kind=step.kind.name.lower(),
                    block_index=step.block_index, threshold=step.threshold,
                    committed_positions=list(step.committed_positions), batch_size=step.batch_size,
                    loaded_state=step.loaded_state, started_at=step.started_at, duration_s=step.duration_s)
