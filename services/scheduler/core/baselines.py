"""Baselines that dispatch a request once to an instance queue: INFaaS, INFaaS++ and Llumnix.

All run every step at a fixed threshold (0.9 unless configured; never below a request's quality
floor nor above its ceiling). A dispatched request waits in its instance's FIFO until that instance
has a free batch slot and memory, then stays there (Llumnix may migrate it).

- ``infaas``: least-loaded instance by token count. Load = remaining work (context tokens x
  remaining steps at the fixed threshold, estimated from remaining tokens) of its requests, divided
  by the instance's profiled token-steps/s; among the ``top_k`` (3) least-loaded instances whose
  utilisation (requests / max batch) is at most ``max_utilisation`` (0.8) take the first, else the
  least-loaded. No migration.
- ``llumnix``: freeness F = (M - used - waiting demand) / B in KV blocks of ``kv_block_tokens``
  (M the instance's memory limit). Dispatch freeness counts B = running + waiting; migration
  freeness B = running (+1 if any wait). New requests go to the freest instance. Every
  ``pair_every_reports`` step results (load reports), sources (F < threshold, most loaded first)
  pair with destinations (F > threshold, freest first); the source's shortest running request moves
  if the destination stays above the threshold and the load gap narrows (or the destination is
  empty); an instance takes part in one migration at a time. Moves happen at the request's next
  step boundary.
- ``infaas++``: Llumnix's dispatch without migration (as Llumnix's own artifact defines it).
"""

from __future__ import annotations

from collections import deque

import numpy as np
from pydantic import BaseModel, ConfigDict

from services.scheduler.core.base import LogCursor
from services.scheduler.core.decisions import BatchOutcome, Decisions, StepAssignment
from services.scheduler.core.load import instance_token_steps_per_s
from services.scheduler.core.request import Request, RequestStatus
from services.scheduler.core.view import ClusterView, serves


class InfaasConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    threshold: float = 0.9
    top_k: int = 3
    max_utilisation: float = 0.8
    tokens_per_step: float = 3.2  # at the fixed threshold, to turn remaining tokens into steps


class LlumnixConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    threshold: float = 0.9
    migration: bool = True
    migrate_threshold: float = 3.0  # freeness (blocks per request) separating sources from destinations
    pair_every_reports: int = 4
    kv_block_tokens: int = 16
    recompute_only: bool = False  # Llumnix moves at any step boundary (it pre-copies its KV)


class InfaasPlusPlusConfig(LlumnixConfig):
    migration: bool = False


