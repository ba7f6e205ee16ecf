"""Gateway -> scheduler: new requests (JetStream intake stream) and cancellations (core NATS).

The gateway subscribes to the request's events subject *before* it publishes the request, so no
event can be missed. The scheduler acks the intake message only once the request is in Redis.
"""

from __future__ import annotations

from shared.messages.base import CacheMode, Message


class CompletionRequest(Message, kw_only=True):
    """One generation request, validated and completed with defaults by the gateway."""

    request_id: str  # unique id, also the JetStream dedupe id and the events subject token
    prompt_token_ids: list[int] | None = None  # the tokenized prompt; None: tokenize prompt_text
    prompt_text: str | None = None  # the prompt as text, when the gateway did not tokenize it
    gen_length: int  # generation canvas length in tokens (max_tokens rounded up to blocks; shared.generation)
    max_tokens: int | None = None  # the answer's cap (None: the canvas); finish_reason "length" when reached
    ignore_eos: bool = False  # decode the whole canvas instead of stopping at the block holding EOS
    block_length: int  # semi-autoregressive block length in tokens
    cache_mode: CacheMode = CacheMode.DUAL  # approximate KV cache the engine uses
    slo_ms: float  # latency SLO in milliseconds, counted from arrival_time
    min_threshold: float = 0.0  # quality floor: no step runs below this confidence threshold
    max_threshold: float = 1.0  # ceiling on the threshold (a client that prefers speed)
    priority: int = 0  # larger is more important (load control protects high priorities)
    seed: int | None = None  # sampling seed (the noise key with the step index); None: the request id keys it
    temperature: float = 0.0  # sampling temperature; 0: greedy (argmax)
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens reaching this probability; 1: all
    top_k: int = 0  # sample among the k most likely tokens; 0: all
    logprobs: int | None = None  # None: no log probabilities; k: each answer token's, and its k likeliest rivals'
    stop: list[str] = []  # stop strings: the answer ends before the first one (finish_reason "stop")
    arrival_time: float  # unix time (s) the gateway accepted the request; the deadline is arrival + SLO
    stream: bool = False  # publish a progress event per step (SSE clients); False: only the final event
    model: str | None = None  # the model asked for; None: the served model
    owner: str = ""  # hash of the API key that sent it (never the key); "": sent without keys

    @property
    def deadline(self) -> float:
        """Unix time (s) by which the request should finish."""
        return self.arrival_time + self.slo_ms / 1000.0


class CancelRequest(Message, kw_only=True):
    """Stop a request (the client went away or asked to); the scheduler owns the transition."""

    request_id: str  # the request to cancel
    reason: str = ""  # human-readable cause, for logs and the timeline
