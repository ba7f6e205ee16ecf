"""Attention over a packed step: one kernel call per layer for the whole batch, on every backend.

A step's forward carries ``T`` fresh rows (every request's fresh tokens one after another, no padding);
request ``i`` owns rows ``[q_start_i, q_start_i + q_len_i)``. Where its keys are is the step's
:class:`KeyLayout`:

* ``FRESH``: every request runs a full forward (recompute or no cache), so its keys are its own
  fresh rows (they are also stored in the KV pool where the request keeps a cache).
* ``POOL``: keys are read where they lie in the KV pool: request ``i``'s keys are the slots
  ``[k_start_i, k_start_i + k_len_i)`` (slot ``p`` of a request holds position ``p``). Every fresh
  row is first written to its slot, so a recompute request (whose fresh rows are its whole sequence),
  a cache request (whose fresh rows are its window, the rest of the cache stale) and a no-cache
  request (given a transient extent for the step) all read their keys the same way, in one call.

:class:`StepAttention` holds what every layer needs, built once per step from a few index arrays that
the model runner copies to the device together (``host_arrays`` then ``bind``); calling it with a
layer's ``q``/``k``/``v`` stores the fresh keys and values and returns the attention output.

Backends (all compute the same thing; only the kernel and its metadata differ):

* ``flash``: flash-attn's ``flash_attn_varlen_func``; pool keys through a block table (pages of 256
  slots, as its paged kernel requires).
* ``torch_varlen``: PyTorch's FlashAttention-2 varlen op (``torch.nn.attention.varlen``). Where it
  takes ``seqused_k`` (torch 2.13), request ``i``'s keys start at ``cu_seq_k[i]`` and ``seqused_k[i]``
  are read; where it does not (torch 2.11), keys between two requests' extents become a sequence of
  their own with no queries ("gap" sequences), so ``cu_seq_k`` still delimits each request's keys
  exactly. Both need the step's requests in pool order (the engine sorts them).
* ``flex``: ``flex_attention`` (compiled on CUDA) with a block mask over the pool: a query row of
  request ``i`` sees the slots of ``i``'s extent only.
* ``sdpa``: ``scaled_dot_product_attention`` once over a padded batch. Query rows are cut into chunks
  of a common length (a request's rows fill one or more chunks), each chunk's keys gathered into a
  padded buffer with a key mask; when every request has the same length and keys are fresh (or the
  step has one request), one call over views of the packed tensors, nothing gathered. The CPU path
  and the fallback anywhere.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from itertools import pairwise

import numpy as np
import torch
import torch.nn.functional as F

from services.worker.kv.cache import PagedKVCache

logger = logging.getLogger(__name__)

FLASH_PAGE_SIZE = 256  # flash-attn 2's paged kernel needs pages of a multiple of 256 slots


class AttentionBackend(StrEnum):
    FLASH = "flash"  # flash-attn's varlen kernel (CUDA, fp16/bf16)
    TORCH_VARLEN = "torch_varlen"  # PyTorch's FlashAttention-2 varlen op (CUDA, fp16/bf16)
    FLEX = "flex"  # flex_attention with a block mask over the pool (compiled on CUDA; eager elsewhere)
    SDPA = "sdpa"  # one scaled_dot_product_attention call over a padded batch


class KeyLayout(StrEnum):
    FRESH = "fresh"  # every request's keys are its own fresh rows (full forwards only)
    POOL = "pool"  # every request's keys are its extent of the KV pool


@cache
def flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def torch_varlen_attn() -> Callable | None:
    """PyTorch's ``varlen_attn`` where this torch has one (any signature: see ``varlen_features``)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@cache
def varlen_features() -> frozenset[str]:
    """Which of ``seqused_k`` and ``enable_gqa`` this torch's ``varlen_attn`` takes (2.11: neither)."""
    fn = torch_varlen_attn()
    if fn is None:
        return frozenset()
    return frozenset(inspect.signature(fn).parameters) & {"seqused_k", "enable_gqa"}


@cache
def flex_attention_fn(compiled: bool) -> Callable | None:
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=True) if compiled else flex_attention


