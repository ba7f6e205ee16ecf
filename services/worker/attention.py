"""Attention over packed batches: requests' tokens concatenated into one sequence, no padding.

A packed forward carries ``T`` tokens, request ``i`` owning rows ``[starts[i], starts[i] + lengths[i])``.
Two kinds of attention serve the engine's two step kinds:

* :class:`FreshAttention` (full-sequence steps): each request attends to its own fresh tokens; with
  a cache it also stores their keys and values (all or the first ``n``) in the KV pool.
* :class:`CachedAttention` (cache steps): each request's fresh keys and values overwrite their slots
  of its cache in place, then its queries attend to its whole cache where it lies (the stale prefix
  and suffix and the fresh window): nothing is gathered.

Backends (all compute the same thing; only the kernel differs):

* ``flash``: flash-attn's ``flash_attn_varlen_func``; cache steps read the pool through a block table
  (pages of 256 slots, as its paged kernel requires).
* ``torch_varlen``: PyTorch's own FlashAttention-2 varlen op (``torch.nn.attention.varlen``), for a
  CUDA machine without flash-attn; cache steps read each request's extent of the flat pool at its
  offset (``cu_seq_k`` its first slot, ``seqused_k`` its length), which needs the cache step's
  requests in pool order (the engine sorts them).
* ``sdpa``: ``scaled_dot_product_attention`` per request on views of the packed tensors and of the
  pool (one call when every request has the same lengths); CPUs, float32/float64, anything else.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cache, cached_property

import torch
import torch.nn.functional as F

from services.worker.kv_cache import Extent, PagedKVCache

FLASH_PAGE_SIZE = 256  # flash-attn 2's paged kernel needs pages of a multiple of 256 slots


class AttentionBackend(StrEnum):
    FLASH = "flash"  # flash-attn's varlen kernel (CUDA, fp16/bf16)
    TORCH_VARLEN = "torch_varlen"  # PyTorch's FlashAttention-2 varlen op (CUDA, fp16/bf16)
    SDPA = "sdpa"  # torch's scaled_dot_product_attention, one call per request


@cache
def flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def torch_varlen_attn() -> Callable | None:
    """PyTorch's ``varlen_attn`` when this torch has one that takes ``seqused_k`` and ``enable_gqa``."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if {"seqused_k", "enable_gqa"} <= inspect.signature(varlen_attn).parameters.keys() else None


def _fa2_kernel_runs(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and torch.cuda.get_device_capability(device)[0] >= 8)


