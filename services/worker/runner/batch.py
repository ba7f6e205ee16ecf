"""One step as the runner takes it (:class:`ForwardBatch`, as SGLang's ``ForwardBatch`` and vLLM's
``SchedulerOutput``) and what it gives back (:class:`StepOutput`): the one seam from engine to runner.

The engine plans each request's part of the step (``services/worker/engine/planner.py``, a
:class:`PlannedRows` each) and :func:`pack_batch` turns them into host arrays, built once: token ids,
positions, where every fresh key goes in the KV pool and where each request's keys are, which rows need
logits, which block positions the rule may commit and each request's threshold. Requests whose keys are
read from the pool are packed in pool order (the torch_varlen kernel reads keys at increasing offsets);
``ForwardBatch.order`` says where each planned request went.

Every index array the step's forward and commit rule read is packed here, in one place
(:func:`step_arrays`), into one int64 buffer: the runner copies it to the device in **one** transfer,
eagerly or into a CUDA graph's static buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from services.worker.attention.layout import KeyLayout, StepLayout
from services.worker.decoding.rule import DecodingRule, commit_eligible
from services.worker.decoding.sampling import SamplingParams
from services.worker.kv.pages import PoolChange

Arrays = dict[str, np.ndarray]  # name -> int64 host array, in the order the step's copy carries them


@dataclass(frozen=True)
class SampledRows:
    """Block rows ``[start, end)`` of a request that draws its tokens (temperature > 0)."""

    start: int
    end: int
    params: SamplingParams
    seed: int


@dataclass(frozen=True)
class TopRows:
    """Block rows ``[start, end)`` of a request that wants its ``k`` likeliest tokens (logprobs)."""

    start: int
    end: int
    k: int


@dataclass
class ForwardBatch:
    """One step's forward, host side (packed by :func:`pack_batch`, run by the model runner)."""

    ids: np.ndarray  # [T] fresh token ids, every request's one after another
    positions: np.ndarray  # [T] their absolute positions
    layout: StepLayout  # each request's rows and where its keys are
    logit_rows: np.ndarray  # [R] rows that get logits: every request's block rows, then lookahead rows
    num_block_rows: int  # the first Rb of them are block rows (the commit rule's)
    eligible: np.ndarray  # [Rb] the rule may commit the position (still masked; Dream's first-forward rule)
    thresholds: np.ndarray  # [Rb] float64, each row's request's threshold
    block_rows: np.ndarray  # [B, L] each request's block rows in position order (Rb: none)
    max_position: int
    write_slots: np.ndarray | None = None  # [W] slots the fresh keys/values go to (None: none stored)
    write_rows: np.ndarray | None = None  # [W] which rows (None: every row, in order)
    sampled: list[SampledRows] = field(default_factory=list)
    top: list[TopRows] = field(default_factory=list)
    rule: DecodingRule = DecodingRule.LLADA  # the model family's (whether a tie with the threshold passes)
    dual_cache: bool = False  # every request is a dual-cache step: its window, every key from its extent
    order: tuple[int, ...] = ()  # batch position -> index of the request in the plans packed
    pool_changes: tuple[PoolChange, ...] = ()  # what the KV pool does first (grow, compaction)

    @property
    def num_requests(self) -> int:
        return self.layout.num_requests


@dataclass
class StepOutput:
    """What the step brings back (host lists)."""

    confidence: list[float]  # [Rb] the candidate's probability at each block row
    tokens: list[int]  # [R] the candidate at each logit row (block rows, then lookahead rows)
    commit: list[bool]  # [Rb]
    top: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)  # block row -> its candidates


class PlannedRows(Protocol):
    """What :func:`pack_batch` reads of one request's planned step (``RequestPlan`` in
    ``services/worker/engine/planner.py``)."""

    fresh_ids: list[int]  # the tokens the forward runs
    fresh_start: int  # absolute position of the first
    # index into fresh_ids of the output that predicts the block's first position (negative: none does)
    logit_start: int
    block_size: int
    num_lookahead: int  # outputs after the block that also get logits
    num_stored: int  # a full forward storing keys: positions 0..num_stored-1 go to its extent
    first_slot: int  # its extent's first slot in the pool (where it has one)
    threshold: float

    @property
    def sequence_length(self) -> int: ...

    @property
    def block_tokens(self) -> list[int]: ...

    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def noise_seed(self) -> int: ...

    @property
    def num_top_logprobs(self) -> int: ...