def _fa2_kernel_runs(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and torch.cuda.get_device_capability(device)[0] >= 8)


def backend_runs(backend: AttentionBackend, device: torch.device, dtype: torch.dtype, head_dim: int,
                 gqa: bool = False) -> bool:
    if backend is AttentionBackend.SDPA:
        return True
    if backend is AttentionBackend.FLEX:
        return flex_attention_fn(False) is not None
    if backend is AttentionBackend.FLASH:
        return flash_attn_importable() and _fa2_kernel_runs(device, dtype, head_dim)
    # torch's op without enable_gqa runs only where query and key heads are as many
    return (torch_varlen_attn() is not None and (not gqa or "enable_gqa" in varlen_features())
            and _fa2_kernel_runs(device, dtype, head_dim))


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                    gqa: bool = False) -> AttentionBackend:
    """``auto``: flash-attn where it runs (CUDA, fp16/bf16, installed), else PyTorch's varlen op, else
    flex_attention on CUDA, else SDPA; on CUDA each kernel must also pass ``kernel_self_test`` (a
    torch whose op lacks what the engine calls, or routes it to a backend that refuses it, falls
    through to the next instead of failing the first step)."""
    if requested == "auto":
        order = [AttentionBackend.FLASH, AttentionBackend.TORCH_VARLEN]
        if device.type == "cuda":
            order.append(AttentionBackend.FLEX)
        order.append(AttentionBackend.SDPA)
        return next(b for b in order if backend_runs(b, device, dtype, head_dim, gqa)
                    and (device.type != "cuda" or kernel_self_test(b, device, dtype, head_dim, gqa)))
    backend = AttentionBackend(requested)
    if not backend_runs(backend, device, dtype, head_dim, gqa):
        raise ValueError(f"attention {backend.value} cannot run here (device {device}, dtype {dtype}, "
                         f"head_dim {head_dim}, grouped-query {gqa}, flash-attn installed: "
                         f"{flash_attn_importable()}, torch varlen op: {torch_varlen_attn() is not None} "
                         f"{sorted(varlen_features())})")
    return backend


@cache
def kernel_self_test(backend: AttentionBackend, device: torch.device, dtype: torch.dtype, head_dim: int,
                     gqa: bool = False) -> bool:
    """Whether ``backend`` computes what SDPA computes here, called as the engine calls it: fresh rows
    of three requests, then keys read in place from a pool with other slots between them. False when
    it raises (logged) or differs beyond the dtype's rounding."""
    heads, kv_heads = 4, 2 if gqa else 4
    lengths = (3, 17, 40)
    generator = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    page = FLASH_PAGE_SIZE if backend is AttentionBackend.FLASH else 16
    cache = PagedKVCache(1, kv_heads, head_dim, dtype, device, page_size=page)
    extents = []
    for i, n in enumerate((50, 30, 60)):
        extents.append(cache.reserve(f"r{i}", n))
        cache.reserve(f"gap{i}", 20)  # other slots between the requests' extents
    cache.pool.copy_(randn(*cache.pool.shape))
    q, k, v = randn(sum(lengths), heads, head_dim), randn(sum(lengths), kv_heads, head_dim), randn(
        sum(lengths), kv_heads, head_dim)
    layouts = [StepLayout(lengths, KeyLayout.FRESH),
               StepLayout(lengths, KeyLayout.POOL, tuple(e.first_slot(page) for e in extents),
                          tuple(e.num_tokens for e in extents))]
    tolerance = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    try:
        for layout in layouts:
            outputs = []
            for kind in (backend, AttentionBackend.SDPA):
                step = StepAttention(kind, layout, cache)
                step.bind({name: torch.from_numpy(a).to(device) for name, a in step.host_arrays().items()}, device)
                outputs.append(step(0, q, k, v).float())
            if not torch.allclose(outputs[0], outputs[1], atol=tolerance, rtol=tolerance):
                logger.warning("attention %s differs from SDPA here (%s): not used", backend.value, layout.keys.value)
                return False
    except Exception as exc:  # noqa: BLE001 (any failure means: do not use this kernel here)
        logger.warning("attention %s fails here (%s: %s): not used", backend.value, type(exc).__name__, exc)
        return False
    return True


