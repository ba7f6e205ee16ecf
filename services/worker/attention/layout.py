"""Where a packed step's rows and keys lie (host-side, plain ints).

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
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np


class KeyLayout(StrEnum):
    FRESH = "fresh"  # every request's keys are its own fresh rows (full forwards only)
    POOL = "pool"  # every request's keys are its extent of the KV pool


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

    def cu_q(self) -> np.ndarray:
        """[R + 1] int64: each request's first row, then the total (the varlen kernels' ``cu_seqlens_q``)."""
        return np.concatenate(([0], np.cumsum(self.q_lengths))).astype(np.int64)

    def key_ranges(self) -> list[tuple[int, int]]:
        """(first key row or slot, number of keys) per request, in the tensor the keys are read from."""
        if self.keys is KeyLayout.FRESH:
            return list(zip(self.q_starts(), self.q_lengths, strict=True))
        return list(zip(self.k_starts, self.k_lengths, strict=True))