class DispatchPolicy:
    """Dispatch once to an instance FIFO; admit from the FIFO when the instance has room."""

    def __init__(self, name: str, threshold: float, rng: np.random.Generator) -> None:
        self.name = name
        self.threshold = threshold
        self.rng = rng
        self._arrivals = LogCursor()
        self._removals = LogCursor()
        self._rid_to_pinned_id: dict[str, str] = {}  # waiting request id -> instance id
        self._instance_to_fifo: dict[str, deque[str]] = {}  # instance id -> waiting request ids (FIFO)
        self._touched_ids: set[str] = set()  # instance ids whose FIFO may be admitted from this event
        self._instance_version = -1
        self._running = np.zeros(0, dtype=np.int64)  # row -> requests resident, this event

    # hooks for subclasses

    def dispatch(self, view: ClusterView, request: Request) -> str | None:
        raise NotImplementedError

    def next_instance(self, view: ClusterView, request: Request) -> str:
        """Where a resident request's next step runs (its own instance unless it migrates)."""
        return request.instance_id or ""

    def on_pin(self, request: Request, instance_id: str) -> None: ...

    def on_forget(self, request_id: str, waiting_on: str | None) -> None:
        """The request left (``waiting_on``: the instance whose FIFO it was still waiting in)."""

    def on_step_result(self, now: float, result: BatchOutcome) -> None:
        self._touched_ids.add(result.instance_id)

    # the contract

    def schedule(self, now: float, view: ClusterView) -> Decisions:
        decisions = Decisions()
        for rid in self._removals.take(view.removal_log):
            self._forget(rid)
        self._running = view.table.batch[: view.table.num_rows].copy()
        self._sync_instances(view)
        for rid in self._arrivals.take(view.arrival_log):
            request = view.requests.get(rid)
            if request is not None and request.status == RequestStatus.QUEUED:
                self._pin(view, request)
        self.before_placement(now, view)
        ready = sorted((view.requests[rid] for rid in view.ready_ids), key=lambda r: r.seq)
        for request in ready:
            self._plan_resident(view, request, decisions)
        for instance_id in sorted(self._touched_ids):
            self._admit(view, instance_id, decisions)
        self._touched_ids.clear()
        return decisions

    def before_placement(self, now: float, view: ClusterView) -> None: ...

    # internals

    def _pin(self, view: ClusterView, request: Request) -> None:
        instance_id = self.dispatch(view, request)
        if instance_id is None:
            return
        self._rid_to_pinned_id[request.request_id] = instance_id
        self._instance_to_fifo.setdefault(instance_id, deque()).append(request.request_id)
        self._touched_ids.add(instance_id)
        self.on_pin(request, instance_id)

    def _forget(self, request_id: str) -> None:
        waiting_on = self._rid_to_pinned_id.pop(request_id, None)  # its FIFO entry is skipped when reached
        self.on_forget(request_id, waiting_on)

    def _sync_instances(self, view: ClusterView) -> None:
        """After instances change, re-dispatch queued requests pinned to dead instances or evicted."""
        if view.num_instance_changes == self._instance_version:
            return
        first_sync = self._instance_version < 0
        self._instance_version = view.num_instance_changes
        self._touched_ids.update(iid for iid, inst in view.instances.items() if inst.alive)
        if first_sync:
            return
        dead = {iid for iid in self._instance_to_fifo if iid not in view.instances or not view.instances[iid].alive}
        for request in list(view.iter_queued()):
            seen = request.seq < self._arrivals.position
            pinned_to = self._rid_to_pinned_id.get(request.request_id)
            if seen and (pinned_to is None or pinned_to in dead):
                self._forget(request.request_id)
                self._pin(view, request)
        for iid in dead:
            self._instance_to_fifo.pop(iid, None)

    def _plan_resident(self, view: ClusterView, request: Request, decisions: Decisions) -> None:
        current = view.instances.get(request.instance_id or "")
        if current is None or not current.alive:
            target = self.dispatch(view, request)  # its instance is draining: dispatch it anew
        else:
            target = self.next_instance(view, request)
        inst = view.instances.get(target or "")
        if inst is None or not inst.alive or not serves(inst.model, request.model):
            return
        migrate = target != request.instance_id
        if migrate and self._running[inst.row] >= inst.max_batch:
            return  # no room yet: retried at the next event
        if migrate:
            self._running[inst.row] += 1
            if current is not None:
                self._running[current.row] -= 1
                self._touched_ids.add(current.instance_id)
        decisions.assignments.append(self._assignment(request, inst.instance_id, migrate))

    def _admit(self, view: ClusterView, instance_id: str, decisions: Decisions) -> None:
        inst = view.instances.get(instance_id)
        fifo = self._instance_to_fifo.get(instance_id)
        if inst is None or not inst.alive or not fifo:
            return
        mem_free = int(view.table.mem_free[inst.row])
        while fifo and self._running[inst.row] < inst.max_batch:
            request = view.requests.get(fifo[0])
            if request is None or self._rid_to_pinned_id.get(fifo[0]) != instance_id:
                fifo.popleft()
                continue
            if request.context_tokens > mem_free:
                return
            fifo.popleft()
            del self._rid_to_pinned_id[request.request_id]
            mem_free -= request.context_tokens
            self._running[inst.row] += 1
            decisions.assignments.append(self._assignment(request, instance_id, False))

    def _assignment(self, request: Request, instance_id: str, migrate: bool) -> StepAssignment:
        threshold = min(max(self.threshold, request.min_threshold), request.max_threshold)
        return StepAssignment(
            request_id=request.request_id,
            instance_id=instance_id,
            threshold=threshold,
            is_migration=migrate,
            recompute=request.next_step_is_recompute,
            from_instance_id=request.instance_id if migrate else None,
        )


