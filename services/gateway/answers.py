"""Answer bodies and server-sent-event chunks, from a request's events (pure: no I/O).

A non-streaming answer is one ``text_completion`` or ``chat.completion`` object with one choice per
``n``. A stream is a sequence of ``data:`` chunks, one per non-empty ``RequestProgress.text_delta``
of each choice (``choices[0].text``, or ``choices[0].delta.content`` for chat, whose first chunk of a
choice also carries ``delta.role``; ``choices[0].index`` says which choice), optional ``event:
progress`` lines (step, threshold, instance, canvas), a chunk with ``finish_reason`` per choice, with
``stream_options.include_usage`` a last chunk with ``choices: []`` and ``usage`` (OpenAI's and vLLM's
shape; no other chunk carries usage), then ``data: [DONE]``.

``logprobs``: per token, the log of the probability the model committed it with (its confidence at
the step that committed it, ``TokenLogprobs``), in OpenAI's shapes: completions ``{tokens,
token_logprobs, top_logprobs, text_offset}``, chat ``{content: [{token, logprob, bytes,
top_logprobs}]}``. A token's text is its own decoding; a probability of 0 is logprob -9999 (vLLM's
stand-in for minus infinity, which JSON cannot hold).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from services.gateway.errors import ApiError
from services.gateway.models import ServedModel, TextCodec
from services.gateway.prepare import PreparedRequest
from services.gateway.schemas import (
    AssistantMessage,
    CalibrationInfo,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ModelCard,
    ModelState,
    ProgressInfo,
    RequestInfo,
    StepInfo,
    TopLogprob,
    UsageInfo,
)
from shared.calibration import HOW_TO
from shared.messages.control import WorkerHeartbeat, WorkerStatus
from shared.messages.events import RequestFinished, RequestProgress, TokenLogprobs, Usage
from shared.state import RequestRecord, RequestStatus, StepRecord

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see the stream is alive
NO_PROBABILITY_LOGPROB = -9999.0  # the logprob of a probability of 0 (JSON has no -inf)


def usage_info(usage: Usage, slo_ms: float) -> UsageInfo:
    return combined_usage([usage], slo_ms)


def combined_usage(usages: Sequence[Usage], slo_ms: float) -> UsageInfo:
    """The usage of a request's choices together: the prompt once (as OpenAI counts it), the answers'
    tokens, steps, migrations summed, thresholds in choice order, instances in order of first visit,
    the slowest latency, the SLO met by every choice."""
    prompt = usages[0].prompt_tokens
    completion = sum(u.completion_tokens for u in usages)
    instances = list(dict.fromkeys(i for u in usages for i in u.instance_ids))
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
        steps=sum(u.num_steps for u in usages), recompute_steps=sum(u.num_recompute_steps for u in usages),
        thresholds=[t for u in usages for t in u.thresholds], instances=instances,
        migrations=sum(u.num_migrations for u in usages), latency_ms=max(u.latency_s for u in usages) * 1000.0,
        slo_ms=slo_ms, slo_met=all(u.slo_met for u in usages),
    )


def created_at(prepared: PreparedRequest) -> int:
    return int(prepared.request.arrival_time)


def logprob(probability: float) -> float:
    return math.log(probability) if probability > 0.0 else NO_PROBABILITY_LOGPROB


def completion_logprobs(codec: TextCodec, token_ids: Sequence[int], probs: TokenLogprobs | None,
                        num_top: int | None, text_start: int = 0) -> CompletionLogprobs | None:
    """Completions' logprobs of ``token_ids`` (their text starting at ``text_start`` of the choice's)."""
    if probs is None or num_top is None:
        return None
    tokens = [codec.decode([t]) for t in token_ids]
    offsets, at = [], text_start
    for text in tokens:
        offsets.append(at)
        at += len(text)
    top = None
    if num_top:
        top = [{codec.decode([t]): logprob(p) for t, p in zip(ids, ps, strict=False)}
               for ids, ps in zip(probs.top_token_ids, probs.top_probs, strict=False)]
    return CompletionLogprobs(tokens=tokens, token_logprobs=[logprob(p) for p in probs.probs], top_logprobs=top,
                              text_offset=offsets)


def chat_logprobs(codec: TextCodec, token_ids: Sequence[int], probs: TokenLogprobs | None,
                  num_top: int | None) -> ChatLogprobs | None:
    """Chat's logprobs of ``token_ids``."""
    if probs is None or num_top is None:
        return None
    tops = probs.top_token_ids if num_top else [[] for _ in token_ids]
    top_probs = probs.top_probs if num_top else [[] for _ in token_ids]
    content = []
    for token, p, ids, ps in zip(token_ids, probs.probs, tops, top_probs, strict=False):
        text = codec.decode([token])
        alternatives = [TopLogprob(token=codec.decode([t]), logprob=logprob(q), bytes=list(codec.decode([t]).encode()))
                        for t, q in zip(ids, ps, strict=False)]
        content.append(ChatTokenLogprob(token=text, logprob=logprob(p), bytes=list(text.encode()),
                                        top_logprobs=alternatives))
    return ChatLogprobs(content=content)