# --- the step's layout ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StepLayout:
    """Where each request's rows and keys are in one packed forward (host-side, plain ints)."""

    q_lengths: tuple[int, ...]  # fresh rows per request, in row order
    keys: KeyLayout
    k_starts: tuple[int, ...] = ()  # POOL: each request's first slot
    k_lengths: tuple[int, ...] = ()  # POOL: its number of keys (its sequence length)
    num_pad: int = 0  # leading requests that are padding (a CUDA graph's bucket): no keys, rows ignored

    @property
    def num_requests(self) -> int:
        return len(self.q_lengths)

    @property
    def total(self) -> int:
        return sum(self.q_lengths)

    def q_starts(self) -> list[int]:
        return [0, *np.cumsum(self.q_lengths[:-1]).tolist()] if self.q_lengths else []

    def key_ranges(self) -> list[tuple[int, int]]:
        """(first key row or slot, number of keys) per request, in the tensor the keys are read from."""
        if self.keys is KeyLayout.FRESH:
            return list(zip(self.q_starts(), self.q_lengths, strict=True))
        return list(zip(self.k_starts, self.k_lengths, strict=True))


Arrays = dict[str, np.ndarray]  # name -> int64 host array, copied to the device with the step's others
DeviceArrays = dict[str, torch.Tensor]  # name -> its int64 device view


