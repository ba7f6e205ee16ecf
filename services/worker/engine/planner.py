"""Planning one step: what each request's forward runs (:class:`RequestPlan`), which KV pages it takes
and where its keys lie (``place``), and what the step's KV traffic is.

A request's next step is a recompute step (a full forward: the block's first step, a request without
this engine's cache of it, or every step without cache) or a cache step (its window: the block, plus
the rest of the canvas for a prefix cache, against its cached keys). A recompute step with a cache
stores what the block's cache steps read (every position for ``dual``, those before the window for
``prefix``). Which output predicts which position is the model family's (``services/worker/decoding/rule.py``).

Planning has no side effects: a batch with a bad request is refused before anything changes. Placing
reserves the pages the step writes in the page table (``services/worker/kv/pages.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.attention.layout import KeyLayout
from services.worker.decoding.rule import DecodingRule, cache_window_start
from services.worker.decoding.sampling import SamplingParams, noise_seed
from services.worker.engine.request import RequestState
from services.worker.kv.pages import KVPages, KVTraffic
from shared.messages.base import CacheMode, StepKind


@dataclass
class RequestPlan:
    """One request's part of a packed forward (what ``pack_batch`` reads: ``runner/batch.py``'s
    ``PlannedRows``)."""

    state: RequestState
    threshold: float
    kind: StepKind
    block: int
    fresh_start: int  # absolute position of the first fresh (input) token
    fresh_ids: list[int]
    # index into fresh_ids of the output that predicts the block's first position (negative: none does, the
    # position is committed already: Dream's rule at a cache step)
    logit_start: int
    block_size: int
    # recompute steps with a cache: positions 0..num_stored-1 are stored (what this block's cache
    # steps read without recomputing: all for dual, those before the window for prefix)
    num_stored: int = 0
    # full forwards of a request that stops at EOS: the outputs of the canvas positions after the block
    # also go through the LM head, to see where the model expects the EOS (``predicted_end``)
    num_lookahead: int = 0
    first_slot: int = 0  # its extent's first slot in the pool, once placed (a step reading or storing keys)

    @property
    def block_tokens(self) -> list[int]:
        start = self.block * self.state.block_length
        return self.state.canvas[start : start + self.block_size]

    @property
    def sequence_length(self) -> int:
        return self.state.sequence_length

    @property
    def sampling(self) -> SamplingParams:
        return self.state.sampling

    @property
    def noise_seed(self) -> int:
        """The seed of this step's draws (``services/worker/decoding/sampling.py``)."""
        state = self.state
        return noise_seed(state.sampling.seed, state.request_id, state.num_steps)

    @property
    def num_top_logprobs(self) -> int:
        return self.state.num_top_logprobs

    @property
    def caching(self) -> bool:
        """A recompute step that stores the request's cache."""
        return self.kind is StepKind.RECOMPUTE and self.state.cache_mode is not CacheMode.NONE


def plan_request(state: RequestState, threshold: float, kind: StepKind, block: int, rule: DecodingRule,
                 logits_shift: int, lookahead: bool) -> RequestPlan:
    """What the step of ``state`` at ``block`` runs (``lookahead``: a full forward also reads the canvas
    after the block, to tell where the answer ends)."""
    sequence = state.prompt_ids + state.canvas
    prompt_len = len(state.prompt_ids)
    start, end = state.block_bounds(block)
    predicting = prompt_len + start - logits_shift  # the output predicting the block's first position
    window_start = cache_window_start(rule, prompt_len + start, logits_shift)  # a cache step's first row
    if kind is StepKind.RECOMPUTE:
        stored = {CacheMode.NONE: 0, CacheMode.PREFIX: window_start, CacheMode.DUAL: len(sequence)}
        ahead = state.gen_length - end if lookahead else 0
        return RequestPlan(state, threshold, kind, block, 0, sequence, predicting, end - start,
                           stored[state.cache_mode], ahead)
    window_end = prompt_len + (end if state.cache_mode is CacheMode.DUAL else state.gen_length)
    # Dream's rule starts the window at the block: its first position (committed at the block's first
    # forward) has no output in the window (logit_start < 0: never read)
    return RequestPlan(state, threshold, kind, block, window_start, sequence[window_start:window_end],
                       predicting - window_start, end - start)


def kv_reservation(state: RequestState, kind: StepKind) -> tuple[str, int] | None:
    """(request id, positions) a step of ``kind`` reserves KV for; None: it reserves none."""
    if state.finished or state.cache_mode is CacheMode.NONE or kind is not StepKind.RECOMPUTE:
        return None
    return state.request_id, state.sequence_length


def place(plans: list[RequestPlan], keys: KeyLayout, pages: KVPages) -> list[str]:
    """Reserve the KV extents the step writes (recompute steps with a cache; with keys read from the
    pool, a transient extent per no-cache request too) and note where each plan's keys lie; the request
    ids whose transient extents the step holds."""
    for plan in plans:  # all first: a reservation may compact the pool, moving the others' pages
        if plan.caching:
            pages.reserve(plan.state.request_id, plan.sequence_length)
    transient = []
    if keys is KeyLayout.POOL:
        for plan in plans:
            if plan.state.cache_mode is CacheMode.NONE:
                pages.reserve_transient(plan.state.request_id, plan.sequence_length)
                transient.append(plan.state.request_id)
            if plan.kind is StepKind.RECOMPUTE:
                plan.num_stored = plan.sequence_length  # its own attention reads them from the pool
    for plan in plans:  # where the extents lie once every reservation is made
        rid = plan.state.request_id
        if plan.state.cache_mode is CacheMode.NONE:
            plan.first_slot = pages.transient_extent(rid).first_slot(pages.page_size) if keys is KeyLayout.POOL else 0
        else:
            plan.first_slot = pages.extent(rid).first_slot(pages.page_size)
    return transient


def step_traffic(plans: list[RequestPlan], copied: int, bytes_per_token: int) -> dict[StepKind, KVTraffic]:
    """Per step kind, the cache bytes its requests stored and the bytes the pool copied (growing or
    compacting, which only recompute steps' reservations do)."""
    traffic = {}
    any_recompute = any(plan.kind is StepKind.RECOMPUTE for plan in plans)
    for kind in (StepKind.RECOMPUTE, StepKind.CACHE):
        group = [plan for plan in plans if plan.kind is kind]
        if not group:
            continue
        stored = sum(plan.num_stored if kind is StepKind.RECOMPUTE else len(plan.fresh_ids)
                     for plan in group if plan.state.cache_mode is not CacheMode.NONE)
        moved = copied if kind is StepKind.RECOMPUTE or not any_recompute else 0
        traffic[kind] = KVTraffic(moved, stored * bytes_per_token)
    return traffic