def backend_runs(backend: AttentionBackend, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    if backend is AttentionBackend.SDPA:
        return True
    installed = flash_attn_importable() if backend is AttentionBackend.FLASH else torch_varlen_attn() is not None
    return installed and _fa2_kernel_runs(device, dtype, head_dim)


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionBackend:
    """``auto``: flash-attn where it runs (CUDA, fp16/bf16, installed), else PyTorch's varlen op, else SDPA."""
    if requested == "auto":
        order = (AttentionBackend.FLASH, AttentionBackend.TORCH_VARLEN, AttentionBackend.SDPA)
        return next(b for b in order if backend_runs(b, device, dtype, head_dim))
    backend = AttentionBackend(requested)
    if not backend_runs(backend, device, dtype, head_dim):
        raise ValueError(f"attention {backend.value} cannot run here (device {device}, dtype {dtype}, "
                         f"head_dim {head_dim}, flash-attn installed: {flash_attn_importable()}, "
                         f"torch varlen op: {torch_varlen_attn() is not None})")
    return backend


@dataclass(frozen=True)
class Segments:
    """Consecutive rows of a packed tensor, one run per request."""

    lengths: tuple[int, ...]

    @cached_property
    def starts(self) -> tuple[int, ...]:
        out, total = [], 0
        for n in self.lengths:
            out.append(total)
            total += n
        return tuple(out)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def uniform(self) -> bool:
        return len(set(self.lengths)) == 1

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """``[0, n0, n0 + n1, ...]`` as flash-attn wants it (int32)."""
        return torch.tensor((*self.starts, self.total), dtype=torch.int32, device=device)


@dataclass
class CacheWrite:
    """Fresh rows to store in the pool: packed ``rows`` (None: all of them) go to ``slots``."""

    cache: PagedKVCache
    slots: torch.Tensor  # [N] slot indices, on the pool's device
    rows: torch.Tensor | None = None  # [N] packed row indices, on the model's device; None: every row

    def apply(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.rows is not None:
            k, v = k.index_select(0, self.rows), v.index_select(0, self.rows)
        self.cache.write(layer, k, v, self.slots)


class FreshAttention:
    """Each request attends to its own fresh tokens (full-sequence steps); optionally stores them."""

    def __init__(self, backend: AttentionBackend, segments: Segments, device: torch.device,
                 store: CacheWrite | None = None) -> None:
        self.backend, self.segments, self.store = backend, segments, store
        if backend is not AttentionBackend.SDPA:
            self._cu_seqlens = segments.cu_seqlens(device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` [T, H, D], ``k``/``v`` [T, H_kv, D] with RoPE applied; the attention output [T, H, D]."""
        if self.store is not None:
            self.store.apply(layer, k, v)
        longest = max(self.segments.lengths)
        if self.backend is AttentionBackend.FLASH:
            from flash_attn import flash_attn_varlen_func

            return flash_attn_varlen_func(q, k, v, self._cu_seqlens, self._cu_seqlens, longest, longest, causal=False)
        if self.backend is AttentionBackend.TORCH_VARLEN:
            return torch_varlen_attn()(q, k, v, self._cu_seqlens, self._cu_seqlens, longest, longest,
                                       enable_gqa=k.shape[1] != q.shape[1])
        if self.segments.uniform:
            return _sdpa_uniform(q, k, v, len(self.segments.lengths))
        ranges = list(zip(self.segments.starts, self.segments.lengths, strict=True))
        return _sdpa_per_request(q, k, v, ranges, ranges)


class CachedAttention:
    """Cache steps: fresh keys/values overwrite their slots, then queries read the request's cache in place."""

    def __init__(self, backend: AttentionBackend, segments: Segments, cache: PagedKVCache,
                 extents: Sequence[Extent], write: CacheWrite) -> None:
        self.backend, self.segments, self.cache, self.write = backend, segments, cache, write
        self.extents = list(extents)
        device = cache.pool.device
        if backend is AttentionBackend.FLASH:
            self._cu_q = segments.cu_seqlens(device)
            self._cu_k = Segments(tuple(e.num_tokens for e in extents)).cu_seqlens(device)
            self._block_table = _block_table(self.extents, device)
        elif backend is AttentionBackend.TORCH_VARLEN:
            self._cu_q = segments.cu_seqlens(device)
            self._cu_k, self._seqused_k = _slot_offsets(self.extents, cache.page_size, device)
        else:
            self._query_ranges = list(zip(segments.starts, segments.lengths, strict=True))
            self._key_ranges = [(e.first_slot(cache.page_size), e.num_tokens) for e in self.extents]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.write.apply(layer, k, v)
        longest_q, longest_k = max(self.segments.lengths), max(e.num_tokens for e in self.extents)
        if self.backend is AttentionBackend.FLASH:
            from flash_attn import flash_attn_varlen_func

            keys, values = self.cache.layer_pages(layer)
            return flash_attn_varlen_func(q, keys, values, self._cu_q, self._cu_k, longest_q, longest_k,
                                          causal=False, block_table=self._block_table)
        keys, values = self.cache.layer_slots(layer)
        if self.backend is AttentionBackend.TORCH_VARLEN:
            return torch_varlen_attn()(q, keys, values, self._cu_q, self._cu_k, longest_q, longest_k,
                                       enable_gqa=keys.shape[1] != q.shape[1], seqused_k=self._seqused_k)
        return _sdpa_per_request(q, keys, values, self._query_ranges, self._key_ranges)


def _block_table(extents: Sequence[Extent], device: torch.device) -> torch.Tensor:
    """One row of page ids per request (its consecutive pages, then zeros that are never read)."""
    table = torch.zeros((len(extents), max(e.num_pages for e in extents)), dtype=torch.int32)
    for row, e in enumerate(extents):
        table[row, : e.num_pages] = torch.arange(e.first_page, e.first_page + e.num_pages, dtype=torch.int32)
    return table.to(device)


def _slot_offsets(extents: Sequence[Extent], page_size: int, device: torch.device):
    """``cu_seq_k`` and ``seqused_k`` that read request i's ``num_tokens`` slots from its first slot.

    ``cu_seq_k`` must increase, so the extents must come in pool order; the span from one extent's
    first slot to the next may hold other requests' slots, which ``seqused_k`` leaves unread.
    """
    firsts = [e.first_slot(page_size) for e in extents]
    if firsts != sorted(firsts):
        raise ValueError("torch_varlen cache steps need their requests in pool order")
    offsets = torch.tensor([*firsts, firsts[-1] + extents[-1].num_tokens], dtype=torch.int32, device=device)
    used = torch.tensor([e.num_tokens for e in extents], dtype=torch.int32, device=device)
    return offsets, used


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA over ``[B, n, H, D]`` layouts (views; heads moved to dim 1 without copying)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


def _sdpa_uniform(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int) -> torch.Tensor:
    """Every request has the same length: one call over ``[B, n, H, D]`` views of the packed rows."""
    def split(x):
        return x.view(batch, -1, *x.shape[1:])

    return _sdpa(split(q), split(k), split(v)).reshape(q.shape)


def _sdpa_per_request(q, k, v, query_ranges, key_ranges) -> torch.Tensor:
    """One call per request: its query rows against its key rows (both views)."""
    out = q.new_empty(q.shape)
    for (q_start, q_len), (k_start, k_len) in zip(query_ranges, key_ranges, strict=True):
        keys, values = k[k_start : k_start + k_len], v[k_start : k_start + k_len]
        out[q_start : q_start + q_len] = _sdpa(q[None, q_start : q_start + q_len], keys[None], values[None])[0]
    return out
