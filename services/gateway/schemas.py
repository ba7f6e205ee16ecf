"""The HTTP API's request and response bodies (OpenAI's shapes plus DiLaServe's fields).

What clients routinely send is accepted: sampling (``temperature``, ``top_p``, ``top_k``, ``seed``),
``n`` choices (``best_of`` as ``n``), ``stop`` strings, ``logprobs`` / ``top_logprobs`` (the
probability each token was committed with), every other field of OpenAI's API at its default or
no-op value (``presence_penalty: 0``, ``echo: false``, ...), ``max_completion_tokens`` for
``max_tokens``, chat content as a list of text parts, and the extensions benchmark clients send
(``ignore_eos``, ``repetition_penalty: 1``, ``min_tokens: 0``). A value DiLaServe cannot honour is
refused with a 400 naming the field and saying why, and so is a field the API does not define (a
typo there would otherwise be silently ignored: refused, not accepted with a warning). Wrong types and
out-of-range values are refused the same way. Limits that depend on the served model or the settings
(the context length, the number of messages) and checks across fields (``best_of`` against ``n``,
``top_logprobs`` without ``logprobs``) are made when the request is prepared
(``services.gateway.prepare``).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_PRIORITY = 2**31 - 1  # priorities are 32-bit signed integers
MAX_SEED = 2**63 - 1  # seeds are non-negative 64-bit signed integers
MAX_CHOICES = 16  # most choices (n) per request: each is a request of its own in the cluster
MAX_TOP_LOGPROBS = 20  # OpenAI's limit (services.worker.decoding.sampling.MAX_TOP_LOGPROBS)
MAX_STOP_STRINGS = 16  # most stop strings per request
MAX_STOP_CHARS = 256  # longest stop string

CacheName = Literal["none", "prefix", "dual"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _only(field: str, value: Any, allowed: tuple, why: str) -> Any:
    """``value`` if it is None or one of the no-op ``allowed`` values, else a 400 naming why."""
    if value is not None and value not in allowed:
        raise ValueError(f"{field} {value!r} is not supported: {why}")
    return value


class StreamOptions(_Strict):
    """Options of a streamed answer."""

    include_progress: bool = Field(False, description="also send `event: progress` lines: step, threshold, "
                                                      "instance and the canvas with masks as '_'")
    include_usage: bool = Field(False, description="a last chunk before [DONE] with `choices: []` and the usage; "
                                "no other chunk carries usage")
    continuous_usage_stats: bool = Field(False, description="accepted for vLLM clients (usage comes only in the "
                                         "last chunk, with include_usage)")


class _GenerationFields(_Strict):
    """What completions and chat completions share."""

    model: str = Field(description="the served model's id (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="cap on the answer's tokens; the canvas is this rounded "
                                   "up to the block length, at most the model's longest (a cap, never a change of "
                                   "the answer); default: the model's default canvas")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name of max_tokens; wins "
                                              "when both are set")
    ignore_eos: bool = Field(False, description="decode the whole canvas instead of stopping at the block that "
                             "completes an EOS (benchmark clients); finish_reason is then 'length'")
    stream: bool = Field(False, description="answer with server-sent events")
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="seed, for reproducible outputs")
    slo_ms: float | None = Field(None, gt=0, description="latency SLO (ms) from arrival; default: 5x the "
                                                         "predicted isolated latency")
    min_threshold: float = Field(0.0, ge=0.0, le=1.0, description="quality floor: no step runs below this "
                                                                  "confidence threshold")
    priority: int = Field(0, ge=-MAX_PRIORITY - 1, le=MAX_PRIORITY, description="larger is more important")
    block_length: int | None = Field(None, ge=1, description="semi-autoregressive block length; default: the model's. "
                                     "At least DLS_GATEWAY_MIN_BLOCK_LENGTH, and the canvas holds at most "
                                     "DLS_GATEWAY_MAX_BLOCKS blocks: else a 400 naming block_length")
    cache: CacheName = Field("dual", description="approximate KV cache: none, prefix or dual")
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="choices (samples) per request; default 1")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="sampling temperature; 0 or null: "
                                      "greedy (the engine's argmax)")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="nucleus sampling: the smallest set of tokens "
                                "whose probability reaches top_p; 1 or null: no cut")
    top_k: int | None = Field(None, ge=-1, description="sample among the k most likely tokens; -1, 0 or null: all")
    min_p: float | None = Field(None, description="only 0")
    presence_penalty: float | None = Field(None, description="only 0: no penalties are applied")
    frequency_penalty: float | None = Field(None, description="only 0: no penalties are applied")
    repetition_penalty: float | None = Field(None, description="only 1 (vLLM's no-op value)")
    min_tokens: int | None = Field(None, description="only 0 (vLLM's no-op value)")
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOP_STRINGS} strings: the answer ends "
                                         "before the first one (finish_reason 'stop'); empty strings are ignored")
    logit_bias: dict[str, float] | None = Field(None, description="only null or {}")
    user: str | None = Field(None, max_length=256, description="end-user id (ignored)")
    metadata: dict[str, str] | None = Field(None, description="accepted, ignored")
    store: bool | None = Field(None, description="accepted, ignored: nothing is stored for later retrieval")
    service_tier: str | None = Field(None, description="accepted, ignored")
    skip_special_tokens: bool = Field(True, description="only true: special tokens never appear in the text")

    @field_validator("max_tokens", "max_completion_tokens", "seed", "priority", "block_length", "n", "top_k",
                     "min_tokens", "logprobs", "best_of", "top_logprobs", mode="before", check_fields=False)
    @classmethod
    def _integral(cls, value: Any) -> Any:
        """An integral number sent as a float (``16.0``) is that integer: JSON has one number type, and the
        schema's ``integer`` admits it; ``16.5`` is still refused."""
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    @field_validator("min_p")
    @classmethod
    def _no_min_p(cls, min_p: float | None) -> float | None:
        return _only("min_p", min_p, (0,), "the sampler has no min_p cut (0); use top_p or top_k")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, penalty: float | None, info) -> float | None:
        return _only(info.field_name, penalty, (0,), "no penalties are applied (0)")

    @field_validator("repetition_penalty")
    @classmethod
    def _no_repetition_penalty(cls, penalty: float | None) -> float | None:
        return _only("repetition_penalty", penalty, (1,), "no penalties are applied (1)")

    @field_validator("min_tokens")
    @classmethod
    def _no_min_tokens(cls, min_tokens: int | None) -> int | None:
        return _only("min_tokens", min_tokens, (0,), "an answer ends at its EOS (min_tokens 0)")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if any(len(s) > MAX_STOP_CHARS for s in strings):
            raise ValueError(f"a stop string is longer than {MAX_STOP_CHARS} characters")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias:
            raise ValueError("logit_bias is not supported (null or {} only)")
        return bias

    @field_validator("skip_special_tokens")
    @classmethod
    def _skips_special(cls, skip: bool) -> bool:
        return _only("skip_special_tokens", skip, (True,), "special tokens never appear in the text")

    @property
    def answer_cap(self) -> int | None:
        """The cap on the answer's tokens (max_completion_tokens, else max_tokens; None: the default)."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_progress(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_progress

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_strings(self) -> list[str]:
        """The non-empty stop strings, in order, without repeats."""
        strings = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return list(dict.fromkeys(s for s in strings if s))

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def num_top_logprobs(self) -> int | None:
        """None: no logprobs; k: each answer token's logprob and its k likeliest alternatives."""
        return None