def final_answer(prepared: PreparedRequest, finals: Sequence[RequestFinished]) -> dict:
    """The whole (non-streaming) answer: one choice per finished choice request, in choice order."""
    usage = combined_usage([f.usage for f in finals], prepared.request.slo_ms)
    common = {"id": prepared.response_id, "created": created_at(prepared), "model": prepared.model.name,
              "usage": usage}
    codec, num_top = prepared.model.codec, prepared.request.logprobs
    if prepared.chat:
        choices = [ChatChoice(index=i, message=AssistantMessage(content=f.text), finish_reason=f.finish_reason,
                              logprobs=chat_logprobs(codec, f.token_ids, f.logprobs, num_top))
                   for i, f in enumerate(finals)]
        return ChatCompletionResponse(choices=choices, **common).model_dump()
    choices = [CompletionChoice(index=i, text=f.text, finish_reason=f.finish_reason,
                                logprobs=completion_logprobs(codec, f.token_ids, f.logprobs, num_top))
               for i, f in enumerate(finals)]
    return CompletionResponse(choices=choices, **common).model_dump()


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


class _ChoiceStream:
    """What one choice of a stream has sent so far."""

    def __init__(self, prepared: PreparedRequest) -> None:
        self.canvas = CanvasTracker(prepared.request.gen_length, prepared.model.codec.mask_token_id)
        self.text = ""  # concatenated deltas sent so far
        self.num_tokens = 0  # answer tokens those deltas hold (their delta_token_ids)
        self.role_sent = False  # chat: the first chunk of a choice carries delta.role
        self.usage: Usage | None = None  # once finished


class StreamFormatter:
    """SSE chunks of one streamed request (its choices' events interleaved), in OpenAI's delta format."""

    def __init__(self, prepared: PreparedRequest) -> None:
        self.prepared = prepared
        self.choices = [_ChoiceStream(prepared) for _ in prepared.choice_requests]

    @property
    def streamed_text(self) -> str:
        return self.choices[0].text

    @property
    def all_finished(self) -> bool:
        return all(c.usage is not None for c in self.choices)

    def progress(self, event: RequestProgress, index: int = 0) -> list[str]:
        """Chunks for one progress event of choice ``index``: its text delta, and the progress line when
        asked for."""
        choice = self.choices[index]
        choice.canvas.apply(event)
        chunks = []
        if self.prepared.include_progress:
            info = ProgressInfo(request_id=event.request_id, step=event.num_steps, threshold=event.threshold,
                                instance_id=event.instance_id,
                                canvas=self.prepared.model.codec.render_canvas(choice.canvas.token_ids))
            chunks.append(f"event: progress\n{sse_data(info.model_dump())}")
        # tokens without text (EOS padding of ignore_eos) make a chunk only when their logprobs were asked for
        if event.text_delta or (event.delta_token_ids and event.logprobs is not None):
            chunks.append(self._text_chunk(index, event.text_delta, event.delta_token_ids, event.logprobs))
        return chunks

    def finished(self, event: RequestFinished, index: int = 0) -> list[str]:
        """The text no delta carried (lost progress events), then the chunk with ``finish_reason``."""
        choice = self.choices[index]
        chunks = []
        tokens_left = event.logprobs is not None and len(event.token_ids) > choice.num_tokens  # text-less tokens too
        if event.text.startswith(choice.text) and (len(event.text) > len(choice.text) or tokens_left):
            rest_ids = event.token_ids[choice.num_tokens:]
            rest = None
            if event.logprobs is not None:
                k = choice.num_tokens
                rest = TokenLogprobs(probs=event.logprobs.probs[k:], top_token_ids=event.logprobs.top_token_ids[k:],
                                     top_probs=event.logprobs.top_probs[k:])
            chunks.append(self._text_chunk(index, event.text[len(choice.text):], rest_ids, rest))
        choice.usage = event.usage
        chunks.append(sse_data(self._chunk(index, "", event.finish_reason)))
        return chunks

    def usage_chunk(self) -> str | None:
        """The last chunk (``choices: []`` and the usage) once every choice finished, when asked for."""
        usages = [c.usage for c in self.choices]
        if not self.prepared.include_usage or any(u is None for u in usages):
            return None
        usage = combined_usage(usages, self.prepared.request.slo_ms)
        model = ChatCompletionChunk if self.prepared.chat else CompletionResponse
        chunk = model(id=self.prepared.response_id, created=created_at(self.prepared), model=self.prepared.model.name,
                      choices=[], usage=usage)
        return sse_data(chunk.model_dump())

    @staticmethod
    def error(error: ApiError) -> str:
        return sse_data(error.body())

    def _text_chunk(self, index: int, text: str, token_ids: Sequence[int], probs: TokenLogprobs | None) -> str:
        choice = self.choices[index]
        start = len(choice.text)
        choice.text += text
        choice.num_tokens += len(token_ids)
        return sse_data(self._chunk(index, text, None, token_ids, probs, start))

    def _chunk(self, index: int, text: str, finish_reason: str | None, token_ids: Sequence[int] = (),
               probs: TokenLogprobs | None = None, text_start: int = 0) -> dict:
        common = {"id": self.prepared.response_id, "created": created_at(self.prepared),
                  "model": self.prepared.model.name}
        codec, num_top = self.prepared.model.codec, self.prepared.request.logprobs
        choice = self.choices[index]
        if self.prepared.chat:
            delta = ChatDelta(role=None if choice.role_sent else "assistant", content=text or None)
            choice.role_sent = True
            logprobs = chat_logprobs(codec, token_ids, probs, num_top) if token_ids else None
            chunk = ChatCompletionChunk(choices=[ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                                                 finish_reason=finish_reason)],
                                        **common).model_dump()
            chunk["choices"][0]["delta"] = delta.model_dump(exclude_none=True)  # OpenAI omits absent keys
        else:
            logprobs = completion_logprobs(codec, token_ids, probs, num_top, text_start) if token_ids else None
            choice_body = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)
            chunk = CompletionResponse(choices=[choice_body], **common).model_dump()
        chunk.pop("usage", None)
        return chunk


