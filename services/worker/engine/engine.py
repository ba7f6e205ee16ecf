"""The denoising engine: block-wise threshold decoding with step-level batching and an approximate KV cache.

A request's state is plain data (:class:`RequestState`, ``services/worker/engine/request.py``): any
engine can continue a request from it; the only thing an engine keeps locally is the request's KV cache.

One :meth:`DLMEngine.step` call advances every request in the batch by one denoising step, each with
its own threshold. Requests may differ in prompt length, generation length, block length, block
and cache mode, and may join or leave between steps. The whole batch runs as one forward: full-sequence
steps (recompute, or every step without cache) and cache steps together.

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

The KV cache is read in place (``services/worker/kv/``: the page table ``pages.py`` the engine asks,
the tensor ``pool.py`` the runner writes): each cached request owns a
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
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.worker.attention.layout import KeyLayout
from services.worker.attention.select import AttentionBackend
from services.worker.decoding.rule import DecodingRule, decoding_rule
from services.worker.decoding.sampling import MAX_TOP_LOGPROBS, SamplingParams
from services.worker.engine.planner import RequestPlan, kv_reservation, place, plan_request, step_traffic
from services.worker.engine.request import (
    ConfidenceStats,
    EngineError,
    GenerationResult,
    RequestState,
    StepResult,
)
from services.worker.kv.pages import KVMemory, KVPages, KVTraffic
from services.worker.model.dlm import DLMForMaskedDiffusion
from services.worker.runner.batch import StepOutput, pack_batch
from services.worker.runner.graphs import GRAPH_BUCKETS
from services.worker.runner.runner import ModelRunner, choose_attention
from shared.generation import Answer, canvas_length, stop_length
from shared.messages.base import CacheMode, StepKind
from shared.tokenizer import answer_text

if TYPE_CHECKING:
    from services.worker.model.loading import LoadedModel


def loaded_options(loaded: LoadedModel) -> dict:
    """The engine options a loaded model brings: its tokenizer, default lengths, name and longest canvas."""
    return dict(tokenizer=loaded.tokenizer, default_gen_length=loaded.limits.gen_length,
                default_block_length=loaded.limits.block_length, name=loaded.name,
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
        runner: ModelRunner | None = None,
    ) -> None:
        """``attention``: ``auto`` (flash-attn where it runs, else PyTorch's varlen op on CUDA, else
        flex_attention on CUDA, else SDPA), ``flash``, ``torch_varlen``, ``flex`` or ``sdpa``
        (``services/worker/attention/select.py``). ``cuda_graphs``: replay dual-cache steps from CUDA graphs
        (``services/worker/runner/graphs.py``; default: on CUDA with a varlen kernel; False turns them off).
        ``kv_page_size``: slots per KV page (flash-attn needs 256; SDPA defaults to 16).
        ``kv_capacity_tokens``: positions the KV pool holds from the start (it grows when full).
        ``kv_budget_bytes``: the most the KV pool may take (0: no cap; ``set_kv_budget`` later).
        ``predict_end``: full forwards also read the canvas after the block, to tell where the answer
        will end (``RequestState.predicted_end``, a step predictor feature).
        ``runner``: the model runner to step with (a tensor-parallel engine's, which spreads each forward
        over its ranks); default: one built here from ``attention``, ``kv_page_size`` and ``cuda_graphs``."""
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
        if runner is None:
            backend, page_size = choose_attention(model, attention, kv_page_size)
            graphs = model.device.type == "cuda" if cuda_graphs is None else cuda_graphs
            runner = ModelRunner(model, backend, page_size, cuda_graphs=graphs)
        self.runner = runner
        pool = runner.kv_pool
        self.kv_pages = KVPages(pool.page_size, pool.bytes_per_token, kv_capacity_tokens, kv_budget_bytes)
        self.runner.change_pool(self.kv_pages.take_changes())
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
        self.kv_pages.forget(request_id)

    def has_cache(self, request_id: str) -> bool:
        return self.kv_pages.cached_block(request_id) is not None

    def set_kv_budget(self, budget_bytes: int) -> None:
        """Cap the KV pool; where CUDA graphs run, the pool is allocated to the budget now, so that it
        never moves under the graphs (a pool that grows is a new tensor: every graph recaptured)."""
        self.kv_pages.set_budget(budget_bytes)
        if self.runner.graphs_enabled and budget_bytes:
            self.kv_pages.preallocate()
            self.runner.change_pool(self.kv_pages.take_changes())

    def kv_memory(self) -> KVMemory:
        """The pool's memory (plain counter reads: safe from another thread while a step runs)."""
        pages = self.kv_pages
        return KVMemory(pages.budget_bytes, self.runner.kv_pool.capacity_bytes, pages.held_bytes, pages.held_tokens,
                        pages.bytes_per_token, pages.page_size, pages.num_cached)

    def trim_kv(self) -> int:
        """Give the pool's memory back when no request holds pages; the bytes freed. Never where CUDA
        graphs run: they read the pool where it is (trimming it would recapture every graph)."""
        if self.runner.graphs_enabled or not self.kv_pages.trim():
            return 0
        before = self.runner.kv_pool.capacity_bytes
        self.runner.change_pool(self.kv_pages.take_changes())
        return before - self.runner.kv_pool.capacity_bytes

    def kv_overflow(self, batch: list[tuple[RequestState, float]]) -> list[str]:
        """Requests of ``batch`` whose next step would take KV pages beyond the budget, taken in batch
        order (the first ones fit); empty with no budget."""
        pages = self.kv_pages
        left = pages.budget_pages_left
        if left is None:
            return []
        over = []
        for state, _ in batch:
            need = kv_reservation(state, self.next_step_kind(state))
            if need is None:
                continue
            needed = pages.pages_needed([need])
            if needed > left:
                over.append(state.request_id)
            else:
                left -= needed
        return over

    def next_step_kind(self, state: RequestState) -> StepKind:
        if state.cache_mode is CacheMode.NONE:
            return StepKind.RECOMPUTE
        fresh = self.kv_pages.cached_block(state.request_id) == state.current_block(self.mask_id)
        return StepKind.CACHE if fresh else StepKind.RECOMPUTE

    # --- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, batch: list[tuple[RequestState, float]]) -> list[StepResult]:
        """Advance every (state, threshold) by one step, in one forward; states are updated in place."""
        plans = [self._plan(state, tau) for state, tau in batch]
        pages = self.kv_pages
        copied = pages.bytes_copied
        # every KV reservation the batch makes, before anything changes (KVBudgetExceeded: none does)
        pages.make_room([need for plan in plans if (need := kv_reservation(plan.state, plan.kind)) is not None])
        keys = KeyLayout.FRESH if all(plan.kind is StepKind.RECOMPUTE for plan in plans) else KeyLayout.POOL
        transient = place(plans, keys, pages)
        try:
            dual_cache = all(p.kind is StepKind.CACHE and p.state.cache_mode is CacheMode.DUAL for p in plans)
            forward = pack_batch(plans, keys, self.rule, self.mask_id, dual_cache, pages.take_changes())
            output = self.runner.forward(forward)
        finally:
            for request_id in transient:
                pages.release_transient(request_id)
        self.last_step_traffic = step_traffic(plans, pages.bytes_copied - copied, pages.bytes_per_token)
        results: list[StepResult | None] = [None] * len(plans)
        row, ahead = 0, forward.num_block_rows  # each plan's first block row, and lookahead row
        for i in forward.order:  # the batch's order: its rows lie in it
            plan = plans[i]
            if plan.caching:
                pages.note_cached(plan.state.request_id, plan.block)
            n = plan.block_size
            if plan.kind is StepKind.RECOMPUTE and self._predicts_end(plan.state):
                # where the request expects its EOS: its block rows and the lookahead rows after them
                self._predict_end(plan, output.tokens[row : row + n] + output.tokens[ahead : ahead + plan.num_lookahead])
                ahead += plan.num_lookahead
            results[i] = self._commit(plan, output, row)
            row += n
        return results

    def _predicts_end(self, state: RequestState) -> bool:
        """Whether full forwards of ``state`` tell where its answer ends (``predicted_end``)."""
        return self.predict_end and state.stops_at_eos(self.stop_at_eos)

    def _plan(self, state: RequestState, threshold: float) -> RequestPlan:
        """What ``state``'s next step runs (no side effects: a bad request is refused before anything changes)."""
        if state.finished:
            raise EngineError(f"request {state.request_id} is already finished")
        if not 0.0 <= threshold <= 1.0:
            raise EngineError(f"threshold {threshold} is outside [0, 1]")
        self._check_options(state)
        return plan_request(state, threshold, self.next_step_kind(state), state.current_block(self.mask_id),
                            self.rule, self.shift, self._predicts_end(state))

    def _predict_end(self, item: RequestPlan, tokens: list[int]) -> None:
        """``predicted_end``: the first still-masked position of the block or after it whose candidate
        is EOS (the mask token excluded), else the canvas end."""
        start, canvas = item.state.block_bounds(item.block)[0], item.state.canvas
        item.state.predicted_end = next((start + i for i, t in enumerate(tokens)
                                         if t == self.eos_id and canvas[start + i] == self.mask_id),
                                        item.state.gen_length)

    def _commit(self, item: RequestPlan, output: StepOutput, row: int) -> StepResult:
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
        if eos_at and self._predicts_end(state):  # the answer ends there or before
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
        self.runner.close()

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