class CompletionBody(_GenerationFields):
    """POST /v1/completions."""

    prompt: str = Field(min_length=1, description="the prompt: a string, or a list with exactly one string")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="return each token's logprob (the "
                                 "probability the model committed it with) and this many likeliest alternatives")
    echo: bool = Field(False, description="only false: the prompt is not repeated in the answer")
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description="taken as n (the choices are not ranked): "
                                "must equal n when both are set")
    suffix: str | None = Field(None, description="only null: no insertion after the answer")

    @property
    def num_choices(self) -> int:
        return self.n or self.best_of or 1

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        return _only("echo", echo, (False,), "the prompt is not repeated in the answer")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        return _only("suffix", suffix, (), "no insertion after the answer")

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise ValueError("must be a string or a list with exactly one string")
            return prompt[0]
        return prompt


class TextPart(_Strict):
    """A text part of a message's content (what the OpenAI SDK and benchmark clients send)."""

    type: Literal["text"] = Field(description="only 'text': the served models read text")
    text: str | None = None


class ChatMessage(_Strict):
    """One message of a conversation; ``content`` as a string or a list of text parts (joined)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None  # None: an assistant turn with nothing said
    name: str | None = Field(None, max_length=256, description="participant name (ignored)")

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content: Any) -> Any:
        if isinstance(content, list):
            for index, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"part {index} has type {kind!r}: only text parts are supported")
        return content

    @field_validator("content")
    @classmethod
    def _content_said(cls, content: Any, info) -> Any:
        role = info.data.get("role")
        if content is None and role not in (None, "assistant"):
            raise ValueError(f"null is only allowed in an assistant message, not a {role} message")
        return content

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""

    @property
    def template_role(self) -> str:
        """The role a chat template knows: OpenAI's ``developer`` is the older ``system``."""
        return "system" if self.role == "developer" else self.role


