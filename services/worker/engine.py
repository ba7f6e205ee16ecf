"""The denoising engine: block-wise threshold decoding with step-level batching and an approximate KV cache.

A request's state is plain data (:class:`RequestState`): prompt ids, the generation canvas (mask ids
where nothing is committed yet), block length, cache mode, step count. Any engine can continue a
request from it; the only thing an engine keeps locally is the request's KV cache, which it rebuilds
with a recompute step when it does not have it (that is what makes migration cheap).

One :meth:`DLMEngine.step` call advances every request in the batch by one denoising step, each with
its own threshold. Requests may differ in prompt length, generation length, block length, block
and cache mode, and may join or leave between steps. Internally the batch is split into at most two
forwards: full-sequence steps (recompute, or every step without cache) and cache steps.

Approximate KV cache (Fast-dLLM):

* ``none``: every step is a full forward over prompt plus canvas.
* ``prefix``: the step at a block start is a full forward that also stores keys/values of every
  position (and commits from its own logits, so the refresh costs no extra forward); later steps of
  the block run the block plus the whole suffix and attend to the cached prefix.
* ``dual``: as ``prefix``, but later steps run only the block, attending to the cached prefix *and*
  the stale cached suffix.

Early stop: a request stops at the first block that completes an EOS (the rest of its canvas becomes
EOS padding, never decoded), in every cache mode, unless it asked to ``ignore_eos``; the step that
stops it reports the blocks it skipped (each would have cost one forward at least).

Attention over keys is order-free once RoPE is applied at absolute positions, so a cache step's keys
are simply ``cached slots outside the fresh window`` followed by the fresh tokens' keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from pathlib import Path

import torch

from services.worker.model import DLMForMaskedDiffusion
from shared.generation import Answer, answer_of, canvas_length


class EngineError(ValueError):
    """A request the engine cannot run (bad lengths, unknown tokens, bad threshold)."""


class CacheMode(StrEnum):
    NONE = "none"
    PREFIX = "prefix"
    DUAL = "dual"


class StepKind(IntEnum):
    RECOMPUTE = 0  # full forward over prompt plus canvas (refreshes the cache when caching)
    CACHE = 1  # block (dual) or block plus suffix (prefix) against the cache


@dataclass
class RequestState:
    """Everything needed to continue a request on any engine."""

    request_id: str
    prompt_ids: list[int]
    canvas: list[int]  # generation positions; the mask id where not committed yet
    block_length: int
    cache_mode: CacheMode = CacheMode.DUAL
    num_steps: int = 0
    finished: bool = False
    ignore_eos: bool = False  # decode the whole canvas (benchmarks); otherwise stop at the EOS block

    @property
    def gen_length(self) -> int:
        return len(self.canvas)

    @property
    def num_blocks(self) -> int:
        return -(-self.gen_length // self.block_length)

    def block_bounds(self, block: int) -> tuple[int, int]:
        start = block * self.block_length
        return start, min(start + self.block_length, self.gen_length)


@dataclass(frozen=True)
class ConfidenceStats:
    """Confidences of the current block's positions still masked after the step (1.0 when none)."""

    min: float
    q25: float
    median: float
    mean: float
    q75: float

    @classmethod
    def of(cls, values: list[float]) -> ConfidenceStats:
        if not values:
            return cls(1.0, 1.0, 1.0, 1.0, 1.0)
        v = sorted(values)
        return cls(v[0], _quantile(v, 0.25), _quantile(v, 0.5), sum(v) / len(v), _quantile(v, 0.75))


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass
class StepResult:
    request_id: str
    kind: StepKind
    block_index: int  # the block this step decoded
    committed_positions: list[int]  # indices into the canvas
    committed_token_ids: list[int]
    finished: bool
    num_steps: int  # steps done so far, this one included
    num_masked: int  # masked canvas positions left
    confidence: ConfidenceStats
    threshold: float
    # every position masked before this step: its top probability, in position order (what the
    # commit rule compared with the threshold; the simulator's replay derives other thresholds' commits)
    masked_confidences: tuple[float, ...] = ()
    blocks_skipped: int = 0  # blocks left undecoded because this step completed one holding an EOS


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    num_steps: int
    step_kinds: list[StepKind] = field(default_factory=list)
    finish_reason: str = "stop"  # "stop" (an EOS within max_tokens) or "length"
    blocks_skipped: int = 0  # blocks early stop saved


