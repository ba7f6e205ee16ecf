"""Algorithm 2 (adaptive load control) and the capacity it compares against.

Units. Work is counted in *token-steps*: one full forward over one token. A request's remaining load
at threshold tau is

    L_r(tau) = tokens_r * (n_rec(tau) + kappa * n_cache(tau))

with ``tokens_r = prompt_len + gen_len`` (the tokens every full forward processes; we count these
rather than the generation length alone because the prompt is recomputed at every full step and
requests with long prompts cost more), and ``kappa`` the cost of a cache step relative to a
recompute step at full batch (``beta_d(B) / alpha_d(B)``, median over live instances; 1 with no
cache since such requests have no cache steps). Recompute and cache steps are thus counted apart and
summed, as the paper's section 3.4 asks.

Capacity over the SLO window W:

    C = W * sum over live instances i of  B_i * ctx_profile / alpha_{d_i}(B_i)

(``B_i`` the instance's max batch, ``ctx_profile`` the context length its profile was measured at):
the token-steps the cluster can run in one window. W is the mean SLO of the active requests by
default (the minimum, or a fixed number, by configuration: paper section 3.5 for mixed SLOs).

With several models, each model's requests are controlled against the capacity (and W, and kappa)
of the instances that serve it (``view.serves``): a model's load never borrows another's GPUs.

Background work (priority at or below ``BACKGROUND_PRIORITY``: the scheduler's shadow decodes, which
run at the highest threshold with an hour's SLO in slots nobody else wants) is outside the
accounting: its SLO is not in W and its load not in what the clients' requests are planned against.
Counted, one shadow decode among 50 requests of a 6.5-s SLO made W 77 s, so under a deep overload
load control saw no overload and new arrivals went at the highest threshold.
"""

from __future__ import annotations

import statistics
from enum import StrEnum

import numpy as np

from services.scheduler.core.request import Request
from services.scheduler.core.view import ClusterView, InstanceView

# a request at or below this priority is background work, outside load control's accounting (above)
BACKGROUND_PRIORITY = -(10**6)


class SloWindow(StrEnum):
    MEAN = "mean"
    MIN = "min"


def instance_token_steps_per_s(inst: InstanceView) -> float:
    """Recompute token-steps per second at the instance's max batch."""
    profile = inst.profile
    return profile.token_steps_per_s(inst.tp, inst.max_batch) * max(profile.context_tokens, 1)


def cache_step_weight(view: ClusterView, model: str = "") -> float:
    """kappa: a cache step's cost as a fraction of a recompute step's, at full batch (over the live
    instances that serve ``model``; "": all)."""
    ratios = [
        inst.profile.beta(inst.tp, inst.max_batch) / inst.profile.alpha(inst.tp, inst.max_batch)
        for inst in view.alive_instances(model)
    ]
    return statistics.median(ratios) if ratios else 1.0


def cluster_token_steps_per_s(view: ClusterView, model: str = "") -> float:
    """The token-steps per second of the live instances that serve ``model`` ("": all)."""
    return sum(instance_token_steps_per_s(inst) for inst in view.alive_instances(model))