class ResponseFormat(_Strict):
    type: str = Field(description="only 'text'")

    @field_validator("type")
    @classmethod
    def _plain_text(cls, kind: str) -> str:
        return _only("response_format.type", kind, ("text",), "answers are plain text")


class ChatCompletionBody(_GenerationFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    logprobs: bool | None = Field(None, description="return each token's logprob: the probability the model "
                                  "committed it with")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="and this many likeliest "
                                     "alternatives per token (needs logprobs: true)")
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="only null or []: no tool calls")
    tool_choice: str | None = Field(None, description="only null or 'none'")
    parallel_tool_calls: bool | None = Field(None, description="accepted, ignored (no tool calls)")

    @property
    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools: list | None) -> list | None:
        if tools:
            raise ValueError("tools are not supported: the model makes no tool calls")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, choice: str | None) -> str | None:
        return _only("tool_choice", choice, ("none",), "the model makes no tool calls")


# --- answers -------------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    """OpenAI's usage plus how DiLaServe served the request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    steps: int = Field(description="denoising steps")
    recompute_steps: int = Field(description="of which full forwards")
    thresholds: list[float] = Field(description="threshold of every step, in order")
    instances: list[str] = Field(description="instances it ran on, in order of first visit")
    migrations: int = Field(description="moves between instances")
    latency_ms: float = Field(description="arrival to finish")
    slo_ms: float = Field(description="the request's SLO")
    slo_met: bool = Field(description="latency within the SLO")


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs of a completion choice: per token, its text, logprob (of the probability
    the model committed it with), likeliest alternatives and offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = Field(description="per token: alternative -> logprob "
                                                        "(null when logprobs is 0)")
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's UTF-8 bytes")


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """OpenAI's chat logprobs: one entry per token of the content."""

    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ProgressInfo(BaseModel):
    """Data of an ``event: progress`` line (stream_options.include_progress)."""

    request_id: str
    step: int = Field(description="steps done so far")
    threshold: float = Field(description="threshold the step ran at")
    instance_id: str = Field(description="instance that ran it")
    canvas: str = Field(description="the generation canvas, masked positions as '_'")


class ModelState(StrEnum):
    """A served model's state, from its live workers' heartbeats."""

    SERVING = "serving"  # a READY instance is alive
    STARTING = "starting"  # instances are loading, none READY yet
    # no live instance: while another served model's instance is READY, a request waits for its first one (a
    # cold start) up to DLS_GATEWAY_COLD_START_TIMEOUT_S, then gets 503 cold_start_timeout with Retry-After
    SCALED_TO_ZERO = "scaled_to_zero"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dilaserve"
    state: ModelState = Field(description="serving (a READY instance), starting (loading), or scaled_to_zero "
                                           "(none alive); calibration says whether it is calibrated")
    max_sequence_length: int
    max_model_len: int = Field(description="vLLM's name of max_sequence_length: prompt plus canvas fit in it")
    default_max_tokens: int = Field(description="the canvas of a request that sets no max_tokens")
    default_block_length: int
    max_canvas: int | None = Field(description="longest canvas the model answers the same at: a larger max_tokens "
                                   "gets this canvas (null: bounded by the context only)")
    calibration: CalibrationInfo


