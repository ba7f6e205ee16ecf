"""From a validated HTTP body to the ``CompletionRequest`` the scheduler gets (no I/O of its own: clock,
id and the default-SLO source passed in).

Tokenizes the prompt (chat through the model's template), fills in the defaults (block length from
the settings or the model, the SLO from ``DefaultSlo``: the predictor service's one-shot estimate), turns ``max_tokens`` into a canvas
(``shared.generation``: rounded up to the block, at most the model's longest canvas and
``DLS_GATEWAY_MAX_GEN_LENGTH``; the request carries the cap itself so the answer is cut there), and
checks what the schema cannot: prompt plus canvas against the model's context, text the tokenizer
cannot encode, the number of chat messages, fields that must agree (``best_of`` and ``n``,
``top_logprobs`` and ``logprobs``). Every refusal is an ``ApiError`` naming the field.

``n`` choices are ``n`` requests in the cluster (as vLLM fans a request with ``n`` out into child
requests): choice 0 keeps the request id and the client's ``seed``, choice i gets ``<id>-<i>`` and a
seed derived from the client's (``choice_seed``), so ``n`` samples differ and a request repeated with
the same seed gets the same ``n`` answers.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass

from services.gateway.errors import ApiError, invalid
from services.gateway.models import ModelCatalogue, ServedModel, UnknownModelError
from services.gateway.schemas import ChatCompletionBody, CompletionBody
from services.gateway.slo import DefaultSlo
from shared.messages.base import CacheMode
from shared.messages.intake import CompletionRequest
from shared.settings import GatewaySettings
from shared.tokenizer import TokenizerError

logger = logging.getLogger(__name__)

REQUEST_ID_PREFIX = "cmpl-"


def new_request_id() -> str:
    """``cmpl-`` and 32 hex digits (a valid subject token)."""
    return f"{REQUEST_ID_PREFIX}{uuid.uuid4().hex}"


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready to submit, and what the answer needs that the wire message does not carry."""

    request: CompletionRequest  # what goes on the intake (choice 0)
    model: ServedModel  # the model that serves it
    prompt_text: str  # the prompt as the model sees it (chat messages joined or templated)
    chat: bool  # answer as chat.completion(.chunk)
    include_progress: bool  # stream `event: progress` lines
    include_usage: bool = False  # stream a last chunk with `choices: []` and the usage
    choices: tuple[CompletionRequest, ...] = ()  # one request per choice (n), choice 0 first
    answer_id: str = ""  # the response's id ("": choice 0's request id)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def response_id(self) -> str:
        """The answer's ``id``: the request id, of which choice i's requests are ``<id>-<i>`` when n > 1."""
        return self.answer_id or self.request.request_id

    @property
    def choice_requests(self) -> tuple[CompletionRequest, ...]:
        return self.choices or (self.request,)

    def with_requests(self, requests: tuple[CompletionRequest, ...], answer_id: str | None = None) -> PreparedRequest:
        """The same answer built around other requests (the owner set, or the ones a retry joins)."""
        return dataclasses.replace(self, request=requests[0], choices=requests,
                                   answer_id=self.answer_id if answer_id is None else answer_id)


SEED_STRIDE = 0x9E3779B97F4A7C15  # odd: choice seeds of one client seed are distinct


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request sent with ``seed`` (choice 0: the seed itself)."""
    if seed is None or index == 0:
        return seed
    return (seed + index * SEED_STRIDE) % (1 << 63)


def choice_id(request_id: str, index: int, num_choices: int) -> str:
    """The cluster's request id of choice ``index`` (the response id itself when there is one choice)."""
    return request_id if num_choices == 1 else f"{request_id}-{index}"


