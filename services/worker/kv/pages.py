"""The KV pool's page table: which pages each request holds, the free runs, the budget (the allocator the
engine asks; the tensor the runner writes is ``services/worker/kv/pool.py``).

A request owns a contiguous run of pages (its :class:`Extent`) that holds its prompt plus canvas:
position ``p`` of the sequence lives in slot ``p`` of the extent. Why contiguous runs of pages: the
SDPA fallback then reads a request's keys as a plain view of the pool (no gather), and flash-attn reads
them through a block table (one row of consecutive page ids per request) with pages of the size its
paged kernel requires (a multiple of 256).

A byte budget (``budget_bytes``; 0: none) caps the pool: it grows up to the budget and no further.
A step that needs more pages than the budget leaves raises :class:`KVBudgetExceeded` before anything
is written (``make_room``), so the engine refuses it whole; free pages scattered between requests'
runs are first gathered by compaction (requests' pages moved down, in order). The pool never shrinks
by itself (a burst's pages are reused by the next); ``trim`` gives the memory back once no request
holds any. Held pages and tokens are plain counters, so another thread (the worker's heartbeat)
reads them without walking the requests.

The table decides, the pool tensor follows: every growth, compaction and trim is queued as a
:data:`PoolChange` (``take_changes``), which the runner applies to its tensor (on every
tensor-parallel rank alike) before the step's forward. ``bytes_copied`` counts what those changes
copy (the pool growing copies the pages it had; compaction moves requests' pages).

Transient extents (a no-cache request's keys in a step that reads keys from the pool) are workspace
for one step, outside the budget and the held counters, in a namespace of their own.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class Extent:
    """A request's pages: ``num_pages`` consecutive pages from ``first_page``, ``num_tokens`` slots used."""

    first_page: int
    num_pages: int
    num_tokens: int

    def first_slot(self, page_size: int) -> int:
        return self.first_page * page_size


@dataclass(frozen=True)
class PoolResize:
    """The pool tensor to hold ``num_pages`` pages, the pages it had kept (``keep``) or not (a trim)."""

    num_pages: int
    keep: bool = True


@dataclass(frozen=True)
class PageMove:
    """``num_pages`` pages moved from page ``source`` down to page ``target`` (compaction, in order)."""

    source: int
    target: int
    num_pages: int


PoolChange = PoolResize | PageMove


class KVBudgetExceeded(RuntimeError):
    """A step would hold more KV pages than the pool's byte budget allows; nothing was written."""

    def __init__(self, request_ids: list[str], needed_pages: int, available_pages: int, page_bytes: int) -> None:
        self.request_ids = list(request_ids)
        self.needed_pages, self.available_pages = needed_pages, available_pages
        super().__init__(
            f"KV budget full: {len(request_ids)} request(s) need {needed_pages} page(s) "
            f"({needed_pages * page_bytes} bytes), {available_pages} left under the budget")


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

    def reset(self, start: int, count: int) -> None:
        """One free run of ``count`` pages from ``start`` (nothing else free)."""
        self._starts, self._lengths = ([start], [count]) if count else ([], [])