class StepAttention:
    """One step's attention for every layer: ``self(layer, q, k, v)`` stores the fresh keys and values
    (``store``) and attends. Built from ``host_arrays`` (on the host) and ``bind`` (device views)."""

    def __init__(self, backend: AttentionBackend, layout: StepLayout, cache: PagedKVCache | None,
                 max_keys: int | None = None) -> None:
        """``max_keys``: an upper bound on any request's keys to pass the varlen kernels (a CUDA graph
        bakes it in); default: the step's longest."""
        self.backend, self.layout, self.cache = backend, layout, cache
        self.max_q = max(layout.q_lengths, default=1)
        self.max_k = max_keys or max((n for _, n in layout.key_ranges()), default=1)
        self._static = max_keys is not None
        self.store: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        self._device: DeviceArrays = {}
        self._views: DeviceArrays = {}
        self._bound_device: torch.device | None = None
        num_slots = cache.num_slots if cache is not None else 0
        self._plan = _SdpaPlan.of(layout, num_slots) if backend is AttentionBackend.SDPA else None
        self._block_mask = None

    # --- host side ------------------------------------------------------------------------------

    def host_arrays(self) -> Arrays:
        """The index arrays this backend needs on the device (int64; the runner copies them over)."""
        layout = self.layout
        if self.backend is AttentionBackend.SDPA:
            return self._plan.arrays(layout)
        if self.backend is AttentionBackend.FLEX:
            ranges = np.array(layout.key_ranges(), dtype=np.int64).reshape(-1, 2)
            doc = np.repeat(np.arange(layout.num_requests), layout.q_lengths)
            return {"doc": doc, "k_lo": ranges[:, 0], "k_hi": ranges[:, 0] + ranges[:, 1]}
        cu_q = np.concatenate(([0], np.cumsum(layout.q_lengths))).astype(np.int64)
        if self.backend is AttentionBackend.FLASH:
            return self._flash_arrays(cu_q)
        return self._varlen_arrays(cu_q)

    def _flash_arrays(self, cu_q: np.ndarray) -> Arrays:
        ranges = self.layout.key_ranges()
        cu_k = np.concatenate(([0], np.cumsum([n for _, n in ranges]))).astype(np.int64)
        if self.layout.keys is KeyLayout.FRESH:
            return {"cu_q": cu_q, "cu_k": cu_k}
        page = self.cache.page_size
        width = max(-(-self.max_k // page), 1)
        table = np.zeros((len(ranges), width), dtype=np.int64)
        for row, (start, n) in enumerate(ranges):  # one row of consecutive page ids per request
            first = start // page
            table[row, : -(-n // page)] = np.arange(first, first + -(-n // page))
        return {"cu_q": cu_q, "cu_k": cu_k, "block_table": table}

    def _varlen_arrays(self, cu_q: np.ndarray) -> Arrays:
        ranges = self.layout.key_ranges()
        starts = [s for s, _ in ranges]
        if starts != sorted(starts):
            raise ValueError("torch_varlen steps need their requests in pool order")
        if "seqused_k" in varlen_features() or self.layout.keys is KeyLayout.FRESH:
            last = ranges[-1][0] + ranges[-1][1] if ranges else 0
            cu_k = np.array([*starts, last], dtype=np.int64)
            return {"cu_q": cu_q, "cu_k": cu_k, "used_k": np.array([n for _, n in ranges], dtype=np.int64)}
        # no seqused_k: every stretch of slots between two requests' keys is a sequence with no queries
        q_bounds, k_bounds = [0], [0]
        for (start, n), q_len in zip(ranges, self.layout.q_lengths, strict=True):
            q_bounds += [q_bounds[-1], q_bounds[-1] + q_len]  # the gap's (no queries), then the request's
            k_bounds += [start, start + n]
        cu_k = np.array(k_bounds, dtype=np.int64)
        # a gap may be the longest sequence; a CUDA graph (max_keys given) bakes in a bound for any step
        gaps = self.cache.num_slots if self._static else int(np.diff(cu_k).max(initial=1))
        self.max_k = max(self.max_k, gaps)
        return {"cu_q": np.array(q_bounds, dtype=np.int64), "cu_k": cu_k}

    # --- device side ----------------------------------------------------------------------------

    def bind(self, arrays: DeviceArrays, device: torch.device) -> None:
        """Take the device views of ``host_arrays`` (a CUDA graph's static buffers: their contents change
        from step to step, the views stay) and build what every layer shares."""
        self._views, self._bound_device = arrays, device
        self.refresh()

    def refresh(self) -> None:
        """Derive what every layer shares from the bound views (int32 offsets, masks): once per step,
        inside a captured graph where there is one."""
        arrays, device = self._views, self._bound_device
        self._device = {name: a.to(torch.int32) if name in _INT32 else a for name, a in arrays.items()}
        if self.backend is AttentionBackend.SDPA:
            self._plan.bind(self._device)
        elif self.backend is AttentionBackend.FLEX:
            self._block_mask = self._flex_block_mask(device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` [T, H, D], ``k``/``v`` [T, H_kv, D] with RoPE applied; the attention output [T, H, D]."""
        if self.store is not None:
            self.store(layer, k, v)
        if self.layout.keys is KeyLayout.POOL:
            k, v = self.cache.layer_slots(layer)
        if self.backend is AttentionBackend.SDPA:
            return self._plan.attend(q, k, v)
        if self.backend is AttentionBackend.FLEX:
            return self._flex(q, k, v)
        if self.backend is AttentionBackend.FLASH:
            return self._flash(layer, q, k, v)
        return self._varlen(q, k, v)

    def _varlen(self, q, k, v) -> torch.Tensor:
        arrays, options = self._device, {}
        if "enable_gqa" in varlen_features():
            options["enable_gqa"] = k.shape[1] != q.shape[1]
        if "used_k" in arrays and self.layout.keys is KeyLayout.POOL:
            options["seqused_k"] = arrays["used_k"]
        return torch_varlen_attn()(q, k, v, arrays["cu_q"], arrays["cu_k"], self.max_q, self.max_k, **options)

    def _flash(self, layer: int, q, k, v) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        arrays = self._device
        if self.layout.keys is KeyLayout.FRESH:
            return flash_attn_varlen_func(q, k, v, arrays["cu_q"], arrays["cu_k"], self.max_q, self.max_k,
                                          causal=False)
        keys, values = self.cache.layer_pages(layer)
        return flash_attn_varlen_func(q, keys, values, arrays["cu_q"], arrays["cu_k"], self.max_q, self.max_k,
                                      causal=False, block_table=arrays["block_table"])

    def _flex_block_mask(self, device: torch.device):
        from torch.nn.attention.flex_attention import create_block_mask

        doc, lo, hi = self._device["doc"], self._device["k_lo"], self._device["k_hi"]

        def same_request(b, h, q_idx, kv_idx):
            d = doc[q_idx]
            return (kv_idx >= lo[d]) & (kv_idx < hi[d])

        num_keys = self.layout.total if self.layout.keys is KeyLayout.FRESH else self.cache.num_slots
        return create_block_mask(same_request, None, None, self.layout.total, num_keys, device=device)

    def _flex(self, q, k, v) -> torch.Tensor:
        flex = flex_attention_fn(q.device.type == "cuda")
        out = flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                   block_mask=self._block_mask, enable_gqa=k.shape[1] != q.shape[1])
        return out[0].transpose(0, 1)


_INT32 = frozenset({"cu_q", "cu_k", "used_k", "block_table"})  # what the varlen kernels take as int32


# --- SDPA: one call over a padded batch of query chunks -----------------------------------------


@dataclass
class _SdpaPlan:
    """How the step's query rows become one padded SDPA batch.

    ``views``: every request has ``n`` rows and its keys are its own rows (or there is one request):
    the packed tensors are viewed as ``[B, n, H, D]`` and nothing is gathered. Otherwise query rows
    are cut into chunks of ``chunk`` rows (a request's rows fill ``ceil(q_len / chunk)`` chunks, the
    last one padded); chunk ``c`` attends to its request's keys, gathered into ``[C, K, H_kv, D]``
    with a mask over the padding. The chunk length minimises the padded work.
    """

    layout: StepLayout
    views: bool
    chunk: int = 0
    num_chunks: int = 0
    num_keys: int = 0  # the padded key length
    same_rows: bool = False  # every request's rows are one whole chunk: queries and outputs need no gather
    key_stride: int = 0  # > 0: chunk c's keys are the slots from first_key + c * key_stride (a view, no gather)
    first_key: int = 0
    all_keys_real: bool = False  # every chunk has num_keys keys: no mask
    q_index: torch.Tensor | None = None  # [C * chunk] packed row of each padded query (0 for padding)
    out_index: torch.Tensor | None = None  # [T] padded position of each packed row
    k_index: torch.Tensor | None = None  # [C, num_keys] key row or slot of each padded key (masked padding
    # repeats the request's first key: never a slot another request or a graph's padding wrote)
    k_valid: torch.Tensor | None = None  # [C, 1, 1, num_keys] which padded keys are real

    @classmethod
    def of(cls, layout: StepLayout, num_slots: int = 0) -> _SdpaPlan:
        """``num_slots``: the pool's (a strided view of it must end within it)."""
        ranges = layout.key_ranges()
        if (layout.num_requests == 1 and not layout.num_pad) or (
                layout.keys is KeyLayout.FRESH and len(set(layout.q_lengths)) == 1):
            return cls(layout, views=True)
        longest = max(n for _, n in ranges)
        chunk = min(sorted(_chunk_candidates(layout.q_lengths)),
                    key=lambda c: _padded_work(layout.q_lengths, c, longest))
        num_chunks = sum(-(-n // chunk) for n in layout.q_lengths)
        plan = cls(layout, views=False, chunk=chunk, num_chunks=num_chunks, num_keys=max(longest, 1))
        plan.same_rows = all(n == chunk for n in layout.q_lengths)
        plan.all_keys_real = all(n == longest for _, n in ranges) and num_chunks == len(ranges)
        starts = [s for s, _ in ranges]
        strides = {b - a for a, b in pairwise(starts)}
        if (plan.same_rows and layout.keys is KeyLayout.POOL and len(strides) == 1
                and min(strides) >= longest and starts[-1] + longest <= num_slots):
            # the requests' extents lie at equal distances in the pool (requests placed together): each
            # chunk's keys are a strided view of the pool, the page rounding and other requests masked
            plan.key_stride, plan.first_key = min(strides), starts[0]
        return plan

    def arrays(self, layout: StepLayout) -> Arrays:
        if self.views:
            return {}
        q_index = np.zeros(self.num_chunks * self.chunk, dtype=np.int64)
        out_index = np.empty(layout.total, dtype=np.int64)
        k_index = np.zeros((self.num_chunks, self.num_keys), dtype=np.int64)
        k_length = np.zeros(self.num_chunks, dtype=np.int64)
        c = 0
        for q_start, q_len, (k_start, k_len) in zip(layout.q_starts(), layout.q_lengths, layout.key_ranges(),
                                                    strict=True):
            chunks = -(-q_len // self.chunk)
            padded = np.arange(c * self.chunk, c * self.chunk + q_len)
            q_index[padded] = np.arange(q_start, q_start + q_len)
            out_index[q_start : q_start + q_len] = padded
            k_index[c : c + chunks, :] = k_start  # padding reads (masked) the request's own first key
            k_index[c : c + chunks, :k_len] = np.arange(k_start, k_start + k_len)
            k_length[c : c + chunks] = k_len
            c += chunks
        return {"q_index": q_index, "out_index": out_index, "k_index": k_index, "k_length": k_length}

    def bind(self, arrays: DeviceArrays) -> None:
        if self.views:
            return
        self.q_index, self.out_index, self.k_index = arrays["q_index"], arrays["out_index"], arrays["k_index"]
        if not self.all_keys_real:
            positions = torch.arange(self.num_keys, device=self.k_index.device)
            self.k_valid = (positions[None, :] < arrays["k_length"][:, None])[:, None, None, :]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.views:
            return _sdpa_views(self.layout, q, k, v)
        heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
        shape = (self.num_chunks, self.chunk, heads, dim)
        queries = q.view(shape) if self.same_rows else q.index_select(0, self.q_index).view(shape)
        if self.key_stride:
            keys, values = (self._strided(x) for x in (k, v))
        else:
            flat = self.k_index.view(-1)
            keys = k.index_select(0, flat).view(self.num_chunks, self.num_keys, kv_heads, dim)
            values = v.index_select(0, flat).view(self.num_chunks, self.num_keys, kv_heads, dim)
        out = _sdpa(queries, keys, values, self.k_valid).reshape(-1, heads, dim)
        return out if self.same_rows else out.index_select(0, self.out_index)

    def _strided(self, slots: torch.Tensor) -> torch.Tensor:
        """``[C, num_keys, H_kv, D]``: chunk c reads slots from ``first_key + c * key_stride`` (a view)."""
        row = slots.stride(0)
        return slots.as_strided((self.num_chunks, self.num_keys, *slots.shape[1:]),
                                (self.key_stride * row, row, *slots.stride()[1:]),
                                slots.storage_offset() + self.first_key * row)


def _chunk_candidates(q_lengths: Sequence[int]) -> set[int]:
    shortest, longest = min(q_lengths), max(q_lengths)
    return {shortest, longest, *(c for c in (8, 16, 32, 64, 128) if shortest < c < longest)}


def _padded_work(q_lengths: Sequence[int], chunk: int, num_keys: int) -> int:
    """Padded query rows times keys, plus the keys gathered per chunk (a gathered key row costs about
    as much as one query row's scores against it)."""
    chunks = sum(-(-n // chunk) for n in q_lengths)
    return chunks * (chunk + 1) * num_keys


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over ``[B, n, H, D]`` layouts (heads moved to dim 1 as views)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


def _sdpa_views(layout: StepLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Every request has the same rows and attends to its own fresh rows, or there is one request
    (keys: its extent of the pool, a view): one call over views, nothing copied."""
    batch = layout.num_requests
    if layout.keys is KeyLayout.POOL:
        start, n = layout.k_starts[0], layout.k_lengths[0]
        return _sdpa(q[None], k[None, start : start + n], v[None, start : start + n])[0]
    return _sdpa(q.view(batch, -1, *q.shape[1:]), k.view(batch, -1, *k.shape[1:]),
                 v.view(batch, -1, *v.shape[1:])).reshape(q.shape)