class RequestPreparer:
    """Turns bodies into ``PreparedRequest``s for one gateway's settings, models and default SLOs."""

    def __init__(self, settings: GatewaySettings, catalogue: ModelCatalogue, default_slos: dict[str, DefaultSlo]) -> None:
        """``default_slos``: model name -> where the SLO of a request that sets none comes from."""
        self.settings = settings
        self.catalogue = catalogue
        self.default_slos = default_slos

    def model(self, name: str) -> ServedModel:
        try:
            return self.catalogue.get(name)
        except UnknownModelError as exc:
            raise ApiError(404, str(exc), "model", "model_not_found") from None

    def _check_blocks(self, asked: int | None, block_length: int, gen_length: int) -> None:
        """A 400 naming ``block_length`` for a request whose blocks would make it pathologically expensive:
        below the floor, or more blocks (each a recompute forward with a KV cache) than the cap."""
        floor, cap = self.settings.min_block_length, self.settings.max_blocks
        if asked is not None and asked < floor:
            raise invalid("block_length", f"block_length {asked} is below the minimum of {floor} "
                          "(DLS_GATEWAY_MIN_BLOCK_LENGTH): every block starts with a full recompute forward",
                          "block_length_too_small")
        num_blocks = -(-gen_length // block_length)
        if num_blocks > cap:
            raise invalid("block_length", f"block_length {block_length} on a canvas of {gen_length} tokens makes "
                          f"{num_blocks} blocks, more than {cap} (DLS_GATEWAY_MAX_BLOCKS); use a block_length of "
                          f"at least {-(-gen_length // cap)} or a smaller max_tokens", "too_many_blocks")

    def _check_recomputes(self, cache_mode: CacheMode, gen_length: int) -> None:
        """A 400 naming ``cache`` when a request without a KV cache could need more full forwards than the
        cap (one per step, and a step may commit a single token); with a cache they are its blocks, which
        ``_check_blocks`` bounds below the cap's default."""
        cap = self.settings.max_recompute_steps
        if cache_mode == CacheMode.NONE and gen_length > cap:
            raise invalid("cache", f"cache 'none' on a canvas of {gen_length} tokens may take {gen_length} full "
                          f"forwards, more than {cap} (DLS_GATEWAY_MAX_RECOMPUTE_STEPS); use cache 'prefix' or "
                          "'dual', or a smaller max_tokens", "too_many_recompute_steps")

    async def prepare(self, body: CompletionBody | ChatCompletionBody, request_id: str, now: float) -> PreparedRequest:
        model = self.model(body.model)
        chat = isinstance(body, ChatCompletionBody)
        prompt_field = "messages" if chat else "prompt"
        prompt_text, templated = self._prompt_text(body, model)
        prompt_ids = self._encode(model, prompt_text, prompt_field, add_special_tokens=not templated)
        block_length = body.block_length or model.default_block_length
        gen_length = model.limits.canvas(body.answer_cap, block_length, self.settings.max_gen_length)
        block_length = min(block_length, gen_length)
        self._check_blocks(body.block_length, block_length, gen_length)
        self._check_recomputes(CacheMode(body.cache), gen_length)
        if len(prompt_ids) + gen_length > model.max_sequence_length:
            raise invalid(prompt_field, f"{prompt_field} ({len(prompt_ids)} tokens) plus the canvas ({gen_length} "
                          f"tokens, from max_tokens) exceeds the model's context of {model.max_sequence_length} "
                          "tokens", "context_length_exceeded")
        self._check_agreement(body)
        cache_mode = CacheMode(body.cache)
        slo_ms = body.slo_ms or await self.default_slos[model.name].slo_ms(len(prompt_ids), gen_length, block_length, cache_mode)
        n = body.num_choices
        choices = tuple(CompletionRequest(
            request_id=choice_id(request_id, i, n), prompt_token_ids=prompt_ids, gen_length=gen_length,
            block_length=block_length, max_tokens=_wire_int(body.answer_cap), ignore_eos=body.ignore_eos, cache_mode=cache_mode,
            slo_ms=slo_ms, min_threshold=body.min_threshold, priority=body.priority, seed=choice_seed(body.seed, i),
            temperature=body.temperature or 0.0, top_p=body.top_p or 1.0, top_k=_wire_int(max(body.top_k or 0, 0)),
            logprobs=body.num_top_logprobs, stop=body.stop_strings, arrival_time=now, stream=body.stream,
            model=model.name,
        ) for i in range(n))
        return PreparedRequest(choices[0], model, prompt_text, chat, body.stream and body.include_progress,
                               body.stream and body.include_usage, choices, request_id)

    @staticmethod
    def _check_agreement(body: CompletionBody | ChatCompletionBody) -> None:
        if isinstance(body, CompletionBody):
            if body.best_of is not None and body.n is not None and body.best_of != body.n:
                raise invalid("best_of", f"best_of ({body.best_of}) must equal n ({body.n}): every sample is "
                              "returned, none is ranked away")
        elif body.top_logprobs and not body.logprobs:
            raise invalid("top_logprobs", "top_logprobs needs logprobs: true")

    def _prompt_text(self, body: CompletionBody | ChatCompletionBody, model: ServedModel) -> tuple[str, bool]:
        if isinstance(body, CompletionBody):
            return body.prompt, False
        if len(body.messages) > self.settings.max_messages:
            raise invalid("messages", f"messages: {len(body.messages)} messages, at most "
                          f"{self.settings.max_messages} allowed", "too_many_messages")
        try:
            return model.codec.chat_prompt([(m.template_role, m.text) for m in body.messages])
        except TokenizerError as exc:
            raise invalid("messages", f"messages: {exc}", "chat_template") from None

    @staticmethod
    def _encode(model: ServedModel, text: str, field: str, add_special_tokens: bool) -> list[int]:
        try:
            ids = model.codec.encode(text, add_special_tokens=add_special_tokens)
        except TokenizerError as exc:
            raise invalid(field, f"{field}: the {model.name} tokenizer cannot encode it: {exc}",
                          "unencodable_text") from None
        if not ids:
            raise invalid(field, f"{field} is empty after tokenization", "empty_prompt")
        return ids


WIRE_INT_MAX = 2**31 - 1  # larger caps mean the same as this one (no canvas or vocabulary comes near it)


def _wire_int(value: int | None) -> int | None:
    """A cap the client may send as any integer (``max_tokens``, ``top_k``), bounded so that it fits the
    wire's integers (msgpack's are 64-bit) without changing what it means."""
    return None if value is None else min(value, WIRE_INT_MAX)