class LoadTable:
    """Per-request rows of what Algorithm 2 needs, kept in numpy arrays between events.

    Rows are (re)written when a request arrives or is re-planned, and freed when it leaves, so the
    controller itself never walks request objects.
    """

    def __init__(self, num_thresholds: int, initial_rows: int = 256) -> None:
        self.num_thresholds = num_thresholds
        self.rid_to_row: dict[str, int] = {}  # request id -> row
        self.model_to_code: dict[str, int] = {}  # request model -> its code in ``model_code`` (every model seen)
        self._free_rows: list[int] = []
        self._num_rows = 0
        self._order: np.ndarray | None = None  # active rows sorted (priority desc, seq); None: stale
        self._alloc(initial_rows)

    def _alloc(self, size: int) -> None:
        def grow(old: np.ndarray | None, shape: tuple[int, ...], dtype: type) -> np.ndarray:
            new = np.zeros(shape, dtype=dtype)
            if old is not None:
                new[: len(old)] = old
            return new

        k = self.num_thresholds
        self.priority = grow(getattr(self, "priority", None), (size,), np.int64)
        self.model_code = grow(getattr(self, "model_code", None), (size,), np.int64)
        self.seq = grow(getattr(self, "seq", None), (size,), np.int64)
        self.tokens = grow(getattr(self, "tokens", None), (size,), np.float64)
        self.slo = grow(getattr(self, "slo", None), (size,), np.float64)
        self.lo = grow(getattr(self, "lo", None), (size,), np.int64)
        self.hi = grow(getattr(self, "hi", None), (size,), np.int64)
        self.protected = grow(getattr(self, "protected", None), (size,), bool)
        self.recompute = grow(getattr(self, "recompute", None), (size, k), np.float64)
        self.cache = grow(getattr(self, "cache", None), (size, k), np.float64)
        self.allowed_hi = grow(getattr(self, "allowed_hi", None), (size,), np.int64)
        self.capacity = size

    def __len__(self) -> int:
        return len(self.rid_to_row)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.rid_to_row

    def upsert(
        self, request: Request, recompute: list[float], cache: list[float], lo: int, hi: int, protected: bool
    ) -> int:
        """Write a request's remaining steps and its own threshold range (indices into the grid)."""
        self.upsert_many([request], np.asarray([recompute]), np.asarray([cache]), [(lo, hi)], [protected])
        return self.rid_to_row[request.request_id]

    def upsert_many(
        self,
        requests: list[Request],
        recompute: np.ndarray,
        cache: np.ndarray,
        ranges: list[tuple[int, int]],
        protected: list[bool],
    ) -> None:
        rows = [self.rid_to_row.get(r.request_id) for r in requests]
        rows = [self._new_row(r) if row is None else row for r, row in zip(requests, rows, strict=True)]
        self.recompute[rows] = recompute
        self.cache[rows] = cache
        lo_hi = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        self.lo[rows], self.hi[rows] = lo_hi[:, 0], lo_hi[:, 1]
        self.allowed_hi[rows] = lo_hi[:, 1]
        self.protected[rows] = protected

    def _new_row(self, request: Request) -> int:
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            if self._num_rows == self.capacity:
                self._alloc(self.capacity * 2)
            row, self._num_rows = self._num_rows, self._num_rows + 1
        self.rid_to_row[request.request_id] = row
        self.priority[row], self.seq[row] = request.priority, request.seq
        self.model_code[row] = self.model_to_code.setdefault(request.model, len(self.model_to_code))
        self.tokens[row], self.slo[row] = request.context_tokens, request.slo_s
        self._order = None
        return row

    def remove(self, request_id: str) -> None:
        row = self.rid_to_row.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)
            self._order = None

    def ordered_rows(self) -> np.ndarray:
        """Active rows in the controller's visiting order: priority first, then arrival."""
        if self._order is None:
            rows = np.fromiter(self.rid_to_row.values(), dtype=np.int64, count=len(self.rid_to_row))
            self._order = rows[np.lexsort((self.seq[rows], -self.priority[rows]))]
        return self._order

    def background(self, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` are background work (``BACKGROUND_PRIORITY``; module docstring)."""
        return self.priority[rows] <= BACKGROUND_PRIORITY

    def model_rows(self) -> dict[str, np.ndarray] | None:
        """Request model -> its active rows in the controller's order; None while every request seen
        so far is of one model (then ``ordered_rows`` is that model's)."""
        if len(self.model_to_code) <= 1:
            return None
        rows = self.ordered_rows()
        codes = self.model_code[rows]
        return {model: rows[codes == code] for model, code in self.model_to_code.items()}

    def slo_window(self, mode: SloWindow, rows: np.ndarray | None = None) -> float:
        """The SLO window of the active rows (or of ``rows``), background work's SLOs left out."""
        rows = self.ordered_rows() if rows is None else rows
        rows = rows[~self.background(rows)]
        if not len(rows):
            return 0.0
        return float(self.slo[rows].min() if mode == SloWindow.MIN else self.slo[rows].mean())

    def loads(self, rows: np.ndarray, kappa: float) -> np.ndarray:
        """L_r(tau) for the given rows: (len(rows), num_thresholds) token-steps."""
        return self.tokens[rows, None] * (self.recompute[rows] + kappa * self.cache[rows])


class LoadController:
    """Algorithm 2: per-request allowed threshold ranges whose worst case fits the capacity.

    Visit requests by priority, then arrival. For each, try its thresholds from high to low; keep the
    first tau with ``committed + L_r(tau) + sum of later requests' L(tau_min) <= C``, else its lowest.
    ``committed`` then grows by L_r at the kept maximum. Requests marked protected (the top priority
    class) always keep their full range, and count at their maximum.

    Vectorised: the prefix of requests that all get their full range is found with cumulative sums;
    after it, only requests whose next-higher threshold could still fit the remaining headroom are
    visited one by one (headroom only shrinks, so that candidate set is computed once; with
    non-monotone predictions it can grow again, and then every request is visited).
    """

    def run(self, table: LoadTable, capacity: float, kappa: float, rows: np.ndarray | None = None) -> float:
        """Write ``table.allowed_hi`` for every active row (or for ``rows``, in the controller's order:
        one model's requests against that model's capacity); return the worst-case load."""
        rows = table.ordered_rows() if rows is None else rows
        background = table.background(rows)
        if background.any():  # outside the accounting: its own (fixed) range, planned against nothing
            table.allowed_hi[rows[background]] = table.hi[rows[background]]
            rows = rows[~background]
        if not len(rows):
            return 0.0
        loads = table.loads(rows, kappa)
        n = np.arange(len(rows))
        lo, hi, protected = table.lo[rows], table.hi[rows], table.protected[rows]
        load_lo, load_hi = loads[n, lo], loads[n, hi]
        base = np.where(protected, load_hi, load_lo)  # what each request counts at, at the least
        later_base = base.sum() - np.cumsum(base)
        before_hi = np.cumsum(load_hi) - load_hi
        fits = protected | (before_hi + load_hi + later_base <= capacity)
        k = int(np.argmin(fits)) if not fits.all() else len(rows)
        allowed = hi.copy()
        if k < len(rows):
            headroom = capacity - before_hi[k] - base[k] - later_base[k]
            allowed[k:] = self._narrow(loads[k:], load_lo[k:], lo[k:], hi[k:], protected[k:], headroom)
        table.allowed_hi[rows] = allowed
        return float(loads[n, allowed].sum())

    @staticmethod
    def _narrow(loads, load_lo, lo, hi, protected, headroom: float) -> np.ndarray:
        """The greedy pass over the requests after the full-range prefix."""
        allowed = np.where(protected, hi, lo)
        cols = np.arange(loads.shape[1])
        in_range = (cols >= lo[:, None]) & (cols <= hi[:, None])
        extra = np.where(in_range, loads - load_lo[:, None], np.inf)
        above_lo = np.where(cols > lo[:, None], extra, np.inf)
        if (above_lo < 0).any():
            # a higher threshold with less load: headroom can grow again, so visit every request
            LoadController._visit(extra, lo, hi, np.flatnonzero(~protected), headroom, allowed)
            return allowed
        min_step = above_lo.min(axis=1)
        candidates = np.flatnonzero((min_step <= headroom) & ~protected)
        while len(candidates):
            num_done, headroom = LoadController._run_of_choices(extra, lo, candidates, headroom, allowed)
            rest = candidates[num_done:]
            candidates = rest[min_step[rest] <= headroom]
        return allowed

    @staticmethod
    def _run_of_choices(extra, lo, candidates, headroom: float, allowed: np.ndarray) -> tuple[int, float]:
        """Choose for every candidate at the current headroom; keep the longest prefix whose choices
        stay the same once the earlier ones' extra load is taken out (at least one).

        Returns (candidates decided, headroom left); writes ``allowed`` in place.
        """
        ext = extra[candidates]
        rows = np.arange(len(candidates))
        fits = ext <= headroom
        has = fits.any(axis=1)
        choice = np.where(has, ext.shape[1] - 1 - np.argmax(fits[:, ::-1], axis=1), lo[candidates])
        used = np.where(has, ext[rows, choice], 0.0)
        still = ~has | (used <= headroom - (np.cumsum(used) - used))
        num_done = len(candidates) if still.all() else int(np.argmin(still))
        allowed[candidates[:num_done]] = choice[:num_done]
        return num_done, headroom - float(used[:num_done].sum())

    @staticmethod
    def _visit(extra, lo, hi, indices, headroom: float, allowed: np.ndarray) -> float:
        """One request at a time: the highest threshold whose extra load fits the headroom.

        Writes ``allowed`` in place; returns the headroom left.
        """
        for i, row_extra in zip(indices.tolist(), extra[indices].tolist(), strict=True):
            for col in range(int(hi[i]), int(lo[i]), -1):
                if row_extra[col] <= headroom:
                    allowed[i] = col
                    headroom -= row_extra[col]
                    break
        return headroom