class KVPages:
    """The page table of one engine's KV pool (every tensor-parallel rank's pool follows the same one)."""

    def __init__(self, page_size: int, bytes_per_token: int, capacity_tokens: int = 0, budget_bytes: int = 0) -> None:
        """``bytes_per_token``: keys and values of one position, every layer (the pool's);
        ``capacity_tokens``: positions the pool holds from the start (and keeps after ``trim``);
        ``budget_bytes``: the most the pool may ever take (0: no cap)."""
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size, self.bytes_per_token = page_size, bytes_per_token
        self.num_pages = 0  # the pool's pages, as the changes taken so far leave it
        self._free = _FreePages()
        self._extents: dict[str, Extent] = {}  # request id -> its pages
        self._transient: dict[str, Extent] = {}  # request id -> its workspace for one step
        self._cache_blocks: dict[str, int] = {}  # request id -> the block whose start refreshed its cache
        self._changes: list[PoolChange] = []  # for the pool tensor, not taken yet
        self.held_pages = 0  # pages requests hold (kept in step with _extents)
        self.held_tokens = 0  # positions they hold
        self.bytes_copied = 0
        self.max_pages: int | None = None  # the budget in pages (None: no cap)
        self.set_budget(budget_bytes)
        self._base_pages = min(self.pages_for(capacity_tokens), self.max_pages or 1 << 62) if capacity_tokens > 0 else 0
        if self._base_pages:
            self._grow(self._base_pages)

    # --- sizes ----------------------------------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.bytes_per_token

    @property
    def held_bytes(self) -> int:
        """Bytes of the pages that requests hold (free pages excluded)."""
        return self.held_pages * self.page_bytes

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
        """Grow the pool to its whole budget now (it then never grows, nor moves, while requests fit)."""
        if self.max_pages is not None and self.num_pages < self.max_pages:
            self._grow(self.max_pages - self.num_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # --- requests -------------------------------------------------------------------------------

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._extents

    def extent(self, request_id: str) -> Extent:
        return self._extents[request_id]

    def transient_extent(self, request_id: str) -> Extent:
        return self._transient[request_id]

    def reserve(self, request_id: str, num_tokens: int) -> Extent:
        """The request's extent for ``num_tokens`` positions: its own when it has one that size, else
        new pages (the pool grows, or is compacted, when no free run is long enough)."""
        held = self._extents.get(request_id)
        if held is not None and held.num_tokens == num_tokens:
            return held
        self.make_room([(request_id, num_tokens)])
        self._release(request_id)
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

    def reserve_transient(self, request_id: str, num_tokens: int) -> Extent:
        """Pages for one step's workspace (a no-cache request's keys in a step that reads keys from the
        pool): outside the budget and the held counters, the pool growing past the budget if it must;
        ``release_transient`` gives them back."""
        num_pages = self.pages_for(num_tokens)
        held = self._transient.get(request_id)
        if held is not None and held.num_tokens == num_tokens:
            return held
        self.release_transient(request_id)
        first = self._free.take(num_pages)
        if first is None and self._free.num_free >= num_pages:  # enough, but scattered
            self._compact()
            first = self._free.take(num_pages)
        if first is None:
            self._grow(num_pages)  # a free run of num_pages at the end, at least
            first = self._free.take(num_pages)
        assert first is not None, "the pool grew too little for a transient extent"
        extent = self._transient[request_id] = Extent(first, num_pages, num_tokens)
        return extent

    def release_transient(self, request_id: str) -> None:
        extent = self._transient.pop(request_id, None)
        if extent is not None:
            self._free.give(extent.first_page, extent.num_pages)

    def forget(self, request_id: str) -> None:
        """The request's cache is gone (it finished, or moved to another instance): its pages are free."""
        self._cache_blocks.pop(request_id, None)
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        extent = self._extents.pop(request_id, None)
        if extent is None:
            return
        self._free.give(extent.first_page, extent.num_pages)
        self.held_pages -= extent.num_pages
        self.held_tokens -= extent.num_tokens

    # --- which block each cache was refreshed at ------------------------------------------------

    def cached_block(self, request_id: str) -> int | None:
        """The block whose first step stored the request's cache here (None: no cache here)."""
        return self._cache_blocks.get(request_id)

    def note_cached(self, request_id: str, block: int) -> None:
        self._cache_blocks[request_id] = block

    @property
    def num_cached(self) -> int:
        """Requests with a cache here."""
        return len(self._cache_blocks)

    # --- the budget -----------------------------------------------------------------------------

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

    # --- what the pool tensor must do -----------------------------------------------------------

    def trim(self) -> bool:
        """Back to the starting size, when no request holds pages (True: the pool is to be trimmed)."""
        if self._extents or self._transient or self.num_pages <= self._base_pages:
            return False
        self.num_pages = self._base_pages
        self._free.reset(0, self._base_pages)
        self._changes.append(PoolResize(self._base_pages, keep=False))
        return True

    def take_changes(self) -> tuple[PoolChange, ...]:
        """The pool tensor's changes decided since the last call, in order (the runner applies them)."""
        changes, self._changes = tuple(self._changes), []
        return changes

    def _grow(self, extra_pages: int) -> None:
        """``extra_pages`` more at the end of the pool; the pages it had are copied (``bytes_copied``)."""
        old = self.num_pages
        self.num_pages += extra_pages
        self.bytes_copied += old * self.page_bytes
        self._changes.append(PoolResize(self.num_pages))
        self._free.give(old, extra_pages)

    def _compact(self) -> None:
        """Move every extent's pages down, in pool order, so that the free pages form one run at the end."""
        cursor = 0
        held = [(self._extents, rid, e) for rid, e in self._extents.items()]
        held += [(self._transient, rid, e) for rid, e in self._transient.items()]
        for table, rid, extent in sorted(held, key=lambda item: item[2].first_page):
            if extent.first_page != cursor:
                self._changes.append(PageMove(extent.first_page, cursor, extent.num_pages))
                self.bytes_copied += extent.num_pages * self.page_bytes
                table[rid] = Extent(cursor, extent.num_pages, extent.num_tokens)
            cursor += extent.num_pages
        self._free.reset(cursor, self.num_pages - cursor)