class InfaasPolicy(DispatchPolicy):
    """INFaaS: least-loaded (work / throughput) among the lowest-utilised; no migration."""

    def __init__(self, config: InfaasConfig, rng: np.random.Generator, name: str = "infaas") -> None:
        super().__init__(name, config.threshold, rng)
        self.config = config
        self._rid_to_work: dict[str, tuple[str, float, int]] = {}  # request id -> (instance, work, ctx)
        self._instance_work: dict[str, float] = {}  # instance id -> remaining token-steps
        self._instance_waiting: dict[str, int] = {}  # instance id -> requests waiting

    def dispatch(self, view: ClusterView, request: Request) -> str | None:
        alive = view.alive_instances(request.model)
        if not alive:
            return None
        loads = np.array([self._instance_work.get(i.instance_id, 0.0) / instance_token_steps_per_s(i) for i in alive])
        util = np.array([(self._running[i.row] + self._instance_waiting.get(i.instance_id, 0)) / i.max_batch for i in alive])
        order = np.argsort(loads, kind="stable")
        lowest = [k for k in order[: self.config.top_k] if util[k] <= self.config.max_utilisation]
        return alive[int(lowest[0] if lowest else order[0])].instance_id

    def on_pin(self, request: Request, instance_id: str) -> None:
        work = request.context_tokens * request.num_remaining_tokens / self.config.tokens_per_step
        self._rid_to_work[request.request_id] = (instance_id, work, request.context_tokens)
        self._instance_work[instance_id] = self._instance_work.get(instance_id, 0.0) + work
        self._instance_waiting[instance_id] = self._instance_waiting.get(instance_id, 0) + 1

    def on_forget(self, request_id: str, waiting_on: str | None) -> None:
        entry = self._rid_to_work.pop(request_id, None)
        if entry is not None:
            self._instance_work[entry[0]] -= entry[1]
        if waiting_on is not None:
            self._instance_waiting[waiting_on] -= 1

    def on_step_result(self, now: float, result: BatchOutcome) -> None:
        super().on_step_result(now, result)
        for outcome in result.outcomes:
            entry = self._rid_to_work.get(outcome.request_id)
            if entry is None:
                continue
            iid, work, ctx = entry
            done = min(work, ctx * outcome.num_committed / self.config.tokens_per_step)
            self._rid_to_work[outcome.request_id] = (iid, work - done, ctx)
            self._instance_work[iid] -= done

    def _admit(self, view: ClusterView, instance_id: str, decisions: Decisions) -> None:
        before = len(decisions.assignments)
        super()._admit(view, instance_id, decisions)
        admitted = len(decisions.assignments) - before
        self._instance_waiting[instance_id] = self._instance_waiting.get(instance_id, 0) - admitted


