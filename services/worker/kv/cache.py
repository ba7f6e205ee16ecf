"""Paged KV storage: every request's keys and values in one preallocated pool, read where they lie.

The pool is one tensor ``[n_layers, 2 (keys, values), num_pages, page_size, H_kv, head_dim]``. A
request owns a contiguous run of pages (its :class:`Extent`) that holds its prompt plus canvas:
position ``p`` of the sequence lives in slot ``p`` of the extent. Keys are stored with RoPE applied,
so they are never rotated again.

Why contiguous runs of pages: the SDPA fallback then reads a request's keys as a plain view of the
pool (no gather), and flash-attn reads them through a block table (one row of consecutive page ids
per request) with pages of the size its paged kernel requires (a multiple of 256).

The pool counts the bytes it moves: ``bytes_written`` (fresh keys and values stored) and
``bytes_copied`` (stored entries moved: when the pool grows, which copies the old pool, or is
compacted).

A byte budget (``budget_bytes``; 0: none) caps the pool: it grows up to the budget and no further.
A step that needs more pages than the budget leaves raises :class:`KVBudgetExceeded` before anything
is written (``make_room``), so the engine refuses it whole; free pages scattered between requests'
runs are first gathered by compaction (requests' pages moved down, in order). The pool never shrinks
by itself (a burst's pages are reused by the next); ``trim`` gives the memory back once no request
holds any. Held pages and tokens are plain counters, so another thread (the worker's heartbeat)
reads them without walking the requests.
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


class KVBudgetExceeded(RuntimeError):
    """A step would hold more KV pages than the pool's byte budget allows; nothing was written."""

    def __init__(self, request_ids: list[str], needed_pages: int, available_pages: int, page_bytes: int) -> None:
        self.request_ids = list(request_ids)
        self.needed_pages, self.available_pages = needed_pages, available_pages
        super().__init__(
            f"KV budget full: {len(request_ids)} request(s) need {needed_pages} page(s) "
            f"({needed_pages * page_bytes} bytes), {available_pages} left under the budget")


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

    @property
    def longest(self) -> int:
        return max(self._lengths, default=0)

    def reset(self, start: int, count: int) -> None:
        """One free run of ``count`` pages from ``start`` (nothing else free)."""
        self._starts, self._lengths = ([start], [count]) if count else ([], [])


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
        budget_bytes: int = 0,
    ) -> None:
        """``capacity_tokens``: positions the pool holds from the start (and keeps after ``trim``);
        ``budget_bytes``: the most the pool may ever take (0: no cap)."""
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.page_size = page_size
        self.pool = torch.empty((n_layers, 2, 0, page_size, n_kv_heads, head_dim), dtype=dtype, device=device)
        self._free = _FreePages()
        self._extents: dict[str, Extent] = {}  # request id -> its pages
        self._transient: set[str] = set()  # ids whose pages are workspace for one step, outside the budget
        self.held_pages = 0  # pages requests hold (kept in step with _extents)
        self.held_tokens = 0  # positions they hold
        self.bytes_written = 0
        self.bytes_copied = 0
        self.max_pages: int | None = None  # the budget in pages (None: no cap)
        self.set_budget(budget_bytes)
        self._base_pages = min(-(-capacity_tokens // page_size), self.max_pages or 1 << 62) if capacity_tokens > 0 else 0
        if self._base_pages:
            self._grow(self._base_pages)

    # --- sizes ----------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self.pool.shape[2]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one position, every layer."""
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * self.pool.element_size()

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.bytes_per_token

    @property
    def capacity_bytes(self) -> int:
        """Bytes the pool has allocated now (held pages and free ones)."""
        return self.pool.numel() * self.pool.element_size()

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the pages that requests hold (free pages excluded)."""
        return self.held_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the slots that hold a position (the tail of each request's last page excluded)."""
        return self.held_tokens * self.bytes_per_token

    @property
    def budget_bytes(self) -> int:
        """The budget in whole pages' bytes (0: no cap)."""
        return 0 if self.max_pages is None else self.max_pages * self.page_bytes

    @property
    def budget_pages_left(self) -> int | None:
        """Pages requests may still take under the budget (None: no cap)."""
        return None if self.max_pages is None else max(self.max_pages - self.held_pages, 0)

    def set_budget(self, budget_bytes: int) -> None:
        """Cap the pool at ``budget_bytes`` (whole pages; 0: no cap). A budget below what requests
        hold now only stops new reservations until they leave."""
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must not be negative, got {budget_bytes}")
        self.max_pages = budget_bytes // self.page_bytes if budget_bytes else None
        if self.max_pages == 0:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no page ({self.page_bytes} bytes each)")

    def preallocate(self) -> None:
        """Allocate the pool to its whole budget now (it then never grows, nor moves, while requests fit)."""
        if self.max_pages is not None and self.num_pages < self.max_pages:
            self._grow(self.max_pages - self.num_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # --- requests -------------------------------------------------------------------------------

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._extents

    def extent(self, request_id: str) -> Extent:
        return self._extents[request_id]

    def reserve(self, request_id: str, num_tokens: int) -> Extent:
        """The request's extent for ``num_tokens`` positions: its own when it has one that size, else
        new pages (the pool grows, or is compacted, when no free run is long enough)."""
        held = self._extents.get(request_id)
        if held is not None and held.num_tokens == num_tokens:
            return held
        self.make_room([(request_id, num_tokens)])
        self.release(request_id)
        num_pages = self.pages_for(num_tokens)
        first = self._free.take(num_pages)
        if first is None:  # free pages enough (make_room), but scattered
            self._compact()
            first = self._free.take(num_pages)
        assert first is not None, "make_room left too few free pages"
        extent = Extent(first, num_pages, num_tokens)
        self._extents[request_id] = extent
        self.held_pages += num_pages
        self.held_tokens += num_tokens
        return extent

    def reserve_transient(self, key: str, num_tokens: int) -> Extent:
        """Pages for one step's workspace (a no-cache request's keys in a step that reads keys from the
        pool; a CUDA graph's padding rows): outside the budget and the held counters, the pool growing
        past the budget if it must; ``release`` gives them back."""
        num_pages = self.pages_for(num_tokens)
        if self._extents.get(key, Extent(0, 0, 0)).num_tokens == num_tokens and key in self._transient:
            return self._extents[key]
        self.release(key)
        first = self._free.take(num_pages)
        if first is None and self._free.num_free >= num_pages:  # enough, but scattered
            self._compact()
            first = self._free.take(num_pages)
        if first is None:
            self._grow(num_pages)  # a free run of num_pages at the end, at least
            first = self._free.take(num_pages)
        assert first is not None, "the pool grew too little for a transient extent"
        extent = self._extents[key] = Extent(first, num_pages, num_tokens)
        self._transient.add(key)
        return extent

    def pages_needed(self, requests: list[tuple[str, int]]) -> int:
        """New pages these (request id, positions) reservations take (a request's own extent of that
        size is kept; one of another size is given back first)."""
        needed = 0
        for rid, n in requests:
            held = self._extents.get(rid)
            if held is None or held.num_tokens != n:
                needed += self.pages_for(n) - (held.num_pages if held is not None else 0)
        return needed

    def fits(self, requests: list[tuple[str, int]]) -> bool:
        """Would reserving these (request id, positions) extents stay within the budget?"""
        left = self.budget_pages_left
        return left is None or self.pages_needed(requests) <= left

    def make_room(self, requests: list[tuple[str, int]]) -> None:
        """Grow once, if need be, so that these (request id, positions) extents can be reserved one by
        one; :class:`KVBudgetExceeded` (nothing changed) when the budget cannot hold them."""
        needed = self.pages_needed(requests)
        left = self.budget_pages_left
        if left is not None and needed > left:
            raise KVBudgetExceeded([rid for rid, _ in requests], needed, left, self.page_bytes)
        short = needed - self._free.num_free
        if short > 0:
            extra = max(self.num_pages, short)  # doubling, so growth copies O(total) bytes in all
            if self.max_pages is not None:
                extra = max(min(extra, self.max_pages - self.num_pages), short)
            self._grow(extra)

    def release(self, request_id: str) -> None:
        extent = self._extents.pop(request_id, None)
        if extent is None:
            return
        self._free.give(extent.first_page, extent.num_pages)
        if request_id in self._transient:
            self._transient.discard(request_id)
        else:
            self.held_pages -= extent.num_pages
            self.held_tokens -= extent.num_tokens

    def trim(self) -> int:
        """Give back the memory of a pool no request holds pages of: back to its starting size.
        Returns the bytes freed (0 while any request holds pages)."""
        if self._extents or self.num_pages <= self._base_pages:
            return 0
        freed = self.capacity_bytes
        shape = list(self.pool.shape)
        shape[2] = self._base_pages
        self.pool = self.pool.new_zeros(shape)
        self._free.reset(0, self._base_pages)
        return freed - self.capacity_bytes

    def _grow(self, extra_pages: int) -> None:
        """Add ``extra_pages`` at the end of the pool; the old pool is copied (counted in ``bytes_copied``)."""
        old = self.pool
        shape = list(old.shape)
        shape[2] += extra_pages
        # zeros, not whatever the allocator held: a kernel reading a masked slot (flex_attention's partial
        # blocks, SDPA's padded keys) multiplies it by a probability of 0, which a NaN would survive
        self.pool = old.new_zeros(shape)
        if old.shape[2]:
            self.pool[:, :, : old.shape[2]].copy_(old)
            self.bytes_copied += old.numel() * old.element_size()
        self._free.give(old.shape[2], extra_pages)

    def _compact(self) -> None:
        """Move every request's pages down, in pool order, so that the free pages form one run at the end."""
        cursor = 0
        for rid, extent in sorted(self._extents.items(), key=lambda item: item[1].first_page):
            if extent.first_page != cursor:
                n = extent.num_pages
                moved = self.pool[:, :, extent.first_page : extent.first_page + n].clone()
                self.pool[:, :, cursor : cursor + n].copy_(moved)
                self.bytes_copied += moved.numel() * moved.element_size()
                self._extents[rid] = Extent(cursor, n, extent.num_tokens)
            cursor += extent.num_pages
        self._free.reset(cursor, self.num_pages - cursor)

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
