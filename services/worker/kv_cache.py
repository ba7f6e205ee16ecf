"""Paged KV storage: every request's keys and values in one preallocated pool, read where they lie.

The pool is one tensor ``[n_layers, 2 (keys, values), num_pages, page_size, H_kv, head_dim]``. A
request owns a contiguous run of pages (its :class:`Extent`) that holds its prompt plus canvas:
position ``p`` of the sequence lives in slot ``p`` of the extent. Keys are stored with RoPE applied,
so they are never rotated again.

Why contiguous runs of pages: the SDPA fallback then reads a request's keys as a plain view of the
pool (no gather), and flash-attn reads them through a block table (one row of consecutive page ids
per request) with pages of the size its paged kernel requires (a multiple of 256).

The pool counts the bytes it moves: ``bytes_written`` (fresh keys and values stored) and
``bytes_copied`` (stored entries moved: only when the pool grows, which copies the old pool).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Extent:
    """A request's pages: ``num_pages`` consecutive pages from ``first_page``, ``num_tokens`` slots used."""

    first_page: int
    num_pages: int
    num_tokens: int

    def first_slot(self, page_size: int) -> int:
        return self.first_page * page_size


class _FreePages:
    """Free pages as sorted, disjoint runs; first fit, merged with their neighbours on release."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._lengths: list[int] = []  # parallel to _starts

    def take(self, count: int) -> int | None:
        """The first page of ``count`` consecutive free pages, now taken; None when no run is long enough."""
        for i, length in enumerate(self._lengths):
            if length >= count:
                start = self._starts[i]
                if length == count:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += count
                    self._lengths[i] -= count
                return start
        return None

    def give(self, start: int, count: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._lengths.insert(i, count)
        if i + 1 < len(self._starts) and start + count == self._starts[i + 1]:  # merge with the next run
            self._lengths[i] += self._lengths.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:  # and with the previous one
            self._lengths[i - 1] += self._lengths.pop(i)
            self._starts.pop(i)

    @property
    def num_free(self) -> int:
        return sum(self._lengths)


class PagedKVCache:
    """The KV caches of every request on one engine (one tensor-parallel shard's heads)."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        page_size: int = 16,
        capacity_tokens: int = 0,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.page_size = page_size
        self.pool = torch.empty((n_layers, 2, 0, page_size, n_kv_heads, head_dim), dtype=dtype, device=device)
        self._free = _FreePages()
        self._extents: dict[str, Extent] = {}  # request id -> its pages
        self.bytes_written = 0
        self.bytes_copied = 0
        if capacity_tokens > 0:
            self._grow(-(-capacity_tokens // page_size))

    # --- sizes ----------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self.pool.shape[2]

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one position, every layer."""
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * self.pool.element_size()

    @property
    def capacity_bytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the pages that requests hold (free pages excluded)."""
        pages = sum(e.num_pages for e in self._extents.values())
        return pages * self.page_size * self.bytes_per_token

    @property
    def used_bytes(self) -> int:
        """Bytes of the slots that hold a position (the tail of each request's last page excluded)."""
        return sum(e.num_tokens for e in self._extents.values()) * self.bytes_per_token

    # --- requests -------------------------------------------------------------------------------

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._extents

    def extent(self, request_id: str) -> Extent:
        return self._extents[request_id]

    def reserve(self, request_id: str, num_tokens: int) -> Extent:
        """The request's extent for ``num_tokens`` positions: its own when it has one that size, else new pages."""
        held = self._extents.get(request_id)
        if held is not None and held.num_tokens == num_tokens:
            return held
        self.release(request_id)
        num_pages = -(-num_tokens // self.page_size)
        first = self._free.take(num_pages)
        if first is None:
            self._grow(max(self.num_pages, num_pages))
            first = self._free.take(num_pages)
        extent = Extent(first, num_pages, num_tokens)
        self._extents[request_id] = extent
        return extent

    def make_room(self, requests: list[tuple[str, int]]) -> None:
        """Grow once, if need be, so that these (request id, positions) extents can be reserved one by one."""
        needed = sum(-(-n // self.page_size) for rid, n in requests
                     if rid not in self._extents or self._extents[rid].num_tokens != n)
        if needed > self._free.num_free:
            self._grow(max(self.num_pages, needed))

    def release(self, request_id: str) -> None:
        extent = self._extents.pop(request_id, None)
        if extent is not None:
            self._free.give(extent.first_page, extent.num_pages)

    def _grow(self, extra_pages: int) -> None:
        """Add ``extra_pages`` at the end of the pool; the old pool is copied (counted in ``bytes_copied``)."""
        old = self.pool
        shape = list(old.shape)
        shape[2] += extra_pages
        self.pool = old.new_empty(shape)
        if old.shape[2]:
            self.pool[:, :, : old.shape[2]].copy_(old)
            self.bytes_copied += old.numel() * old.element_size()
        self._free.give(old.shape[2], extra_pages)

    # --- reading and writing one layer ----------------------------------------------------------

    def layer_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``layer`` as pages, ``[num_pages, page_size, H_kv, head_dim]`` each (views)."""
        return self.pool[layer, 0], self.pool[layer, 1]

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``layer`` as one row per slot, ``[num_pages * page_size, H_kv, head_dim]`` (views)."""
        keys, values = self.layer_pages(layer)
        return keys.view(-1, self.n_kv_heads, self.head_dim), values.view(-1, self.n_kv_heads, self.head_dim)

    def slots(self, extent: Extent, start: int, end: int) -> torch.Tensor:
        """Slot indices of sequence positions ``[start, end)`` of ``extent``."""
        first = extent.first_slot(self.page_size)
        return torch.arange(first + start, first + end)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Store fresh ``keys``/``values`` ``[N, H_kv, head_dim]`` in ``slots`` ``[N]`` (on the pool's device)."""
        cached_keys, cached_values = self.layer_slots(layer)
        cached_keys.index_copy_(0, slots, keys)
        cached_values.index_copy_(0, slots, values)
        self.bytes_written += 2 * keys.numel() * self.pool.element_size()
