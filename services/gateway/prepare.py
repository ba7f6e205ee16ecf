"""From a validated HTTP body to the ``CompletionRequest`` the scheduler gets (pure: clock and id passed in).

Tokenizes the prompt (chat through the model's template), fills in the defaults (block length from
the settings or the model, the SLO from the ``SloEstimator``), turns ``max_tokens`` into a canvas
(``shared.generation``: rounded up to the block, at most the model's longest canvas and
``DLS_GATEWAY_MAX_GEN_LENGTH``; the request carries the cap itself so the answer is cut there), and
checks what the schema cannot: prompt plus canvas against the model's context, text the tokenizer
cannot encode, the number of chat messages. Every refusal is an ``ApiError`` naming the field.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from services.gateway.errors import ApiError, invalid
from services.gateway.models import ModelCatalogue, ServedModel, UnknownModelError
from services.gateway.schemas import ChatCompletionBody, CompletionBody
from services.gateway.slo import SloEstimator
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

    request: CompletionRequest  # what goes on the intake
    model: ServedModel  # the model that serves it
    prompt_text: str  # the prompt as the model sees it (chat messages joined or templated)
    chat: bool  # answer as chat.completion(.chunk)
    include_progress: bool  # stream `event: progress` lines

    @property
    def request_id(self) -> str:
        return self.request.request_id


class RequestPreparer:
    """Turns bodies into ``PreparedRequest``s for one gateway's settings, models and SLO estimator."""

    def __init__(self, settings: GatewaySettings, catalogue: ModelCatalogue,
                 estimator: SloEstimator | None) -> None:
        self.settings = settings
        self.catalogue = catalogue
        self.estimator = estimator

    def model(self, name: str) -> ServedModel:
        try:
            return self.catalogue.get(name)
        except UnknownModelError as exc:
            raise ApiError(404, str(exc), "model", "model_not_found") from None

    def prepare(self, body: CompletionBody | ChatCompletionBody, request_id: str, now: float) -> PreparedRequest:
        model = self.model(body.model)
        chat = isinstance(body, ChatCompletionBody)
        prompt_field = "messages" if chat else "prompt"
        prompt_text, templated = self._prompt_text(body, model)
        prompt_ids = self._encode(model, prompt_text, prompt_field, add_special_tokens=not templated)
        block_length = body.block_length or model.default_block_length
        gen_length = model.limits.canvas(body.answer_cap, block_length, self.settings.max_gen_length)
        block_length = min(block_length, gen_length)
        if len(prompt_ids) + gen_length > model.max_sequence_length:
            raise invalid(prompt_field, f"{prompt_field} ({len(prompt_ids)} tokens) plus the canvas ({gen_length} "
                          f"tokens, from max_tokens) exceeds the model's context of {model.max_sequence_length} "
                          "tokens", "context_length_exceeded")
        cache_mode = CacheMode(body.cache)
        slo_ms = body.slo_ms or self._default_slo_ms(len(prompt_ids), gen_length, block_length, cache_mode)
        request = CompletionRequest(
            request_id=request_id, prompt_token_ids=prompt_ids, gen_length=gen_length, block_length=block_length,
            max_tokens=body.answer_cap, ignore_eos=body.ignore_eos, cache_mode=cache_mode, slo_ms=slo_ms, min_threshold=body.min_threshold, priority=body.priority,
            seed=body.seed, arrival_time=now, stream=body.stream, model=model.name,
        )
        return PreparedRequest(request, model, prompt_text, chat, body.stream and body.include_progress)

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

    def _default_slo_ms(self, prompt_length: int, gen_length: int, block_length: int, cache_mode: CacheMode) -> float:
        if self.estimator is not None:
            try:
                return self.estimator.default_slo_ms(prompt_length, gen_length, block_length, cache_mode)
            except Exception as exc:  # noqa: BLE001 - a predictor failure must not fail the request
                logger.warning("default SLOs fall back to %.0f ms from now on: the estimate failed (%s)",
                               self.settings.default_slo_ms, exc)
                self.estimator = None
        return self.settings.default_slo_ms
