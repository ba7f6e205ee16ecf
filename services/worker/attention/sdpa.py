"""``sdpa``: ``scaled_dot_product_attention`` once over a padded batch; the CPU path and the fallback anywhere.

Query rows are cut into chunks of a common length (a request's rows fill one or more chunks), each
chunk's keys gathered into a padded buffer with a key mask; when every request has the same length
and keys are fresh (or the step has one request), one call over views of the packed tensors, nothing
gathered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch
import torch.nn.functional as F

from services.worker.attention.base import Arrays, AttentionImpl, DeviceArrays
from services.worker.attention.layout import KeyLayout, StepLayout
from services.worker.kv.pool import KVPool


class SdpaAttention(AttentionImpl):
    def __init__(self, layout: StepLayout, cache: KVPool | None, max_keys: int | None = None) -> None:
        super().__init__(layout, cache, max_keys)
        self.plan = SdpaPlan.of(layout, cache.num_slots if cache is not None else 0)

    @classmethod
    def runs(cls, device: torch.device, dtype: torch.dtype, head_dim: int, gqa: bool = False) -> bool:
        return True

    def host_arrays(self) -> Arrays:
        return self.plan.arrays(self.layout)

    def bind(self, arrays: DeviceArrays, device: torch.device) -> None:
        self.plan.bind(arrays)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.plan.attend(q, k, v)


@dataclass
class SdpaPlan:
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
    def of(cls, layout: StepLayout, num_slots: int = 0) -> SdpaPlan:
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