def pack_batch(plans: Sequence[PlannedRows], keys: KeyLayout, rule: DecodingRule, mask_id: int,
               dual_cache: bool = False, pool_changes: tuple[PoolChange, ...] = ()) -> ForwardBatch:
    """The step of ``plans`` as one packed forward (``keys``: where every request's keys are read)."""
    order = tuple(sorted(range(len(plans)), key=lambda i: plans[i].first_slot)) if keys is KeyLayout.POOL \
        else tuple(range(len(plans)))
    items = [plans[i] for i in order]
    q_lengths = [len(it.fresh_ids) for it in items]
    q_starts = np.concatenate(([0], np.cumsum(q_lengths)[:-1])).astype(np.int64)
    total = int(sum(q_lengths))
    ids = np.fromiter((t for it in items for t in it.fresh_ids), dtype=np.int64, count=total)
    first = np.repeat(np.array([it.fresh_start for it in items], dtype=np.int64) - q_starts, q_lengths)
    positions = np.arange(total, dtype=np.int64) + first
    layout, write_slots, write_rows = _keys_and_writes(items, keys, q_lengths, q_starts, positions)
    block_sizes = [it.block_size for it in items]
    block_logit_rows = np.concatenate([np.maximum(np.arange(q + it.logit_start, q + it.logit_start + n), q)
                                       for it, q, n in zip(items, q_starts, block_sizes, strict=True)])
    lookahead = [np.arange(q + it.logit_start + n, q + it.logit_start + n + it.num_lookahead)
                 for it, q, n in zip(items, q_starts, block_sizes, strict=True) if it.num_lookahead]
    eligible, thresholds, block_rows, sampled, top = _commit_inputs(items, block_sizes, rule, mask_id)
    return ForwardBatch(
        ids=ids, positions=positions, layout=layout,
        logit_rows=np.concatenate([block_logit_rows, *lookahead]), num_block_rows=int(sum(block_sizes)),
        eligible=eligible, thresholds=thresholds, block_rows=block_rows,
        max_position=int(max(it.fresh_start + len(it.fresh_ids) for it in items)) - 1,
        write_slots=write_slots, write_rows=write_rows, sampled=sampled, top=top, rule=rule,
        dual_cache=dual_cache, order=order, pool_changes=pool_changes,
    )


def _keys_and_writes(items: list[PlannedRows], keys: KeyLayout, q_lengths: list[int], q_starts: np.ndarray,
                     positions: np.ndarray):
    """Where each request's keys are (the layout) and which fresh rows go to which slots (None: every
    row, or no slots: nothing stored)."""
    if keys is KeyLayout.POOL:  # every row to its position's slot; keys read from each extent
        firsts = [it.first_slot for it in items]
        layout = StepLayout(tuple(q_lengths), keys, tuple(firsts), tuple(it.sequence_length for it in items))
        return layout, positions + np.repeat(firsts, q_lengths), None
    stored = [(int(q), it.first_slot, it.num_stored) for it, q in zip(items, q_starts, strict=True) if it.num_stored]
    if not stored:
        return StepLayout(tuple(q_lengths), keys), None, None
    rows = np.concatenate([np.arange(q, q + n) for q, _, n in stored])
    slots = np.concatenate([np.arange(s, s + n) for _, s, n in stored])
    return StepLayout(tuple(q_lengths), keys), slots, None if len(rows) == sum(q_lengths) else rows


def _commit_inputs(items: list[PlannedRows], block_sizes: list[int], rule: DecodingRule, mask_id: int):
    """What the commit rule reads: which block rows it may commit (``commit_eligible``), each row's
    threshold, each request's rows (``block_rows``), and the requests that draw or want their top
    candidates."""
    num_rows = int(sum(block_sizes))
    row_starts = np.concatenate(([0], np.cumsum(block_sizes)[:-1])).tolist()
    masked = np.fromiter((t == mask_id for it in items for t in it.block_tokens), dtype=bool, count=num_rows)
    eligible = commit_eligible(rule, masked, row_starts, block_sizes)
    thresholds = np.repeat(np.array([it.threshold for it in items], dtype=np.float64), block_sizes)
    block_rows = np.full((len(items), max(block_sizes)), num_rows, dtype=np.int64)
    sampled, top = [], []
    for i, (it, start, n) in enumerate(zip(items, row_starts, block_sizes, strict=True)):
        block_rows[i, :n] = np.arange(start, start + n)
        if not it.sampling.greedy:
            sampled.append(SampledRows(start, start + n, it.sampling, it.noise_seed))
        if it.num_top_logprobs:
            top.append(TopRows(start, start + n, it.num_top_logprobs))
    return eligible, thresholds, block_rows, sampled, top


# --- the step's one host-to-device copy ---------------------------------------------------------


def step_arrays(forward: ForwardBatch, attention_arrays: Arrays, commit: ForwardBatch | None = None) -> Arrays:
    """Every array the step's one copy carries, in its order: the forward's inputs (ids, positions, logit
    rows, where fresh keys go) of ``forward``, the attention's metadata (named ``attn.*``), then what the
    commit rule reads of ``commit`` (thresholds as the bits of their float64). A CUDA graph's copy holds
    its padded batch's forward inputs in its static buffers and the unpadded batch's commit inputs after
    them."""
    arrays = {"ids": forward.ids, "positions": forward.positions, "logit_rows": forward.logit_rows}
    if forward.write_slots is not None:
        arrays["write_slots"] = forward.write_slots
        if forward.write_rows is not None:
            arrays["write_rows"] = forward.write_rows
    arrays |= {f"attn.{name}": a for name, a in attention_arrays.items()}
    if commit is not None:
        arrays |= {"eligible": commit.eligible.astype(np.int64),
                   "thresholds": commit.thresholds.astype(np.float64).view(np.int64), "block_rows": commit.block_rows}
        if commit.top:
            arrays["top_rows"] = np.concatenate([np.arange(t.start, t.end) for t in commit.top])
    return arrays


def attention_views(views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The attention's own arrays among the step's device views (their ``attn.`` names stripped)."""
    return {name[5:]: view for name, view in views.items() if name.startswith("attn.")}


def pack(arrays: Arrays) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays.values()]) if arrays else \
        np.zeros(0, dtype=np.int64)


def unpack(flat: torch.Tensor, arrays: Arrays) -> dict[str, torch.Tensor]:
    """Views of ``flat`` shaped as ``arrays`` (the order ``pack`` used)."""
    out, offset = {}, 0
    for name, a in arrays.items():
        n = int(np.asarray(a).size)
        out[name] = flat[offset : offset + n].view(np.asarray(a).shape)
        offset += n
    return out
