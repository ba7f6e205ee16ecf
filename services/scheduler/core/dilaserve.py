"""DiLaServe's policy (Algorithms 1-3) and the ablations and fixed-threshold baseline built from it.

One event re-plans only what it must:

- an arrival adds one row to the load table and tries to place the queue head;
- a step result re-plans the requests of that step (they are READY again): refresh their estimates,
  re-run load control (vectorised over all rows), place (stay or migrate), choose thresholds;
- queued requests are visited, highest priority first, only while some instance has a free slot.

Requests whose step is still running are not touched: their thresholds are re-chosen when their step
ends, which is when a new threshold could take effect anyway.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from services.scheduler.core.base import LogCursor
from services.scheduler.core.decisions import BatchOutcome, Decisions, Rejection, RejectReason, StepAssignment
from services.scheduler.core.load import (
    BACKGROUND_PRIORITY,
    LoadController,
    LoadTable,
    SloWindow,
    cache_step_weight,
    cluster_token_steps_per_s,
)
from services.scheduler.core.placement import Placement, PlacementConfig, PlacementScratch, Placer
from services.scheduler.core.request import CacheMode, Request, RequestStatus
from services.scheduler.core.threshold import (
    DEFAULT_FALLBACK_TOKENS_PER_STEP,
    DEFAULT_THRESHOLDS,
    ModelFloors,
    PredictionMode,
    StepEstimator,
    ThresholdController,
    ThresholdGrid,
)
from services.scheduler.core.view import ClusterView, StepCost

MAX_QUEUE_MISSES = 64  # queued requests that fit nowhere before an event stops looking further


class DiLaServeConfig(BaseModel):
    """DiLaServe: SLO-aware thresholds, load control, step placement with migration."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS  # candidate thresholds (admin set)
    # (canvas length, lowest threshold a request on that canvas may run at): threshold.canvas_floors
    canvas_floors: tuple[tuple[int, float], ...] = ()
    # several models: model -> its floors on `thresholds` (the union of their candidates), from its own
    # quality curve (threshold.model_floors); a request of a model not named has `canvas_floors` alone
    model_floors: dict[str, ModelFloors] = Field(default_factory=dict)
    # threshold -> tokens per step assumed before a request has a prediction
    fallback_tokens_per_step: dict[float, float] = Field(default_factory=lambda: dict(DEFAULT_FALLBACK_TOKENS_PER_STEP))
    prediction: PredictionMode = PredictionMode.ONLINE
    threshold_control: bool = True  # Algorithm 1; off: every step at fixed_threshold
    fixed_threshold: float = 0.9
    load_control: bool = True  # Algorithm 2
    slo_window: SloWindow | float = SloWindow.MEAN  # capacity window: mean or min SLO, or seconds
    protected_priority: int | None = 2  # requests at or above this priority keep their full range
    migration: bool = True
    migration_margin: float = 0.10
    migrate_at_recompute_only: bool = True
    migration_cooldown_steps: int = 4
    reject_infeasible: bool = False  # reject at placement if even the lowest threshold is too slow
    # Algorithm 1 plans against this share of the remaining budget (the rest absorbs what the estimate
    # at the current batch cannot see: batches that grow while the request runs, and the steps the
    # predictor's median misses by). 0.6 was set with a predictor that over-counted steps by about 8%;
    # the median predictor reads that margin as slack (docs/notes.md, item 11). With the stage-7 model
    # and unpredicted_at_max (quick presets, the guard's seed, 2x): 0.40 gives paper-bench-long 90.0%,
    # paper-bench 90.9%, at most 0.8 accuracy points lost anywhere; 0.46: 86.8% / 90.3%, the same
    # accuracy; 0.6: 83.0% / 91.9% (docs/notes.md, item 15)
    budget_share: float = Field(0.40, gt=0.0, le=1.0)
    # with load control: Algorithm 1 costs a request's steps at the batch its instance will run
    # under the current load (active requests spread over the live instances) when that is larger
    # than the batch of the moment (a queue means batches are about to grow)
    load_aware_batch: bool = True
    # ablation (the load-control experiment): Algorithm 1 chooses a request's threshold once, at its
    # first placement, and keeps it; load control, when on, still caps it at every step
    plan_once: bool = False
    tie_break: Literal["first", "random"] = "first"
    # a request's first step runs at its allowed maximum (load control's cap) instead of Algorithm
    # 1's choice, on the fallback estimate (which counts every canvas position) or on a prediction
    # made at arrival (before the model has read a canvas): either lowers the threshold of exactly
    # the step that decides a short answer (a sum is written in its first step). The live scheduler
    # and the simulator ask for one at arrival; planning the first step on it cost paper-bench
    # --quick 9.5 points at 2x (docs/notes.md, item 15). Later steps without a prediction plan on
    # the fallback.
    # Off, the Azure code trace lost up to 1.2 accuracy points at loads the baselines meet (a fifth of
    # first steps ran at 0.7); on, 0.8 (docs/notes.md, item 15)
    unpredicted_at_max: bool = True
    # a step carries at most this many requests that can no longer make their deadline (at their
    # lowest threshold and batch 1, by the estimates) while requests that still can are on the
    # instance: the others yield their places (``yielding``), earliest deadline first among them, so
    # overload is spent on requests that can still meet their SLOs and no late request starves
    # (one goes on in every step). None: late requests step like any other. ablation-cache --quick
    # at 2x: 31.1% -> 42.3% (INFaaS 30.4%); at 1x 93.5% -> 93.7%, p99 4.5 -> 5.0 s; without the one
    # that goes on, 1x p99 12.2 s (docs/notes.md, item 16)
    late_per_step: int | None = Field(1, ge=0)
    # a late request yields only until it is overdue by this many of its own SLOs; then it steps like
    # the requests that are on time: under a sustained overload (new arrivals always on time for a
    # while) the late ones would otherwise go on one per step, and a client's timeout comes first (a
    # live test's burst of 96 requests with a 300-ms SLO, 48 at a time, timed one out after 120 s).
    # ablation-cache --quick at 2x: 3 (and no cap) 42.3%, 1: 36.2%; paper-bench(-long) the same
    late_yield_slos: float = Field(3.0, gt=0.0)


