"""The denoising engine: block-wise threshold decoding with step-level batching and an approximate KV cache.

A request's state is plain data (:class:`RequestState`, ``services/worker/engine/request.py``): any
engine can continue a request from it; the only thing an engine keeps locally is the request's KV cache.

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
stops it reports the blocks it skipped (each would have cost one forward at least). A request with
``stop`` strings also stops at the step whose committed prefix (the answer so far, up to the first
masked position) first holds one of them: its answer ends before that string (``stop_length``), the
rest of the canvas becomes EOS padding.

Sampling (``services/worker/decoding/sampling.py``): a request with a temperature above 0 draws each
position's candidate with Gumbel noise (after its top-k / top-p cut), keyed by its seed and step
index, so it draws the same on any instance; the commit rule compares the model's probability of the
drawn token with the threshold. Greedy requests (temperature 0) take the argmax exactly as before.
Every committed position records the probability it was committed with (``RequestState.confidences``)
and, when asked (``num_top_logprobs``), the most likely tokens there: what ``logprobs`` returns.

Packed batches: a forward concatenates its requests' fresh tokens into one sequence (no padding);
attention knows where each request's rows lie (``services/worker/attention/step.py``: flash-attn's varlen
kernel on CUDA, SDPA per request elsewhere, the same tokens either way). The LM head runs only on the
rows of each request's current block, and, in a full forward of a request that stops at EOS, on the
canvas positions after it: where the first position whose most likely token is EOS lies is where
the model expects the answer to end (``RequestState.predicted_end``), which the step predictor reads
(how many blocks are left to run). That costs the LM head over the rest of the canvas once per block
(``predict_end=False``: never).

The KV cache is read in place (``services/worker/kv/cache.py``): each cached request owns a
contiguous run of pages of one pool, slot ``p`` holding position ``p`` with RoPE applied. A recompute
step writes the positions later cache steps read (all of them for ``dual``, those before the block
for ``prefix``); a cache step overwrites its fresh window's slots with the fresh keys and values and
then attends to the request's whole cache where it lies (attention over keys is order-free once RoPE
is applied at absolute positions, so that is the stale prefix and suffix plus the fresh window).
Nothing is gathered; :attr:`DLMEngine.last_step_traffic` reports the bytes each step copied and wrote.

KV memory (``kv_budget_bytes``): the pool never takes more than its budget. A request holds
``ceil((prompt + canvas) / page_size)`` pages from its first recompute step until it finishes or is
dropped (no cache: none). :meth:`DLMEngine.kv_overflow` tells which requests of a batch would not
fit (the worker fails those, typed, and steps the rest); :meth:`DLMEngine.step` itself refuses a
batch that would overflow with :class:`KVBudgetExceeded` before anything changes.
:meth:`DLMEngine.kv_memory` is what heartbeats report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.worker.attention.flash import FLASH_PAGE_SIZE
from services.worker.attention.layout import KeyLayout, StepLayout
from services.worker.attention.select import AttentionBackend, resolve_backend
from services.worker.decoding.rule import DecodingRule, cache_window_start, commit_eligible, decoding_rule
from services.worker.decoding.sampling import MAX_TOP_LOGPROBS, SamplingParams, noise_seed
from services.worker.engine.request import (
    ConfidenceStats,
    EngineError,
    GenerationResult,
    RequestState,
    StepResult,
)
from services.worker.kv.cache import KVBudgetExceeded as KVBudgetExceeded  # re-exported: what step raises
from services.worker.kv.cache import PagedKVCache
from services.worker.model.dlm import DLMForMaskedDiffusion
from services.worker.runner.runner import (
    GRAPH_BUCKETS,
    ForwardBatch,
    ModelRunner,
    SampledRows,
    StepOutput,
    TopRows,
)
from shared.generation import Answer, canvas_length, stop_length
from shared.messages.base import CacheMode, StepKind
from shared.tokenizer import answer_text

if TYPE_CHECKING:
    from services.worker.model.loading import LoadedModel


@dataclass(frozen=True)
class KVMemory:
    """The KV pool's memory now (bytes and positions; a budget of 0: none)."""

    budget_bytes: int  # the cap (0: none)
    pool_bytes: int  # allocated now
    used_bytes: int  # in pages requests hold
    used_tokens: int  # positions requests hold
    bytes_per_token: int  # one position, every layer (this engine's heads)
    page_tokens: int  # positions per page (a request's pages round its positions up to this)
    num_requests: int  # requests holding pages

    @property
    def free_bytes(self) -> int:
        return max(self.budget_bytes - self.used_bytes, 0) if self.budget_bytes else 0

    def capacity_tokens(self, max_batch: int) -> int:
        """Positions a scheduler may place here, summed over requests, and be sure they fit: the budget
        less one page's rounding per request of a full batch (0: no budget)."""
        if not self.budget_bytes:
            return 0
        return max(self.budget_bytes // self.bytes_per_token - max_batch * (self.page_tokens - 1), 0)


@dataclass(frozen=True)
class KVTraffic:
    """KV-cache bytes one forward moved (every layer, this engine's heads)."""

    copied: int = 0  # stored entries copied elsewhere (a gather, or the pool growing)
    written: int = 0  # fresh keys and values stored


@dataclass
class _Item:
    """One request's part of a packed forward."""

    state: RequestState
    threshold: float
    kind: StepKind
    block: int
    fresh_start: int  # absolute position of the first fresh (input) token
    fresh_ids: list[int]
    # index into fresh_ids of the output that predicts the block's first position (negative: none does, the
    # position is committed already: Dream's rule at a cache step)
    logit_start: int
    # recompute steps with a cache: positions 0..num_stored-1 are stored (what this block's cache
    # steps read without recomputing: all for dual, those before the window for prefix)
    num_stored: int = 0
    # full forwards of a request that stops at EOS: the outputs of the canvas positions after the block
    # also go through the LM head, to see where the model expects the EOS (``predicted_end``)
    num_lookahead: int = 0
    extent_key: str | None = None  # a no-cache request's transient extent, in a step reading keys from the pool

    @property
    def block_tokens(self) -> list[int]:
        start, end = self.state.block_bounds(self.block)
        return self.state.canvas[start:end]

    @property
    def block_size(self) -> int:
        start, end = self.state.block_bounds(self.block)
        return end - start

    @property
    def sequence_length(self) -> int:
        return len(self.state.prompt_ids) + self.state.gen_length


def loaded_options(loaded: LoadedModel) -> dict:
    """The engine options a loaded model brings: its tokenizer, default lengths, name and longest canvas."""
    return dict(tokenizer=loaded.tokenizer, default_gen_length=loaded.gen_length,
                default_block_length=loaded.block_length, name=loaded.name,
                max_gen_length=loaded.limits.max_gen_length)


class DLMEngine:
    """Runs denoising steps for batches of requests on one model instance (the ``Engine`` protocol,
    ``services/worker/engine/protocol.py``)."""

    blocking = True  # a step runs the model: the worker runs it off its event loop

    def __init__(
        self,
        model: DLMForMaskedDiffusion,
        tokenizer=None,
        default_gen_length: int = 256,
        default_block_length: int = 32,
        stop_at_eos: bool = True,
        name: str = "model",
        predict_end: bool = True,
        max_gen_length: int | None = None,
        attention: str = "auto",
        kv_page_size: int | None = None,
        kv_capacity_tokens: int = 0,
        kv_budget_bytes: int = 0,
        cuda_graphs: bool | None = None,
    ) -> None:
        """``attention``: ``auto`` (flash-attn where it runs, else PyTorch's varlen op on CUDA, else
        flex_attention on CUDA, else SDPA), ``flash``, ``torch_varlen``, ``flex`` or ``sdpa``
        (``services/worker/attention/step.py``). ``cuda_graphs``: replay dual-cache steps from CUDA graphs
        (``services/worker/runner/runner.py``; default: on CUDA with a varlen kernel; False turns them off).
        ``kv_page_size``: slots per KV page (flash-attn needs 256; SDPA defaults to 16).
        ``kv_capacity_tokens``: positions the KV pool holds from the start (it grows when full).
        ``kv_budget_bytes``: the most the KV pool may take (0: no cap; ``set_kv_budget`` later).
        ``predict_end``: full forwards also read the canvas after the block, to tell where the answer
        will end (``RequestState.predicted_end``, a step predictor feature)."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.default_gen_length = default_gen_length
        self.default_block_length = default_block_length
        self.stop_at_eos = stop_at_eos
        self.predict_end = predict_end
        self.name = name
        self.max_gen_length = max_gen_length  # longest canvas the model answers the same at (None: any)
        self.mask_id = model.config.mask_token_id
        self.eos_id = model.config.eos_token_id
        self.shift = int(getattr(model.config, "logits_shift", 0))
        self.rule = decoding_rule(model.config)  # the family's decoding rule (services/worker/decoding/rule.py)
        block = model.model.transformer.blocks[0]  # a tensor-parallel shard holds only its own heads
        backend = resolve_backend(attention, model.device, model.dtype, block.head_dim,
                                  gqa=block.n_kv_heads != block.n_heads)
        page_size = kv_page_size or (FLASH_PAGE_SIZE if backend is AttentionBackend.FLASH else 16)
        if backend is AttentionBackend.FLASH and page_size % FLASH_PAGE_SIZE:
            raise EngineError(f"flash-attn needs KV pages of a multiple of {FLASH_PAGE_SIZE} slots, got {page_size}")
        self.kv_cache = PagedKVCache(len(model.model.transformer.blocks), block.n_kv_heads, block.head_dim,
                                     model.dtype, model.device, page_size, kv_capacity_tokens, kv_budget_bytes)
        graphs = model.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.runner = ModelRunner(model, backend, self.kv_cache, cuda_graphs=graphs)
        self._cache_blocks: dict[str, int] = {}  # request id -> the block whose start refreshed its cache
        self.last_step_traffic: dict[StepKind, KVTraffic] = {}  # kind -> bytes its forward moved, last step

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, **options) -> DLMEngine:
        """The engine of a loaded model (``services/worker/model/loading.py``), with its tokenizer, default
        lengths, name and longest canvas; ``options``: the constructor's others."""
        return cls(loaded.model, **loaded_options(loaded), **options)

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str = "cpu", **options) -> DLMEngine:
        from services.worker.model.loading import load_model

        return cls.from_loaded(load_model(directory, device=device), **options)

    @property
    def attention(self) -> AttentionBackend:
        """The attention backend every step runs on (the runner's)."""
        return self.runner.attention

    @attention.setter
    def attention(self, backend: AttentionBackend) -> None:
        self.runner.attention = backend
        self.runner.graphs_enabled = self.runner.graphs_enabled and backend in (AttentionBackend.FLASH,
                                                                                AttentionBackend.TORCH_VARLEN)

    # --- requests -------------------------------------------------------------------------------

    def new_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        gen_length: int | None = None,
        block_length: int | None = None,
        cache_mode: CacheMode = CacheMode.DUAL,
        ignore_eos: bool = False,
        sampling: SamplingParams | None = None,
        num_top_logprobs: int = 0,
        stop: tuple[str, ...] | list[str] = (),
        max_tokens: int | None = None,
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
        state = RequestState(request_id, list(prompt_ids), [self.mask_id] * gen_length, block_length, cache_mode,
                             ignore_eos=ignore_eos, sampling=sampling or SamplingParams(),
                             num_top_logprobs=num_top_logprobs, stop=tuple(stop), max_tokens=max_tokens)
        self._check_options(state)
        return state

    def _check_options(self, state: RequestState) -> None:
        try:
            state.sampling.validate()
        except ValueError as exc:
            raise EngineError(f"request {state.request_id}: {exc}") from None
        if not 0 <= state.num_top_logprobs <= MAX_TOP_LOGPROBS:
            raise EngineError(f"request {state.request_id}: num_top_logprobs {state.num_top_logprobs} is outside "
                              f"0..{MAX_TOP_LOGPROBS}")
        if state.stop and self.tokenizer is None:
            raise EngineError(f"request {state.request_id}: stop strings need a tokenizer, this engine has none")

    def drop(self, request_id: str) -> None:
        """Forget a request's cache (it finished, or moved to another instance); its pages are reused."""
        self._cache_blocks.pop(request_id, None)
        self.kv_cache.release(request_id)

    def has_cache(self, request_id: str) -> bool:
        return request_id in self._cache_blocks

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of KV pages held by requests' caches (the pool may hold more, free)."""
        return self.kv_cache.reserved_bytes

    def set_kv_budget(self, budget_bytes: int) -> None:
        """Cap the KV pool; where CUDA graphs run, the pool is allocated to the budget now, so that it
        never moves under the graphs (a pool that grows is a new tensor: every graph recaptured)."""
        self.kv_cache.set_budget(budget_bytes)
        if self.runner.graphs_enabled and budget_bytes:
            self.kv_cache.preallocate()

    def kv_memory(self) -> KVMemory:
        """The pool's memory (plain counter reads: safe from another thread while a step runs)."""
        cache = self.kv_cache
        return KVMemory(cache.budget_bytes, cache.capacity_bytes, cache.reserved_bytes, cache.held_tokens,
                        cache.bytes_per_token, cache.page_size, len(self._cache_blocks))

    def trim_kv(self) -> int:
        """Give the pool's memory back when no request holds pages; the bytes freed."""
        return self.kv_cache.trim()

    def kv_overflow(self, batch: list[tuple[RequestState, float]]) -> list[str]:
        """Requests of ``batch`` whose next step would take KV pages beyond the budget, taken in batch
        order (the first ones fit); empty with no budget."""
        cache = self.kv_cache
        left = cache.budget_pages_left
        if left is None:
            return []
        over = []
        for state, _ in batch:
            need = self._kv_request(state)
            if need is None:
                continue
            pages = cache.pages_needed([need])
            if pages > left:
                over.append(state.request_id)
            else:
                left -= pages
        return over

    def _kv_request(self, state: RequestState) -> tuple[str, int] | None:
        """(request id, positions) the next step of ``state`` reserves KV for; None: it reserves none."""
        if state.finished or state.cache_mode is CacheMode.NONE or self.next_step_kind(state) is not StepKind.RECOMPUTE:
            return None
        return state.request_id, len(state.prompt_ids) + state.gen_length

    def next_step_kind(self, state: RequestState) -> StepKind:
        if state.cache_mode is CacheMode.NONE:
            return StepKind.RECOMPUTE
        fresh = self._cache_blocks.get(state.request_id) == state.current_block(self.mask_id)
        return StepKind.CACHE if fresh else StepKind.RECOMPUTE

    # --- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, batch: list[tuple[RequestState, float]]) -> list[StepResult]:
        """Advance every (state, threshold) by one step, in one forward; states are updated in place."""
        items = [self._plan(state, tau) for state, tau in batch]
        copied = self.kv_cache.bytes_copied
        # every KV reservation the batch makes, before anything changes (KVBudgetExceeded: none does)
        self.kv_cache.make_room([need for state, _ in batch if (need := self._kv_request(state)) is not None])
        keys = KeyLayout.FRESH if all(it.kind is StepKind.RECOMPUTE for it in items) else KeyLayout.POOL
        transient = self._place(items, keys)
        try:
            forward = self._forward_batch(items, keys)
            output = self.runner.forward(forward)
        finally:
            for key in transient:
                self.kv_cache.release(key)
        self._note_traffic(items, keys, self.kv_cache.bytes_copied - copied)
        results: dict[str, StepResult] = {}  # request id -> result
        row, ahead = 0, forward.num_block_rows  # each item's first block row, and lookahead row
        for item in items:
            if item.kind is StepKind.RECOMPUTE and item.state.cache_mode is not CacheMode.NONE:
                self._cache_blocks[item.state.request_id] = item.block
            n = item.block_size
            if item.kind is StepKind.RECOMPUTE and self.predict_end and item.state.stops_at_eos(self.stop_at_eos):
                # where the request expects its EOS: its block rows and the lookahead rows after them
                self._predict_end(item, output.tokens[row : row + n] + output.tokens[ahead : ahead + item.num_lookahead])
                ahead += item.num_lookahead
            results[item.state.request_id] = self._commit(item, output, row)
            row += n
        return [results[state.request_id] for state, _ in batch]

    def _plan(self, state: RequestState, threshold: float) -> _Item:
        """What ``state``'s next step runs (no side effects: the tensor-parallel engine validates with it)."""
        if state.finished:
            raise EngineError(f"request {state.request_id} is already finished")
        if not 0.0 <= threshold <= 1.0:
            raise EngineError(f"threshold {threshold} is outside [0, 1]")
        self._check_options(state)
        kind, block = self.next_step_kind(state), state.current_block(self.mask_id)
        sequence = state.prompt_ids + state.canvas
        prompt_len = len(state.prompt_ids)
        start, end = state.block_bounds(block)
        predicting = prompt_len + start - self.shift  # the output predicting the block's first position
        window_start = cache_window_start(self.rule, prompt_len + start, self.shift)  # a cache step's first row
        if kind is StepKind.RECOMPUTE:
            stored = {CacheMode.NONE: 0, CacheMode.PREFIX: window_start, CacheMode.DUAL: len(sequence)}
            ahead = state.gen_length - end if self.predict_end and state.stops_at_eos(self.stop_at_eos) else 0
            return _Item(state, threshold, kind, block, 0, sequence, predicting, stored[state.cache_mode], ahead)
        window_end = prompt_len + (end if state.cache_mode is CacheMode.DUAL else state.gen_length)
        # Dream's rule starts the window at the block: its first position (committed at the block's first
        # forward) has no output in the window (logit_start < 0: never read)
        return _Item(state, threshold, kind, block, window_start, sequence[window_start:window_end],
                     predicting - window_start)

    def _place(self, items: list[_Item], keys: KeyLayout) -> list[str]:
        """Reserve the KV extents the step writes (recompute steps with a cache; with keys read from the
        pool, a transient extent per no-cache request too), and order the items as the pool holds them
        (the torch_varlen kernel reads keys at increasing offsets); the transient extents' keys."""
        self.runner.prepare()
        caching = [it for it in items if it.kind is StepKind.RECOMPUTE and it.state.cache_mode is not CacheMode.NONE]
        for it in caching:  # all first: a reservation may compact the pool, moving the others' pages
            self.kv_cache.reserve(it.state.request_id, it.sequence_length)
        transient = []
        if keys is KeyLayout.POOL:
            for it in items:
                if it.state.cache_mode is CacheMode.NONE:
                    key = f"<step>{it.state.request_id}"
                    self.kv_cache.reserve_transient(key, it.sequence_length)
                    it.extent_key = key
                    transient.append(key)
                if it.kind is StepKind.RECOMPUTE:
                    it.num_stored = it.sequence_length  # its own attention reads them from the pool
            items.sort(key=lambda it: self.kv_cache.extent(it.extent_key or it.state.request_id).first_page)
        return transient

    def _forward_batch(self, items: list[_Item], keys: KeyLayout) -> ForwardBatch:
        """The step as the model runner takes it (host arrays, built once)."""
        q_lengths = [len(it.fresh_ids) for it in items]
        q_starts = np.concatenate(([0], np.cumsum(q_lengths)[:-1])).astype(np.int64)
        total = int(sum(q_lengths))
        ids = np.fromiter((t for it in items for t in it.fresh_ids), dtype=np.int64, count=total)
        first = np.repeat(np.array([it.fresh_start for it in items], dtype=np.int64) - q_starts, q_lengths)
        positions = np.arange(total, dtype=np.int64) + first
        layout, write_slots, write_rows = self._keys_and_writes(items, keys, q_lengths, q_starts, positions)
        block_sizes = [it.block_size for it in items]
        block_rows = np.concatenate([np.maximum(np.arange(q + it.logit_start, q + it.logit_start + n), q)
                                     for it, q, n in zip(items, q_starts, block_sizes, strict=True)])
        lookahead = [np.arange(q + it.logit_start + n, q + it.logit_start + n + it.num_lookahead)
                     for it, q, n in zip(items, q_starts, block_sizes, strict=True) if it.num_lookahead]
        eligible, thresholds, grid, sampled, top = self._commit_inputs(items, block_sizes)
        graphable = (keys is KeyLayout.POOL and all(it.kind is StepKind.CACHE and it.state.cache_mode is CacheMode.DUAL
                                                    for it in items)
                     and len(set(q_lengths)) == 1 and len(set(block_sizes)) == 1)
        return ForwardBatch(
            ids=ids, positions=positions, layout=layout,
            logit_rows=np.concatenate([block_rows, *lookahead]), num_block_rows=int(sum(block_sizes)),
            eligible=eligible, thresholds=thresholds, grid=grid,
            max_position=int(max(it.fresh_start + len(it.fresh_ids) for it in items)) - 1,
            write_slots=write_slots, write_rows=write_rows, sampled=sampled, top=top,
            graph_window=q_lengths[0] if graphable else 0, block_length=block_sizes[0] if graphable else 0,
            inclusive=self.rule.inclusive,
        )

    def _keys_and_writes(self, items: list[_Item], keys: KeyLayout, q_lengths: list[int], q_starts: np.ndarray,
                         positions: np.ndarray):
        """Where each item's keys are (the layout) and which fresh rows go to which slots (None: every
        row, or no slots: nothing stored)."""
        page = self.kv_cache.page_size
        if keys is KeyLayout.POOL:  # every row to its position's slot; keys read from each extent
            firsts = [self.kv_cache.extent(it.extent_key or it.state.request_id).first_slot(page) for it in items]
            layout = StepLayout(tuple(q_lengths), keys, tuple(firsts), tuple(it.sequence_length for it in items))
            return layout, positions + np.repeat(firsts, q_lengths), None
        stored = [(int(q), self.kv_cache.extent(it.state.request_id).first_slot(page), it.num_stored)
                  for it, q in zip(items, q_starts, strict=True) if it.num_stored]
        if not stored:
            return StepLayout(tuple(q_lengths), keys), None, None
        rows = np.concatenate([np.arange(q, q + n) for q, _, n in stored])
        slots = np.concatenate([np.arange(s, s + n) for _, s, n in stored])
        return StepLayout(tuple(q_lengths), keys), slots, None if len(rows) == sum(q_lengths) else rows

    def _commit_inputs(self, items: list[_Item], block_sizes: list[int]):
        """What the commit rule reads: which block rows may commit (still masked; Dream's rule: only a
        block's first position at the block's first forward), each row's threshold, each item's rows
        (``grid``), and the items that draw or want their top candidates."""
        num_rows = int(sum(block_sizes))
        row_starts = np.concatenate(([0], np.cumsum(block_sizes)[:-1])).tolist()
        masked = np.fromiter((t == self.mask_id for it in items for t in it.block_tokens), dtype=bool, count=num_rows)
        eligible = commit_eligible(self.rule, masked, row_starts, block_sizes)
        thresholds = np.repeat(np.array([it.threshold for it in items], dtype=np.float64), block_sizes)
        grid = np.full((len(items), max(block_sizes)), num_rows, dtype=np.int64)
        sampled, top = [], []
        for i, (it, start, n) in enumerate(zip(items, row_starts, block_sizes, strict=True)):
            grid[i, :n] = np.arange(start, start + n)
            state = it.state
            if not state.sampling.greedy:
                seed = noise_seed(state.sampling.seed, state.request_id, state.num_steps)
                sampled.append(SampledRows(start, start + n, state.sampling, seed))
            if state.num_top_logprobs:
                top.append(TopRows(start, start + n, state.num_top_logprobs))
        return eligible, thresholds, grid, sampled, top

    def _note_traffic(self, items: list[_Item], keys: KeyLayout, copied: int) -> None:
        """``last_step_traffic``: per step kind, the cache bytes its requests stored and the bytes the
        pool copied (growing or compacting, which only recompute steps' reservations do)."""
        per_token = self.kv_cache.bytes_per_token
        self.last_step_traffic = {}
        for kind in (StepKind.RECOMPUTE, StepKind.CACHE):
            group = [it for it in items if it.kind is kind]
            if not group:
                continue
            stored = sum(it.num_stored if kind is StepKind.RECOMPUTE else len(it.fresh_ids)
                         for it in group if it.state.cache_mode is not CacheMode.NONE)
            moved = copied if kind is StepKind.RECOMPUTE or not any(it.kind is StepKind.RECOMPUTE for it in items) else 0
            self.last_step_traffic[kind] = KVTraffic(moved, stored * per_token)

    def _predict_end(self, item: _Item, tokens: list[int]) -> None:
        """``predicted_end``: the first still-masked position of the block or after it whose candidate
        is EOS (the mask token excluded), else the canvas end."""
        start, canvas = item.state.block_bounds(item.block)[0], item.state.canvas
        item.state.predicted_end = next((start + i for i, t in enumerate(tokens)
                                         if t == self.eos_id and canvas[start + i] == self.mask_id),
                                        item.state.gen_length)

    def _commit(self, item: _Item, output: StepOutput, row: int) -> StepResult:
        """Apply the step's commits to ``item``'s canvas (its block rows start at ``row``)."""
        state = item.state
        start, end = state.block_bounds(item.block)
        committed, masked_confidences, remaining = [], [], []
        for i in range(end - start):
            pos = start + i
            if state.canvas[pos] != self.mask_id:
                continue
            conf = output.confidence[row + i]
            masked_confidences.append(conf)
            if output.commit[row + i]:
                committed.append((pos, output.tokens[row + i]))
                state.record_commit(pos, conf, output.top.get(row + i))
            else:
                remaining.append(conf)
        for pos, token in committed:
            state.canvas[pos] = token
        state.num_steps += 1
        eos_at = [p for p, t in committed if t == self.eos_id]
        if eos_at and self.predict_end and state.stops_at_eos(self.stop_at_eos):  # the answer ends there or before
            known = state.gen_length if state.predicted_end is None else state.predicted_end
            state.predicted_end = min(*eos_at, known)
        skipped = self._finish_if_done(state, start, end)
        return StepResult(
            state.request_id, item.kind, item.block, [p for p, _ in committed], [t for _, t in committed],
            state.finished, state.num_steps, state.canvas.count(self.mask_id), ConfidenceStats.of(remaining),
            item.threshold, tuple(masked_confidences), skipped, state.predicted_end,
            block_done=not remaining or state.finished,  # a stop string's padding fills the block too
        )

    def _finish_if_done(self, state: RequestState, block_start: int, block_end: int) -> int:
        """Finish ``state`` if its canvas is done, its block completed an EOS, or its answer so far holds a
        stop string; the blocks skipped."""
        block_done = self.mask_id not in state.canvas[block_start:block_end]
        skipped = 0
        state.stop_length = self._stopped_at(state)
        if state.stop_length is not None:
            skipped = state.num_blocks - 1 - block_start // state.block_length
            state.canvas[:] = [self.eos_id if t == self.mask_id else t for t in state.canvas]
        elif block_done and state.stops_at_eos(self.stop_at_eos) and self.eos_id in state.canvas[:block_end]:
            skipped = state.num_blocks - 1 - block_start // state.block_length
            state.canvas[block_end:] = [self.eos_id] * (state.gen_length - block_end)
        if self.mask_id not in state.canvas:
            state.finished = True
            self.drop(state.request_id)
        return skipped

    def _stopped_at(self, state: RequestState) -> int | None:
        """The answer's length in tokens when its committed prefix holds a stop string, else None."""
        if not state.stop:
            return None
        first_mask = state.canvas.index(self.mask_id) if self.mask_id in state.canvas else state.gen_length
        return stop_length(self.answer(state, upto=first_mask).token_ids, self.decode, state.stop)

    def answer(self, state: RequestState, max_tokens: int | None = None, upto: int | None = None) -> Answer:
        """The answer in ``state``'s canvas (``RequestState.answer``: EOS ignored where the request or this
        engine ignores it), cut at ``max_tokens`` (default: the request's own cap); ``upto``: the answer so
        far in the canvas's first ``upto`` positions."""
        return state.answer(self.eos_id, self.stop_at_eos, max_tokens, upto)

    # --- conveniences ---------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise EngineError("this engine has no tokenizer: pass token ids")
        try:
            return self.tokenizer.encode(text)
        except ValueError as exc:
            raise EngineError(str(exc)) from None

    def decode(self, ids: list[int]) -> str:
        """Answer text (``shared.tokenizer.answer_text``, as the gateway decodes: special tokens dropped)."""
        return answer_text(self.tokenizer, ids, self.mask_id) if self.tokenizer is not None else " ".join(map(str, ids))

    def warm_up(self, max_batch: int = GRAPH_BUCKETS[-1]) -> int:
        """Run one short request through a full step and a cache step and forget it, so that the first
        request served does not pay for lazy initialisation (kernels chosen, tables built, memory
        allocated); where CUDA graphs run, capture the dual-cache step of the default block length for
        every batch bucket up to ``max_batch``. Workers call it before they announce themselves ready.
        Returns the number of graphs held."""
        self.warm_steps()
        block = self.default_block_length
        window = block + (self.shift if self.rule is DecodingRule.LLADA else 0)  # a dual-cache step's rows
        return self.runner.capture(window, block, max_batch)

    def close(self) -> None:
        """Give back what the engine holds beyond its memory (a tensor-parallel engine's ranks). Idempotent."""

    def __enter__(self) -> DLMEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def warm_steps(self) -> None:
        """One short request through a full step and a cache step, forgotten (any engine with ``step``)."""
        prompt = [self.eos_id if self.eos_id != self.mask_id else 0] * 4
        block = min(self.default_block_length, 4)
        state = self.new_request("warm-up", prompt, block, block, CacheMode.DUAL, ignore_eos=True)
        try:
            for _ in range(2):
                if not state.finished:
                    self.step([(state, 1.0)])
        finally:
            self.drop(state.request_id)

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
        sampling: SamplingParams | None = None,
        stop: tuple[str, ...] | list[str] = (),
        request_id: str = "generate",
    ) -> GenerationResult:
        """Denoise one prompt. ``max_tokens`` caps the answer and sets the canvas as a server does
        (rounded up to the block, at most the model's longest canvas) unless ``gen_length`` is given."""
        block_length = block_length or self.default_block_length
        if gen_length is None and max_tokens is not None:
            gen_length = canvas_length(max_tokens, block_length, self.max_gen_length or max_tokens + block_length)
        state = self.new_request(request_id, self.encode(prompt), gen_length, block_length, cache, ignore_eos,
                                 sampling, stop=stop, max_tokens=max_tokens)
        kinds, skipped = [], 0
        while not state.finished:
            result = self.step([(state, threshold)])[0]
            kinds.append(result.kind)
            skipped += result.blocks_skipped
            if on_step is not None:
                on_step(self.tokenizer.decode(state.canvas, stop_at_eos=False).replace("\n", "\\n"))
        answer = self.answer(state)
        return GenerationResult(self.decode(answer.token_ids), state.canvas, state.num_steps, kinds,
                                answer.finish_reason, skipped)
