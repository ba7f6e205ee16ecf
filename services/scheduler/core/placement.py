"""Algorithm 3: step placement and migration.

On every scheduling event each runnable request's next step goes to the instance with the lowest
profiled step latency at the batch it would run in (its current instance: the current batch; any
other: one more), among instances of its model (``view.serves``) with a free batch slot and enough memory. A request already on an
instance moves only when another is faster by ``margin`` (relative), only at a recompute step when
it uses a KV cache (the cache is rebuilt then anyway), and not again within ``cooldown_steps`` of its
last move: the margin and the cooldown together stop ping-pong between two similar instances.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.scheduler.core.request import CacheMode, Request
from services.scheduler.core.view import InstanceTable, StepCost, step_cost


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    migration: bool = True
    margin: float = 0.10  # a move must cut the next step's latency by at least this fraction
    recompute_only: bool = True  # with a KV cache, move only at recompute steps
    cooldown_steps: int = 4  # steps a request stays put after a move
    random_ties: bool = False  # break exact latency ties with the injected generator (else: lowest row)


@dataclass(frozen=True, slots=True)
class Placement:
    row: int
    latency_s: float  # next step's latency there
    is_migration: bool


class PlacementScratch:
    """This event's copy of the per-instance numbers, updated as requests are placed in it."""

    def __init__(self, table: InstanceTable) -> None:
        n = table.num_rows
        self.table = table
        self.batch = table.batch[:n].copy()
        self.mem_free = table.mem_free[:n].copy()
        self.lat_now = table.lat_now[:, :n].copy()
        self.lat_next = table.lat_next[:, :n].copy()
        room = np.where(table.alive[:n], table.max_batch[:n] - self.batch, 0)
        self.num_free_slots = int(np.clip(room, 0, None).sum())

    def has_free_slot(self, model: str) -> bool:
        """Some live instance of ``model`` has a free batch slot in this event's numbers."""
        rows = self.table.serving_rows(model)
        if rows is None:
            return self.num_free_slots > 0
        n = len(self.batch)
        return bool((rows & self.table.alive[:n] & (self.batch < self.table.max_batch[:n])).any())

    def join(self, row: int, tokens: int) -> None:
        self.mem_free[row] -= tokens
        self._set_batch(row, self.batch[row] + 1)
        self.num_free_slots -= 1

    def leave(self, row: int, tokens: int) -> None:
        self.mem_free[row] += tokens
        self._set_batch(row, self.batch[row] - 1)
        self.num_free_slots += 1

    def _set_batch(self, row: int, batch: int) -> None:
        table = self.table
        self.batch[row] = batch
        self.lat_now[:, row] = table.lat_by_batch[:, row, batch]
        room = table.alive[row] and batch < table.max_batch[row]
        self.lat_next[:, row] = table.lat_by_batch[:, row, batch + 1] if room else np.inf


class Placer:
    """Chooses the instance row for a request's next step (Algorithm 3)."""

    def __init__(self, config: PlacementConfig, rng: np.random.Generator) -> None:
        self.config = config
        self.rng = rng

    def place_new(self, scratch: PlacementScratch, request: Request) -> Placement | None:
        """A queued request: the fastest instance that can take it, or None."""
        found = self._best(scratch, step_cost(request), request.context_tokens, -1, request.model)
        return None if found is None else Placement(found[0], found[1], False)

    def place_resident(self, scratch: PlacementScratch, request: Request, row: int, alive: bool) -> Placement | None:
        """A request between steps on instance ``row``: stay, or move if that is clearly better.

        A request whose instance is draining moves; if nothing else can take it, it keeps running on
        the draining instance (rather than stall: a drain that waits for its own requests to leave,
        while every other instance is draining too, would never end); None only if its instance is
        gone.
        """
        kind = step_cost(request)
        if not alive:
            found = self._best(scratch, kind, request.context_tokens, row, request.model)
            if found is None:
                return Placement(row, float(scratch.lat_now[kind, row]), False) if row >= 0 else None
            return Placement(found[0], found[1], True)
        stay = Placement(row, float(scratch.lat_now[kind, row]), False)
        if not self.may_migrate(request):
            return stay
        found = self._best(scratch, kind, request.context_tokens, row, request.model)
        if found is None or found[1] >= stay.latency_s * (1.0 - self.config.margin):
            return stay
        return Placement(found[0], found[1], True)

    def stay_at_block_start(self, scratch: PlacementScratch, requests: list[Request], row: int) -> list[bool]:
        """Would ``place_resident`` keep each of these requests (all on ``row``) there if its next step
        started a block? Asked one step ahead, for the service's pipelining, on this event's numbers;
        the best other instance is found once per step kind and model, with memory for the smallest
        request (so a "stay" is never more likely than in the pass)."""
        config = self.config
        if not config.migration:
            return [True] * len(requests)
        keys = [(StepCost.FULL if r.cache_mode == CacheMode.NONE else StepCost.RECOMPUTE, r.model) for r in requests]
        tokens = min((r.context_tokens for r in requests), default=0)
        would_move: dict[tuple[StepCost, str], bool] = {}  # (step kind, model) -> a faster instance exists
        for kind, model in dict.fromkeys(keys):
            found = self._best(scratch, kind, tokens, row, model)
            would_move[kind, model] = (found is not None
                                       and found[1] < float(scratch.lat_now[kind, row]) * (1.0 - config.margin))
        return [
            not would_move[key] or r.num_steps_done + 1 - r.last_migration_step < config.cooldown_steps
            for r, key in zip(requests, keys, strict=True)
        ]

    def may_migrate(self, request: Request) -> bool:
        config = self.config
        if not config.migration:
            return False
        if config.recompute_only and request.cache_mode != CacheMode.NONE and not request.next_step_is_recompute:
            return False
        return request.num_steps_done - request.last_migration_step >= config.cooldown_steps

    def _best(self, scratch: PlacementScratch, kind: StepCost, tokens: int, exclude_row: int,
              model: str) -> tuple[int, float] | None:
        """The fastest row of ``model`` (``InstanceTable.serving_rows``) with a free slot and ``tokens``
        of memory, other than ``exclude_row``: (row, its next step's latency), or None."""
        latency = scratch.lat_next[kind]
        rows = scratch.table.serving_rows(model)
        if exclude_row >= 0 or rows is not None or (scratch.mem_free < tokens).any():
            ok = scratch.mem_free >= tokens
            latency = np.where(ok if rows is None else ok & rows, latency, np.inf)
            if exclude_row >= 0:
                latency[exclude_row] = np.inf
        row = int(latency.argmin()) if len(latency) else 0
        if not len(latency) or not np.isfinite(latency[row]):
            return None
        if self.config.random_ties:
            tied = np.flatnonzero(latency <= latency[row] * (1 + 1e-12))
            row = int(tied[self.rng.integers(len(tied))]) if len(tied) > 1 else row
        return row, float(latency[row])