class NoLoadControlConfig(DiLaServeConfig):
    """Ablation: Algorithm 1 alone, no cluster-wide load control."""

    load_control: bool = False


class OneShotConfig(DiLaServeConfig):
    """Ablation: only the prediction made at arrival (scaled by progress)."""

    prediction: PredictionMode = PredictionMode.ONESHOT


class NoMigrationConfig(DiLaServeConfig):
    """Ablation: placement at admission only; requests never move."""

    migration: bool = False


class FixedConfig(DiLaServeConfig):
    """Baseline ``fixed``: DiLaServe placement and migration with one constant threshold."""

    threshold_control: bool = False
    load_control: bool = False
    fixed_threshold: float = 0.9


class DiLaServePolicy:
    """Algorithms 1-3 over a ClusterView; see the module docstring for what an event re-plans."""

    def __init__(self, config: DiLaServeConfig, rng: np.random.Generator, name: str = "dilaserve") -> None:
        self.name = name
        self.config = config
        self.rng = rng
        # a fixed threshold is always a candidate, so `fixed` runs exactly at it
        extra = () if config.threshold_control else (config.fixed_threshold,)
        self.grid = ThresholdGrid(tuple(config.thresholds) + extra,
                                  dict(config.canvas_floors) if config.threshold_control else None,
                                  config.model_floors if config.threshold_control else None)
        self.estimator = StepEstimator(self.grid, config.fallback_tokens_per_step, config.prediction)
        self.table = LoadTable(len(self.grid))
        self.load_controller = LoadController()
        self.placer = Placer(self._placement_config(config), rng)
        self._arrivals = LogCursor()
        self._removals = LogCursor()
        self._plan: dict[str, int] = {}  # plan_once: request id -> the threshold index it was planned at
        self._capacity_version = -1
        self._token_steps_per_s = 0.0
        self._kappa = 1.0
        self._model_capacity: dict[str, tuple[float, float]] = {}  # model -> (token-steps/s, kappa) of its instances
        self.capacity = 0.0  # last capacity C (token-steps), for diagnostics
        self.worst_case_load = 0.0  # last sum of L_r at each request's allowed maximum

    @staticmethod
    def _placement_config(config: DiLaServeConfig) -> PlacementConfig:
        return PlacementConfig(
            migration=config.migration,
            margin=config.migration_margin,
            recompute_only=config.migrate_at_recompute_only,
            cooldown_steps=config.migration_cooldown_steps,
            random_ties=config.tie_break == "random",
        )

    @property
    def _uses_estimates(self) -> bool:
        return self.config.threshold_control or self.config.load_control or self.config.reject_infeasible

    # the two-call contract

    def on_step_result(self, now: float, result: BatchOutcome) -> None:
        """Nothing to keep: the step's requests come back READY and are re-planned in schedule()."""

    def schedule(self, now: float, view: ClusterView) -> Decisions:
        decisions = Decisions()
        for rid in self._removals.take(view.removal_log):
            self.table.remove(rid)
            self._plan.pop(rid, None)
        self._admit(view, decisions)
        ready = sorted((view.requests[rid] for rid in view.ready_ids), key=_visit_key)
        if self._uses_estimates and ready:
            self._refresh(ready)
        if self.config.load_control:
            self._control_load(view)
        scratch = PlacementScratch(view.table)
        placed = [p for p in (self._place_resident(view, scratch, r) for r in ready) if p is not None]
        placed += self._place_queued(now, view, scratch, decisions)
        decisions.assignments.extend(self._assignments(now, view, scratch, placed))
        for rejection in decisions.rejections:  # gone with this pass (the removal log says so later too)
            self.table.remove(rejection.request_id)
        return decisions

    def replan(self, now: float, view: ClusterView, request_ids: list[str]) -> None:
        """Overlap mode: Algorithm 1 for the next step of requests kept running on their instance
        without a pass (``SchedulingLoop.continue_steps``), with fresh estimates and load control;
        their placement does not change (the next pass, at a block start, may move them)."""
        for rid in self._removals.take(view.removal_log):
            self.table.remove(rid)
            self._plan.pop(rid, None)
        requests = [
            r for rid in request_ids
            if (r := view.requests.get(rid)) is not None and r.status == RequestStatus.RUNNING
            and r.request_id in self.table.rid_to_row and r.instance_id in view.instances
        ]
        if not requests or not self.config.threshold_control:
            return
        self._refresh(requests)
        if self.config.load_control:
            self._control_load(view)
        rows = [view.instances[r.instance_id].row for r in requests]
        index, _, _ = self._thresholds(now, PlacementScratch(view.table), requests, rows)
        for request, i in zip(requests, index, strict=True):
            view.set_threshold(request.request_id, self.grid.values[i])

    def would_stay(self, view: ClusterView, instance_id: str, request_ids: list[str]) -> set[str]:
        """Of these requests running on ``instance_id``, those Algorithm 3 would keep there if their
        next step started a block (the service's pipelining lets them go on through it)."""
        inst = view.instances.get(instance_id)
        if inst is None or not inst.alive:
            return set()
        requests = [r for rid in request_ids if (r := view.requests.get(rid)) is not None]
        stays = self.placer.stay_at_block_start(PlacementScratch(view.table), requests, inst.row)
        return {r.request_id for r, stay in zip(requests, stays, strict=True) if stay}

    def provisional(self, request: Request) -> bool:
        """A request's first step runs at load control's cap, before any prediction
        (``unpredicted_at_max``); the pass after that step plans its threshold with the first
        prediction."""
        return self.config.unpredicted_at_max and len(self.grid.values) > 1 and request.num_steps_done == 0

    def yielding(self, now: float, view: ClusterView, instance_id: str, requests: list[Request]) -> set[str]:
        """Of the requests a step on ``instance_id`` would carry, those that yield their places in it:
        the late ones (their estimated time left at their lowest threshold and batch 1 ends past their
        deadline) beyond the ``late_per_step`` with the earliest deadlines, while any of the requests
        can still make its deadline; none overdue by more than ``late_yield_slos`` of its SLO.
        Background work (``BACKGROUND_PRIORITY``: shadow decodes) neither yields nor is yielded to."""
        limit = self.config.late_per_step
        inst = view.instances.get(instance_id)
        requests = [r for r in requests if r.priority > BACKGROUND_PRIORITY]
        if limit is None or not self._uses_estimates or inst is None or len(requests) <= limit:
            return set()
        known = [r for r in requests if r.request_id in self.table.rid_to_row]
        if not known:
            return set()
        rows = np.array([self.table.rid_to_row[r.request_id] for r in known], dtype=np.int64)
        lo = self.table.lo[rows]
        no_cache = np.array([r.cache_mode == CacheMode.NONE for r in known])
        lat = view.table.lat_by_batch[:, inst.row, 1]
        alpha = np.where(no_cache, lat[StepCost.FULL], lat[StepCost.RECOMPUTE])
        beta = np.where(no_cache, lat[StepCost.FULL], lat[StepCost.CACHE])
        least = self.table.recompute[rows, lo] * alpha + self.table.cache[rows, lo] * beta
        deadline = np.array([r.deadline for r in known])
        late = [r for r, is_late in zip(known, deadline < now + least, strict=True) if is_late]
        if len(late) == len(requests):
            return set()
        cap = self.config.late_yield_slos
        late = [r for r in late if now - r.deadline <= cap * r.slo_s]  # long overdue: no more yielding
        late.sort(key=lambda r: (r.deadline, r.request_id))
        return {r.request_id for r in late[limit:]}

    # bookkeeping

    def _admit(self, view: ClusterView, decisions: Decisions) -> None:
        """New arrivals get a load-table row, or a rejection if no threshold honours their floor."""
        admitted = []
        for rid in self._arrivals.take(view.arrival_log):
            request = view.requests.get(rid)
            if request is None:
                continue
            lo, hi = self.grid.request_range(request)
            if lo > hi:
                detail = f"floor {request.min_threshold} above every candidate in {self.grid.values}"
                decisions.rejections.append(Rejection(rid, RejectReason.FLOOR_UNSATISFIABLE, detail))
            else:
                admitted.append(request)
        if self._uses_estimates and admitted:
            self._refresh(admitted)

    def _refresh(self, requests: list[Request]) -> None:
        """Fresh remaining-step estimates (and own threshold ranges) into the load table."""
        recompute, cache = self.estimator.estimate_many(requests)
        ranges = [self.grid.request_range(r) for r in requests]
        top = self.config.protected_priority
        protected = [top is not None and r.priority >= top for r in requests]
        self.table.upsert_many(requests, recompute, cache, ranges, protected)

    def _control_load(self, view: ClusterView) -> None:
        """Algorithm 2; with several models, per model against the capacity of its instances."""
        if view.num_instance_changes != self._capacity_version:
            self._capacity_version = view.num_instance_changes
            self._token_steps_per_s = cluster_token_steps_per_s(view)
            self._kappa = cache_step_weight(view)
            self._model_capacity = {}
        window = self.config.slo_window
        model_rows = self.table.model_rows()
        if model_rows is None:
            window_s = window if isinstance(window, float | int) else self.table.slo_window(window)
            self.capacity = self._token_steps_per_s * window_s
            self.worst_case_load = self.load_controller.run(self.table, self.capacity, self._kappa)
            return
        self.capacity = self.worst_case_load = 0.0
        for model, rows in model_rows.items():
            if model not in self._model_capacity:  # model -> (token-steps per second, kappa) of its instances
                self._model_capacity[model] = (cluster_token_steps_per_s(view, model), cache_step_weight(view, model))
            token_steps_per_s, kappa = self._model_capacity[model]
            window_s = window if isinstance(window, float | int) else self.table.slo_window(window, rows)
            capacity = token_steps_per_s * window_s
            self.capacity += capacity
            self.worst_case_load += self.load_controller.run(self.table, capacity, kappa, rows)

    # placement (Algorithm 3)

    def _place_resident(
        self, view: ClusterView, scratch: PlacementScratch, request: Request
    ) -> tuple[Request, Placement] | None:
        inst = view.instances.get(request.instance_id or "")
        row, alive = (inst.row, inst.alive) if inst is not None else (-1, False)
        placement = self.placer.place_resident(scratch, request, row, alive)
        if placement is None:
            return None  # its instance is draining and nothing has room: retried next event
        if placement.is_migration:
            if row >= 0:
                scratch.leave(row, request.context_tokens)
            scratch.join(placement.row, request.context_tokens)
        return request, placement

    def _place_queued(
        self, now: float, view: ClusterView, scratch: PlacementScratch, decisions: Decisions
    ) -> list[tuple[Request, Placement]]:
        """Queue head first, while some instance has a free slot."""
        rejected = {r.request_id for r in decisions.rejections}
        placed = []
        num_misses = 0
        full_models: set[str] = set()  # models with no free slot left this event: their requests wait
        for request in view.iter_queued():
            if scratch.num_free_slots <= 0 or num_misses >= MAX_QUEUE_MISSES:
                break
            if request.request_id in rejected or request.model in full_models:
                continue
            placement = self.placer.place_new(scratch, request)
            if placement is None:
                if scratch.has_free_slot(request.model):
                    num_misses += 1  # memory keeps it out
                else:
                    full_models.add(request.model)  # not a miss: another model's requests may still fit
                continue
            rejection = self._infeasible(now, view, scratch, request, placement)
            if rejection is not None:
                decisions.rejections.append(rejection)
                continue
            scratch.join(placement.row, request.context_tokens)
            placed.append((request, placement))
        return placed

    # thresholds (Algorithm 1)

    def _assignments(
        self, now: float, view: ClusterView, scratch: PlacementScratch, placed: list[tuple[Request, Placement]]
    ) -> list[StepAssignment]:
        if not placed:
            return []
        requests = [r for r, _ in placed]
        index, estimate, allowed_hi = self._thresholds(now, scratch, requests, [p.row for _, p in placed])
        return [
            StepAssignment(
                request_id=request.request_id,
                instance_id=view.row_to_instance_id[placement.row],
                threshold=self.grid.values[i],
                is_migration=placement.is_migration,
                recompute=request.next_step_is_recompute,
                from_instance_id=request.instance_id if placement.is_migration else None,
                estimated_remaining_s=e,
                max_allowed_threshold=self.grid.values[h],
            )
            for (request, placement), i, e, h in zip(placed, index, estimate, allowed_hi, strict=True)
        ]

    def _thresholds(
        self, now: float, scratch: PlacementScratch, requests: list[Request], rows: list[int]
    ) -> tuple[list[int], list[float], list[int]]:
        """Algorithm 1 at each instance's batch after this event's placements (or the fixed threshold).

        Returns per request: the chosen index, its remaining-latency estimate, the allowed maximum.
        """
        if not self.config.threshold_control:
            fixed = self.config.fixed_threshold
            index = [self.grid.nearest_index(fixed, *self.grid.request_range(r)) for r in requests]
            return index, [0.0] * len(rows), index
        table_rows = [self.table.rid_to_row[r.request_id] for r in requests]
        hi = self.table.allowed_hi if self.config.load_control else self.table.hi
        no_cache = np.array([r.cache_mode == CacheMode.NONE for r in requests])
        alpha_kind = np.where(no_cache, StepCost.FULL, StepCost.RECOMPUTE)
        beta_kind = np.where(no_cache, StepCost.FULL, StepCost.CACHE)
        budget = (np.array([r.deadline for r in requests]) - now) * self.config.budget_share
        alpha, beta = scratch.lat_now[alpha_kind, rows], scratch.lat_now[beta_kind, rows]
        if self.config.load_control and self.config.load_aware_batch:
            # Algorithm 2's view of the aggregate: cost the steps at the batch the load will bring
            rows_ = np.asarray(rows, dtype=np.int64)
            batch = np.maximum(scratch.batch[rows_], self._expected_batch(scratch.table, rows_))
            alpha = np.maximum(alpha, scratch.table.lat_by_batch[alpha_kind, rows_, batch])
            beta = np.maximum(beta, scratch.table.lat_by_batch[beta_kind, rows_, batch])
        index, estimate, _ = ThresholdController.choose_many(
            self.table.recompute[table_rows],
            self.table.cache[table_rows],
            alpha,
            beta,
            budget,
            self.table.lo[table_rows],
            # plan_once: Algorithm 1's own choice, which load control then caps (_planned_once)
            (self.table.hi if self.config.plan_once else hi)[table_rows],
        )
        if self.config.plan_once:
            index = self._planned_once(requests, index, self.table.lo[table_rows], hi[table_rows])
        if self.config.unpredicted_at_max:  # the first step, before any prediction (config)
            unpredicted = np.array([r.num_steps_done == 0 for r in requests])
            index = np.where(unpredicted, hi[table_rows], index)
        return index.tolist(), estimate.tolist(), hi[table_rows].tolist()

    def _planned_once(self, requests: list[Request], chosen: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """``plan_once``: a request keeps the threshold Algorithm 1 chose at its first placement
        (capped by ``hi``: load control's allowed maximum when it is on, so a cap that lifts gives the
        planned threshold back); a request new to the plan takes this event's choice."""
        index = chosen.copy()
        for k, request in enumerate(requests):
            planned = self._plan.setdefault(request.request_id, int(chosen[k]))
            index[k] = max(min(planned, int(hi[k])), int(lo[k]))
        return index

    def _expected_batch(self, table, rows: np.ndarray) -> np.ndarray:
        """The batch each instance runs once the active requests (running and queued) are spread
        over the live instances in proportion to their max batches (capped at the max batch); with
        several models, each model's requests over the instances that serve it."""
        n = table.num_rows
        slots = np.where(table.alive[:n], table.max_batch[:n], 0)
        model_rows = self.table.model_rows()
        if model_rows is None:
            total = np.full(len(rows), int(slots.sum()))
            active = np.full(len(rows), len(self.table))
        else:
            total, active = np.zeros(len(rows), dtype=np.int64), np.zeros(len(rows), dtype=np.int64)
            for k, row in enumerate(rows.tolist()):
                model = table.row_models[row]
                serving = table.serving_rows(model)
                total[k] = int(slots.sum() if serving is None else slots[serving].sum())
                active[k] = len(model_rows.get(model, ()))
        share = np.ceil(active * table.max_batch[rows] / np.maximum(total, 1)).astype(np.int64)
        return np.where(total > 0, np.minimum(share, table.max_batch[rows]), table.batch[rows])

    def _infeasible(
        self, now: float, view: ClusterView, scratch: PlacementScratch, request: Request, placement: Placement
    ) -> Rejection | None:
        """Early rejection (off by default): the lowest allowed threshold misses the deadline."""
        if not self.config.reject_infeasible:
            return None
        table_row = self.table.rid_to_row[request.request_id]
        lo = int(self.table.lo[table_row])
        lat = scratch.table.lat_by_batch[:, placement.row, scratch.batch[placement.row] + 1]
        no_cache = request.cache_mode == CacheMode.NONE
        alpha = lat[StepCost.FULL if no_cache else StepCost.RECOMPUTE]
        beta = lat[StepCost.FULL if no_cache else StepCost.CACHE]
        estimate = float(self.table.recompute[table_row, lo] * alpha + self.table.cache[table_row, lo] * beta)
        budget = request.budget(now)
        if estimate <= budget:
            return None
        detail = (
            f"estimated {estimate:.3f}s at threshold {self.grid.values[lo]} on "
            f"{view.row_to_instance_id[placement.row]} exceeds the remaining budget {budget:.3f}s"
        )
        return Rejection(request.request_id, RejectReason.DEADLINE_INFEASIBLE, detail)


def _visit_key(request: Request) -> tuple[int, int]:
    return -request.priority, request.seq
