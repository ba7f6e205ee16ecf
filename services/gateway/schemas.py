"""The HTTP API's request and response bodies (OpenAI's shapes plus DiLaServe's fields).

Requests are strict: unknown fields, wrong types and out-of-range values are refused (400, the field
named). Limits that depend on the served model or the settings (``max_tokens`` against
``DLS_GATEWAY_MAX_GEN_LENGTH``, the context length, the number of messages) are checked when the
request is prepared (``services.gateway.prepare``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_PRIORITY = 2**31 - 1  # priorities are 32-bit signed integers
MAX_SEED = 2**63 - 1  # seeds are non-negative 64-bit signed integers

CacheName = Literal["none", "prefix", "dual"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    """Options of a streamed answer."""

    include_progress: bool = Field(False, description="also send `event: progress` lines: step, threshold, "
                                                      "instance and the canvas with masks as '_'")
    include_usage: bool = Field(True, description="accepted for OpenAI clients; the final chunk always has usage")


class _GenerationFields(_Strict):
    """What completions and chat completions share."""

    model: str = Field(description="the served model's id (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="generation length (the canvas); default: the model's")
    stream: bool = Field(False, description="answer with server-sent events")
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="seed, for reproducible outputs")
    slo_ms: float | None = Field(None, gt=0, description="latency SLO (ms) from arrival; default: 5x the "
                                                         "predicted isolated latency")
    min_threshold: float = Field(0.0, ge=0.0, le=1.0, description="quality floor: no step runs below this "
                                                                  "confidence threshold")
    priority: int = Field(0, ge=-MAX_PRIORITY - 1, le=MAX_PRIORITY, description="larger is more important")
    block_length: int | None = Field(None, ge=1, description="semi-autoregressive block length; default: the model's")
    cache: CacheName = Field("dual", description="approximate KV cache: none, prefix or dual")
    n: int | None = Field(None, description="choices per request: only 1")
    temperature: float | None = Field(None, description="only 0: decoding is greedy")
    user: str | None = Field(None, max_length=256, description="end-user id (ignored)")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("temperature")
    @classmethod
    def _greedy(cls, temperature: float | None) -> float | None:
        if temperature is not None and temperature != 0:
            raise ValueError("only temperature 0 is supported: the engine decodes greedily")
        return temperature

    @property
    def include_progress(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_progress


class CompletionBody(_GenerationFields):
    """POST /v1/completions."""

    prompt: str = Field(min_length=1, description="the prompt: a string, or a list with exactly one string")

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise ValueError("must be a string or a list with exactly one string")
            return prompt[0]
        return prompt


class ChatMessage(_Strict):
    """One message of a conversation."""

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = Field(None, max_length=256, description="participant name (ignored)")


class ChatCompletionBody(_GenerationFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")


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


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dilaserve"
    max_sequence_length: int
    default_max_tokens: int
    default_block_length: int


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