class LlumnixPolicy(DispatchPolicy):
    """Llumnix: freeness-based dispatch and pairwise migration (INFaaS++ without migration)."""

    def __init__(self, config: LlumnixConfig, rng: np.random.Generator, name: str = "llumnix") -> None:
        super().__init__(name, config.threshold, rng)
        self.config = config
        self._wait_tokens = np.zeros(0)  # row -> context tokens waiting in its FIFO
        self._wait_count = np.zeros(0, dtype=np.int64)  # row -> requests waiting
        self._rid_to_wait: dict[str, tuple[int, int]] = {}  # waiting request id -> (row, tokens)
        self._num_reports = 0
        self.rid_to_destination_id: dict[str, str] = {}  # request id -> destination instance id (decided, not run)
        self._rid_to_move: dict[str, tuple[str, str]] = {}  # request id -> (source, destination)
        self.migrating_instance_ids: set[str] = set()

    # freeness

    def _ensure_rows(self, view: ClusterView) -> None:
        n = view.table.num_rows
        if len(self._wait_tokens) < n:
            self._wait_tokens = np.concatenate([self._wait_tokens, np.zeros(n - len(self._wait_tokens))])
            self._wait_count = np.concatenate([self._wait_count, np.zeros(n - len(self._wait_count), dtype=np.int64)])

    def freeness(self, view: ClusterView, for_dispatch: bool) -> np.ndarray:
        """Row -> free KV blocks per request (inf for an empty instance, -inf for a dead one)."""
        self._ensure_rows(view)
        n = view.table.num_rows
        table = view.table
        used = table.mem_limit[:n] - table.mem_free[:n]
        running = self._running[:n]
        waiting = self._wait_count[:n]
        free_blocks = (table.mem_limit[:n] - used - self._wait_tokens[:n]) / self.config.kv_block_tokens
        batch = running + waiting if for_dispatch else running + (waiting > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            freeness = np.where(batch > 0, free_blocks / np.maximum(batch, 1), np.inf)
        return np.where(table.alive[:n], freeness, -np.inf)

    def dispatch(self, view: ClusterView, request: Request) -> str | None:
        freeness = self.freeness(view, for_dispatch=True)
        rows = view.table.serving_rows(request.model)
        if rows is not None:  # only instances of its model
            freeness = np.where(rows, freeness, -np.inf)
        if not len(freeness) or freeness.max() == -np.inf:
            return None  # no live instance (of its model)
        return view.row_to_instance_id[int(freeness.argmax())]

    def on_pin(self, request: Request, instance_id: str) -> None:
        row = self._row_of[instance_id]
        self._rid_to_wait[request.request_id] = (row, request.context_tokens)
        self._wait_tokens[row] += request.context_tokens
        self._wait_count[row] += 1

    def on_forget(self, request_id: str, waiting_on: str | None) -> None:
        entry = self._rid_to_wait.pop(request_id, None)
        if entry is not None:
            self._wait_tokens[entry[0]] -= entry[1]
            self._wait_count[entry[0]] -= 1
        self._end_migration(request_id)
        self.rid_to_destination_id.pop(request_id, None)

    def schedule(self, now: float, view: ClusterView) -> Decisions:
        self._row_of = {iid: inst.row for iid, inst in view.instances.items()}
        self._ensure_rows(view)
        decisions = super().schedule(now, view)
        for assignment in decisions.assignments:
            if not assignment.is_migration:
                self._unwait(assignment.request_id)
        return decisions

    def _unwait(self, request_id: str) -> None:
        entry = self._rid_to_wait.pop(request_id, None)
        if entry is not None:
            self._wait_tokens[entry[0]] -= entry[1]
            self._wait_count[entry[0]] -= 1

    # migration

    def on_step_result(self, now: float, result: BatchOutcome) -> None:
        super().on_step_result(now, result)
        self._num_reports += 1
        for outcome in result.outcomes:
            flight = self._rid_to_move.get(outcome.request_id)
            if flight is not None and flight[1] == result.instance_id:
                self._end_migration(outcome.request_id)

    def before_placement(self, now: float, view: ClusterView) -> None:
        if not self.config.migration or self._num_reports < self.config.pair_every_reports:
            return
        self._num_reports = 0
        self._pair(view)

    def _pair(self, view: ClusterView) -> None:
        """Sources and destinations paired among the instances of one model at a time."""
        freeness = self.freeness(view, for_dispatch=False)
        threshold = self.config.migrate_threshold
        busy = np.array([iid in self.migrating_instance_ids for iid in view.row_to_instance_id])
        rows = np.arange(len(freeness))
        models = view.table.models
        row_models = np.array(view.table.row_models) if len(models) > 1 else None
        for model in sorted(models):
            group = np.ones(len(rows), dtype=bool) if row_models is None else row_models == model
            sources = rows[(freeness < threshold) & np.isfinite(freeness) & ~busy & group]
            sources = sources[np.argsort(freeness[sources], kind="stable")]
            dests = rows[(freeness > threshold) & ~busy & group]
            dests = dests[np.argsort(-freeness[dests], kind="stable")]
            for s, d in zip(sources.tolist(), dests.tolist(), strict=False):
                self._try_pair(view, s, d, freeness)

    def _try_pair(self, view: ClusterView, s: int, d: int, freeness: np.ndarray) -> None:
        source, dest = view.instance_at(s), view.instance_at(d)
        candidate = self._shortest_running(view, source)
        if candidate is None or not serves(dest.model, candidate.model):
            return
        f_dest = self._freeness_after(view, d, +candidate.context_tokens, +1)
        f_source = self._freeness_after(view, s, -candidate.context_tokens, -1)
        if f_dest < self.config.migrate_threshold:
            return  # the destination would itself become a source
        gap_before = -freeness[s] + freeness[d]
        gap_after = -f_source + f_dest
        if self._running[d] == 0 or 0 < gap_after < gap_before:
            self.rid_to_destination_id[candidate.request_id] = dest.instance_id
            self._rid_to_move[candidate.request_id] = (source.instance_id, dest.instance_id)
            self.migrating_instance_ids.update((source.instance_id, dest.instance_id))

    def _freeness_after(self, view: ClusterView, row: int, tokens: int, num: int) -> float:
        table = view.table
        used = table.mem_limit[row] - table.mem_free[row] + tokens
        free_blocks = (table.mem_limit[row] - used - self._wait_tokens[row]) / self.config.kv_block_tokens
        batch = self._running[row] + num + (self._wait_count[row] > 0)
        return float(free_blocks / batch) if batch > 0 else float("inf")

    def _shortest_running(self, view: ClusterView, inst) -> Request | None:
        """The source's request with the least context (least state to move), newest first on ties."""
        residents = [view.requests[rid] for rid in inst.resident_ids if rid not in self.rid_to_destination_id]
        if not residents:
            return None
        return min(residents, key=lambda r: (r.context_tokens, -r.seq))

    def next_instance(self, view: ClusterView, request: Request) -> str:
        dest = self.rid_to_destination_id.get(request.request_id)
        if dest is None:
            return request.instance_id or ""
        if self.config.recompute_only and not request.next_step_is_recompute:
            return request.instance_id or ""
        del self.rid_to_destination_id[request.request_id]
        inst = view.instances.get(dest)
        room = (inst is not None and inst.alive and serves(inst.model, request.model)
                and self._running[inst.row] < inst.max_batch)
        if not room or view.table.mem_free[inst.row] < request.context_tokens:
            self._end_migration(request.request_id)  # abort: the request stays where it is
            return request.instance_id or ""
        return dest

    def _end_migration(self, request_id: str) -> None:
        flight = self._rid_to_move.pop(request_id, None)
        if flight is not None:
            self.migrating_instance_ids.difference_update(flight)
