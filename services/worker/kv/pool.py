"""Paged KV storage: every request's keys and values in one preallocated pool, read where they lie (the
tensor the runner writes; which request holds which pages is ``services/worker/kv/pages.py``).

The pool is one tensor ``[n_layers, 2 (keys, values), num_pages, page_size, H_kv, head_dim]``. Slot
``p`` of a request's extent holds position ``p`` of its sequence. Keys are stored with RoPE applied,
so they are never rotated again.

The pool follows the page table's changes (``apply``: grow, compaction's moves, trim), on every
tensor-parallel rank alike, and counts the bytes it moves: ``bytes_written`` (fresh keys and values
stored) and ``bytes_copied`` (stored entries moved: when the pool grows, which copies the old pool,
or is compacted).

Scratch pages (``reserve_scratch``) lie after the page table's pages, outside it: a CUDA graph's
padding requests write their rows there, so that they never touch a request's keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

from services.worker.kv.pages import Extent, PageMove, PoolChange, PoolResize

Store = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, keys, values): fresh rows stored


class KVPool:
    """The KV tensor of one engine (one tensor-parallel rank's heads)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 page_size: int = 16, scratch_tokens: int = 0) -> None:
        """``scratch_tokens``: positions of scratch after the pages (a CUDA graph's padding rows)."""
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.page_size = page_size
        self.num_pages = 0  # the page table's pages (the scratch pages follow them)
        self.scratch_pages = -(-scratch_tokens // page_size)
        self.pool = torch.zeros((n_layers, 2, self.scratch_pages, page_size, n_kv_heads, head_dim), dtype=dtype,
                                device=device)
        self.bytes_written = 0
        self.bytes_copied = 0
        self._counting = True

    # --- sizes ----------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        """Every slot of the tensor, the scratch's included."""
        return self.pool.shape[2] * self.page_size

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one position, every layer."""
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * self.pool.element_size()

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.bytes_per_token

    @property
    def capacity_bytes(self) -> int:
        """Bytes the pool has allocated now (pages held, free and scratch)."""
        return self.pool.numel() * self.pool.element_size()

    @property
    def scratch_slot(self) -> int:
        """The first scratch slot (``reserve_scratch``)."""
        return self.num_pages * self.page_size

    # --- following the page table ---------------------------------------------------------------

    def apply(self, changes: Iterable[PoolChange]) -> None:
        """Grow, move and trim as the page table decided, in its order."""
        for change in changes:
            if isinstance(change, PageMove):
                self._move(change)
            else:
                self._resize(change)

    def reserve_scratch(self, num_tokens: int) -> int:
        """At least ``num_tokens`` slots of scratch after the pages (the pool reallocated if it had fewer);
        the first scratch slot."""
        pages = -(-num_tokens // self.page_size)
        if pages > self.scratch_pages:
            self.scratch_pages = pages
            self._resize(PoolResize(self.num_pages))
        return self.scratch_slot

    def _resize(self, change: PoolResize) -> None:
        old, kept = self.pool, min(self.num_pages, change.num_pages) if change.keep else 0
        shape = list(old.shape)
        shape[2] = change.num_pages + self.scratch_pages
        # zeros, not whatever the allocator held: a kernel reading a masked slot (flex_attention's partial
        # blocks, SDPA's padded keys) multiplies it by a probability of 0, which a NaN would survive
        self.pool = old.new_zeros(shape)
        if kept:
            self.pool[:, :, :kept].copy_(old[:, :, :kept])
            self.bytes_copied += kept * self.page_bytes
        self.num_pages = change.num_pages

    def _move(self, move: PageMove) -> None:
        moved = self.pool[:, :, move.source : move.source + move.num_pages].clone()
        self.pool[:, :, move.target : move.target + move.num_pages].copy_(moved)
        self.bytes_copied += moved.numel() * moved.element_size()

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
        if self._counting:
            self.bytes_written += 2 * keys.numel() * self.pool.element_size()

    def store(self, slots: torch.Tensor, rows: torch.Tensor | None = None) -> Store:
        """What a step's attention calls with each layer's fresh keys and values: rows ``rows`` (None:
        every row, in order) stored in ``slots``."""

        def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            if rows is not None:
                k, v = k.index_select(0, rows), v.index_select(0, rows)
            self.write(layer, k, v, slots)

        return store

    def count_written(self, num_slots: int) -> None:
        """``num_slots`` slots were stored where this counter could not see it (a replayed CUDA graph)."""
        self.bytes_written += num_slots * self.bytes_per_token

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Writes inside are not counted (capturing a CUDA graph stores nothing a request reads)."""
        self._counting = False
        try:
            yield
        finally:
            self._counting = True