@dataclass
class _Cache:
    block_index: int  # the block whose start refreshed it
    kv: torch.Tensor  # [n_layers, 2, H_kv, seq_len, head_dim], RoPE applied


@dataclass
class _Item:
    """One request's part of a batched forward."""

    state: RequestState
    threshold: float
    kind: StepKind
    block: int
    fresh_start: int  # absolute position of the first fresh (input) token
    fresh_ids: list[int]
    context_index: torch.Tensor | None = None  # cached slots attended to (cache steps)


class DLMEngine:
    """Runs denoising steps for batches of requests on one model instance."""

    def __init__(
        self,
        model: DLMForMaskedDiffusion,
        tokenizer=None,
        default_gen_length: int = 256,
        default_block_length: int = 32,
        stop_at_eos: bool = True,
        name: str = "model",
        max_gen_length: int | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.default_gen_length = default_gen_length
        self.default_block_length = default_block_length
        self.stop_at_eos = stop_at_eos
        self.name = name
        self.max_gen_length = max_gen_length  # longest canvas the model answers the same at (None: any)
        self.mask_id = model.config.mask_token_id
        self.eos_id = model.config.eos_token_id
        self.shift = int(getattr(model.config, "logits_shift", 0))
        self._caches: dict[str, _Cache] = {}  # request id -> its KV cache on this engine

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str = "cpu", **kwargs) -> DLMEngine:
        from services.worker.loading import load_model

        loaded = load_model(directory, device=device)
        return cls(
            loaded.model, loaded.tokenizer, loaded.gen_length, loaded.block_length, name=loaded.name,
            max_gen_length=loaded.limits.max_gen_length, **kwargs,
        )

    # --- requests -------------------------------------------------------------------------------

    def new_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        gen_length: int | None = None,
        block_length: int | None = None,
        cache_mode: CacheMode = CacheMode.DUAL,
        ignore_eos: bool = False,
    ) -> RequestState:
        gen_length = gen_length or self.default_gen_length
        block_length = block_length or self.default_block_length
        if not prompt_ids:
            raise EngineError("prompt is empty")
        if gen_length < 1 or block_length < 1:
            raise EngineError(f"gen_length ({gen_length}) and block_length ({block_length}) must be positive")
        limit = self.model.config.max_sequence_length
        if len(prompt_ids) + gen_length > limit:
            raise EngineError(f"prompt ({len(prompt_ids)}) plus gen_length ({gen_length}) exceeds {limit} tokens")
        return RequestState(request_id, list(prompt_ids), [self.mask_id] * gen_length, block_length, cache_mode,
                            ignore_eos=ignore_eos)

    def drop(self, request_id: str) -> None:
        """Forget a request's cache (it finished, or moved to another instance)."""
        self._caches.pop(request_id, None)

    def has_cache(self, request_id: str) -> bool:
        return request_id in self._caches

    def current_block(self, state: RequestState) -> int:
        first_mask = state.canvas.index(self.mask_id)
        return first_mask // state.block_length

    def next_step_kind(self, state: RequestState) -> StepKind:
        if state.cache_mode is CacheMode.NONE:
            return StepKind.RECOMPUTE
        cache = self._caches.get(state.request_id)
        fresh = cache is not None and cache.block_index == self.current_block(state)
        return StepKind.CACHE if fresh else StepKind.RECOMPUTE

    # --- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, batch: list[tuple[RequestState, float]]) -> list[StepResult]:
        """Advance every (state, threshold) by one step; states are updated in place."""
        items = [self._plan(state, tau) for state, tau in batch]
        full = [it for it in items if it.kind is StepKind.RECOMPUTE]
        cached = [it for it in items if it.kind is StepKind.CACHE]
        results: dict[str, StepResult] = {}  # request id -> result
        for group in (full, cached):
            if group:
                for item, logits_of in self._forward(group):
                    results[item.state.request_id] = self._commit(item, logits_of)
        return [results[state.request_id] for state, _ in batch]

    def _plan(self, state: RequestState, threshold: float) -> _Item:
        if state.finished:
            raise EngineError(f"request {state.request_id} is already finished")
        if not 0.0 <= threshold <= 1.0:
            raise EngineError(f"threshold {threshold} is outside [0, 1]")
        kind, block = self.next_step_kind(state), self.current_block(state)
        sequence = state.prompt_ids + state.canvas
        if kind is StepKind.RECOMPUTE:
            return _Item(state, threshold, kind, block, 0, sequence)
        prompt_len = len(state.prompt_ids)
        start, end = state.block_bounds(block)
        fresh_start = prompt_len + start - self.shift
        fresh_end = prompt_len + (end if state.cache_mode is CacheMode.DUAL else state.gen_length)
        context = torch.cat((torch.arange(0, fresh_start), torch.arange(fresh_end, len(sequence))))
        return _Item(state, threshold, kind, block, fresh_start, sequence[fresh_start:fresh_end], context)

    def _forward(self, group: list[_Item]):
        """One batched forward; yields (item, function from absolute position to its logits row)."""
        device = self.model.device
        width = max(len(it.fresh_ids) for it in group)
        ids = torch.full((len(group), width), self.eos_id, dtype=torch.long)
        positions = torch.zeros((len(group), width), dtype=torch.long)
        valid = torch.zeros((len(group), width), dtype=torch.bool)
        for row, it in enumerate(group):
            n = len(it.fresh_ids)
            ids[row, width - n :] = torch.tensor(it.fresh_ids)
            positions[row, width - n :] = torch.arange(it.fresh_start, it.fresh_start + n)
            valid[row, width - n :] = True
        context_kv, context_valid = self._gather_context(group)
        wants_kv = any(it.kind is StepKind.RECOMPUTE and it.state.cache_mode is not CacheMode.NONE for it in group)
        out = self.model(
            ids.to(device), attention_mask=valid.to(device), position_ids=positions.to(device),
            context_kv=context_kv, context_valid=context_valid, return_kv=wants_kv,
        )
        if wants_kv:
            self._store_caches(group, torch.stack([torch.stack(kv) for kv in out.kv]), width)
        for row, it in enumerate(group):
            offset = width - len(it.fresh_ids) - it.fresh_start - self.shift
            yield it, (lambda pos, row=row, offset=offset: out.logits[row, pos + offset])

    def _gather_context(self, group: list[_Item]):
        if group[0].kind is StepKind.RECOMPUTE:
            return None, None
        sizes = [len(it.context_index) for it in group]
        first = self._caches[group[0].state.request_id].kv
        n_layers, _, heads, _, head_dim = first.shape
        buffer = first.new_zeros((n_layers, 2, len(group), heads, max(sizes), head_dim))
        valid = torch.zeros((len(group), max(sizes)), dtype=torch.bool)
        for row, (it, size) in enumerate(zip(group, sizes, strict=True)):
            kv = self._caches[it.state.request_id].kv
            buffer[:, :, row, :, buffer.shape[4] - size :] = kv.index_select(3, it.context_index.to(kv.device))
            valid[row, buffer.shape[4] - size :] = True
        return [(buffer[i, 0], buffer[i, 1]) for i in range(n_layers)], valid.to(first.device)

    def _store_caches(self, group: list[_Item], kv: torch.Tensor, width: int) -> None:
        # kv: [n_layers, 2, B, H_kv, width, head_dim]
        for row, it in enumerate(group):
            if it.state.cache_mode is not CacheMode.NONE:
                n = len(it.fresh_ids)
                self._caches[it.state.request_id] = _Cache(it.block, kv[:, :, row, :, width - n :].clone())

    def _commit(self, item: _Item, logits_of: Callable[[int], torch.Tensor]) -> StepResult:
        state = item.state
        prompt_len = len(state.prompt_ids)
        start, end = state.block_bounds(item.block)
        masked = [i for i in range(start, end) if state.canvas[i] == self.mask_id]
        rows = torch.stack([logits_of(prompt_len + i) for i in masked]).float()
        rows[:, self.mask_id] = float("-inf")  # the mask token is never an answer
        conf, tokens = torch.softmax(rows, dim=-1).max(dim=-1)
        chosen = conf > item.threshold
        chosen[torch.argmax(conf)] = True
        committed = [(masked[j], int(tokens[j])) for j in torch.nonzero(chosen).flatten().tolist()]
        for pos, tok in committed:
            state.canvas[pos] = tok
        state.num_steps += 1
        remaining = [float(conf[j]) for j in range(len(masked)) if not chosen[j]]
        skipped = self._finish_if_done(state, start, end)
        return StepResult(
            state.request_id, item.kind, item.block, [p for p, _ in committed], [t for _, t in committed],
            state.finished, state.num_steps, state.canvas.count(self.mask_id), ConfidenceStats.of(remaining),
            item.threshold, tuple(conf.tolist()), skipped,
        )

    def _finish_if_done(self, state: RequestState, block_start: int, block_end: int) -> int:
        """Finish ``state`` if its canvas is done, or its block completed an EOS; the blocks skipped."""
        block_done = self.mask_id not in state.canvas[block_start:block_end]
        skipped = 0
        if block_done and self.stops_at_eos(state) and self.eos_id in state.canvas[:block_end]:
            skipped = state.num_blocks - 1 - block_start // state.block_length
            state.canvas[block_end:] = [self.eos_id] * (state.gen_length - block_end)
        if self.mask_id not in state.canvas:
            state.finished = True
            self.drop(state.request_id)
        return skipped

    def stops_at_eos(self, state: RequestState) -> bool:
        return self.stop_at_eos and not state.ignore_eos

    def answer(self, state: RequestState, max_tokens: int | None = None) -> Answer:
        """The answer of a finished request, cut at ``max_tokens`` (see ``shared.generation``)."""
        return answer_of(state.canvas, self.eos_id, max_tokens, not self.stops_at_eos(state))

    # --- conveniences ---------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise EngineError("this engine has no tokenizer: pass token ids")
        try:
            return self.tokenizer.encode(text)
        except ValueError as exc:
            raise EngineError(str(exc)) from None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else " ".join(map(str, ids))

    def run_to_completion(self, batch: list[tuple[RequestState, float]]) -> dict[str, list[StepKind]]:
        """Step a batch until every request finishes (continuous batching: finished ones leave)."""
        kinds: dict[str, list[StepKind]] = {s.request_id: [] for s, _ in batch}  # request id -> kinds
        active = list(batch)
        while active:
            for result in self.step(active):
                kinds[result.request_id].append(result.kind)
            active = [(s, t) for s, t in active if not s.finished]
        return kinds

    def generate(
        self,
        prompt: str,
        threshold: float = 0.9,
        gen_length: int | None = None,
        block_length: int | None = None,
        cache: CacheMode = CacheMode.DUAL,
        on_step: Callable[[str], None] | None = None,
        max_tokens: int | None = None,
        ignore_eos: bool = False,
    ) -> GenerationResult:
        """Denoise one prompt. ``max_tokens`` caps the answer and sets the canvas as a server does
        (rounded up to the block, at most the model's longest canvas) unless ``gen_length`` is given."""
        block_length = block_length or self.default_block_length
        if gen_length is None and max_tokens is not None:
            gen_length = canvas_length(max_tokens, block_length, self.max_gen_length or max_tokens + block_length)
        state = self.new_request("generate", self.encode(prompt), gen_length, block_length, cache, ignore_eos)
        kinds, skipped = [], 0
        while not state.finished:
            result = self.step([(state, threshold)])[0]
            kinds.append(result.kind)
            skipped += result.blocks_skipped
            if on_step is not None:
                on_step(self.tokenizer.decode(state.canvas, stop_at_eos=False).replace("\n", "\\n"))
        answer = self.answer(state, max_tokens)
        return GenerationResult(self.decode(answer.token_ids), state.canvas, state.num_steps, kinds,
                                answer.finish_reason, skipped)