def model_state(name: str, workers: Sequence[WorkerHeartbeat]) -> ModelState:
    """What a served model's live workers say: serving (one READY), starting (one loading), else scaled to
    zero (none alive). A request for a model not serving waits for its first READY instance (while another
    served model's worker is READY) up to DLS_GATEWAY_COLD_START_TIMEOUT_S, then gets 503
    ``cold_start_timeout``; with nothing of any model READY, or that setting at 0, it gets 503 at once."""
    statuses = {hb.status for hb in workers if hb.model == name}
    if WorkerStatus.READY in statuses:
        return ModelState.SERVING
    return ModelState.STARTING if WorkerStatus.STARTING in statuses else ModelState.SCALED_TO_ZERO


def model_card(model: ServedModel, state: ModelState) -> ModelCard:
    return ModelCard(id=model.name, created=model.created, state=state, max_sequence_length=model.max_sequence_length,
                     max_model_len=model.max_sequence_length, default_max_tokens=model.default_gen_length,
                     default_block_length=model.default_block_length, max_canvas=model.limits.max_gen_length,
                     calibration=calibration_info(model))


def calibration_info(model: ServedModel) -> CalibrationInfo:
    calibration = model.calibration
    if calibration is None:
        return CalibrationInfo(calibrated=False, how_to=HOW_TO.format(model=model.directory))
    quality = calibration.manifest.get("artefacts", {}).get("quality", {})
    return CalibrationInfo(calibrated=True, device=calibration.device, device_name=calibration.device_name,
                           created=calibration.manifest.get("created"), quality_source=quality.get("source"))


def request_info(record: RequestRecord, steps: Sequence[StepRecord], codec: TextCodec) -> RequestInfo:
    """A stored request as the API shows it (text decoded with the served model's tokenizer)."""
    finished = record.status == RequestStatus.FINISHED
    return RequestInfo(
        id=record.request_id, status=record.status.name.lower(), model=record.model,
        prompt=codec.decode(record.prompt_token_ids), canvas=codec.render_canvas(record.canvas),
        output=codec.decode(record.answer(_eos_id(codec)).token_ids) if finished else None,
        finish_reason=record.finish_reason or None,
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


def _eos_id(codec: TextCodec) -> int | None:
    return getattr(getattr(codec, "tokenizer", None), "eos_token_id", None)


def step_info(step: StepRecord) -> StepInfo:
    return StepInfo(step_index=step.step_index, instance_id=step.instance_id, kind=step.kind.name.lower(),
                    block_index=step.block_index, threshold=step.threshold,
                    committed_positions=list(step.committed_positions), batch_size=step.batch_size,
                    loaded_state=step.loaded_state, started_at=step.started_at, duration_s=step.duration_s)