class CalibrationInfo(BaseModel):
    """What the scheduler knows of a model's latency, steps and quality (``shared.calibration``)."""

    calibrated: bool = Field(description="false: served at the highest candidate threshold only, planned with the "
                                         "step times the workers measure (how_to says how to calibrate it)")
    device: str | None = Field(None, description="the kind of device it was calibrated on (cpu, cuda)")
    device_name: str | None = None
    created: str | None = Field(None, description="when `dls calibrate` made it (UTC)")
    quality_source: str | None = Field(None, description="labelled (accuracy on an eval set) or agreement (with "
                                                         "the highest threshold's answers)")
    how_to: str | None = Field(None, description="the command that calibrates it (uncalibrated models)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class StepInfo(BaseModel):
    """One step of a request (GET /v1/requests/{id})."""

    step_index: int
    instance_id: str
    kind: str = Field(description="recompute or cache")
    block_index: int
    threshold: float
    committed_positions: list[int]
    batch_size: int
    loaded_state: bool
    started_at: float
    duration_s: float


class RequestInfo(BaseModel):
    """A request's state, read from the request-state store (GET /v1/requests/{id})."""

    id: str
    object: Literal["dilaserve.request"] = "dilaserve.request"
    status: str = Field(description="queued, ready, running, migrating, finished, rejected or cancelled")
    model: str
    prompt: str
    canvas: str = Field(description="the generation canvas, masked positions as '_'")
    output: str | None = Field(description="the generated text once finished")
    finish_reason: str | None
    gen_length: int
    block_length: int
    cache: str
    priority: int
    min_threshold: float
    max_threshold: float
    num_committed: int
    thresholds: list[float]
    instances: list[str]
    num_steps: int
    num_recompute_steps: int
    num_migrations: int
    steps: list[StepInfo]
    arrival_time: float
    deadline: float
    slo_ms: float
    finished_at: float | None
    slo_met: bool | None = Field(description="finished within the SLO; null until finished")
    detail: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_STATUS_MEANINGS = {  # status -> when the gateway answers it (every error has the ErrorResponse body)
    400: "invalid request: the message and `param` name the field",
    401: "missing or unknown API key (when DLS_GATEWAY_API_KEYS is set)",
    404: "unknown model, or unknown (or expired) request id",
    409: "an Idempotency-Key request that is still running elsewhere",
    413: "request body over DLS_GATEWAY_MAX_REQUEST_BYTES",
    422: "an Idempotency-Key reused with another body or number of choices",
    429: "overloaded or rate-limited: retry after Retry-After",
    500: "an internal error (a bug: reported with its type, never a stack trace)",
    503: "no model instance is up (a model scaled to zero while another serves: none of it READY within "
         "DLS_GATEWAY_COLD_START_TIMEOUT_S of the request, cold_start_timeout), or NATS / Redis cannot be "
         "reached: retry after Retry-After",
    504: "no answer within DLS_GATEWAY_REQUEST_TIMEOUT_S (the request keeps its id: GET /v1/requests/{id})",
}


def error_responses(*statuses: int) -> dict[int, dict]:
    """OpenAPI ``responses`` for the error statuses a route can answer, each with the one error body."""
    return {status: {"model": ErrorResponse, "description": _STATUS_MEANINGS[status]} for status in statuses}


COMPLETION_ERRORS = error_responses(400, 401, 404, 409, 413, 422, 429, 500, 503, 504)  # POST completions
READ_ERRORS = error_responses(401, 404, 422, 500, 503)  # GET of a request's state
LISTING_ERRORS = error_responses(401, 500)  # GET of what needs no id


_ONLY = {"min_p": 0, "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_tokens": 0}


def constrain_openapi(schema: dict, model_names: list[str], min_block_length: int, alphabet: str | None) -> dict:
    """The OpenAPI schema that FastAPI derives, narrowed to what the validation admits (in place): the
    served models' ids, the block-length floor of the settings, the no-op-only fields at their one value,
    the largest seed as an exact integer, ``content: null`` in assistant messages only, and the text made
    of the tokenizer's ``alphabet`` where it has a closed one. What depends on the whole request (the
    prompt's tokens plus the canvas against the context) cannot be written in a schema."""
    components = schema["components"]["schemas"]
    for body in ("CompletionBody", "ChatCompletionBody"):
        fields = components[body]["properties"]
        fields["model"]["enum"] = sorted(model_names)
        fields["block_length"]["anyOf"][0]["minimum"] = min_block_length
        fields["seed"]["anyOf"][0]["maximum"] = MAX_SEED
        for name, value in _ONLY.items():
            fields[name]["anyOf"][0]["enum"] = [value]
        fields["skip_special_tokens"]["enum"] = [True]
        fields["logit_bias"]["anyOf"][0]["maxProperties"] = 0
    completion = components["CompletionBody"]["properties"]
    if alphabet is not None:
        text = "[" + "".join(re.escape(c) for c in alphabet) + "]"
        completion["prompt"]["pattern"] = f"^{text}+$"
        components["TextPart"]["properties"]["text"]["anyOf"][0]["pattern"] = f"^{text}*$"
        components["ChatMessage"]["properties"]["content"]["anyOf"][0]["pattern"] = f"^{text}*$"
    completion["echo"]["enum"] = [False]
    completion["suffix"]["anyOf"] = [{"type": "null"}]
    chat = components["ChatCompletionBody"]["properties"]
    chat["tools"]["anyOf"][0]["maxItems"] = 0
    chat["tool_choice"]["anyOf"][0]["enum"] = ["none"]
    components["ResponseFormat"]["properties"]["type"]["enum"] = ["text"]
    message = components["ChatMessage"]
    said = {**message["properties"]["content"], "anyOf": [t for t in message["properties"]["content"]["anyOf"]
                                                           if t != {"type": "null"}]}
    components["ChatMessage"] = {
        "title": message["title"], "description": message["description"] + " ``content`` is null only in an "
        "assistant message.",
        "oneOf": [
            {**message, "properties": {**message["properties"], "role": {"type": "string", "enum": [
                "system", "developer", "user"]}, "content": said}},
            {**message, "properties": {**message["properties"], "role": {"type": "string", "enum": ["assistant"]}}},
        ],
    }
    return schema
