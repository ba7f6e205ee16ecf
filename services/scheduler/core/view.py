"""The cluster snapshot that policies read: instances, requests, the queue, and their transitions.

The driver (the scheduler service or the simulator) owns one ``ClusterView`` and changes it only
through its methods: ``add_instance``, ``add_request``, ``apply`` (a policy's decisions) and
``apply_step_result``. Policies read it and return decisions. Per-instance numbers that placement
needs on every event (batch, free memory, step latency at the current and the next batch) are kept
in numpy arrays, updated incrementally, so a decision never loops over requests to rebuild them.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from services.scheduler.core.decisions import BatchOutcome, Decisions, StepAssignment
from services.scheduler.core.request import CacheMode, Prediction, Request, RequestStatus
from shared.profiles import LatencyProfile


class StepCost(IntEnum):
    """Which latency a step costs: the row of the latency tables. Not the engine's ``StepKind``
    (what a step computed): a step with no cache is a full forward that writes no KV (``FULL``)."""

    FULL = 0  # no cache
    RECOMPUTE = 1  # block start with a cache (alpha)
    CACHE = 2  # cache step (beta)


def serves(instance_model: str, request_model: str) -> bool:
    """The one rule for "this instance can run this request's steps": it serves the request's model.

    Placement, migration, preemption, load control and the KV budget all ask it (directly, or through
    ``InstanceTable.serving_rows``, its vectorised form), and ``ClusterView`` refuses an assignment
    that breaks it. A request that names no model (``""``) runs on any instance: the one-model
    cluster of before, where requests never said which model they wanted.
    """
    return not request_model or instance_model == request_model


def step_cost(request: Request) -> StepCost:
    if request.cache_mode == CacheMode.NONE:
        return StepCost.FULL
    return StepCost.RECOMPUTE if request.num_block_steps == 0 else StepCost.CACHE


@dataclass(slots=True)
class InstanceView:
    """A model instance: a TP group of GPUs on one node."""

    instance_id: str
    tp: int
    profile: LatencyProfile
    max_batch: int
    mem_limit_tokens: int  # context tokens it can hold (KV cache / activations)
    node_id: str = ""
    model: str = ""  # the model it serves (``serves``: only that model's requests run here)
    row: int = -1  # index into InstanceTable arrays
    alive: bool = True  # False while draining: takes no new requests
    resident_ids: dict[str, None] = field(default_factory=dict)  # ordered set of request ids
    mem_used_tokens: int = 0

    @property
    def batch(self) -> int:
        return len(self.resident_ids)

    def latency(self, kind: StepCost, batch: float) -> float:
        if kind == StepCost.FULL:
            return self.profile.full(self.tp, batch)
        return self.profile.step_latency(self.tp, batch, kind == StepCost.RECOMPUTE)


class InstanceTable:
    """Per-instance arrays, one row per instance (rows of removed instances stay dead)."""

    def __init__(self) -> None:
        self.num_rows = 0
        self.alive = np.zeros(0, dtype=bool)
        self.batch = np.zeros(0, dtype=np.int64)
        self.max_batch = np.zeros(0, dtype=np.int64)
        self.mem_limit = np.zeros(0, dtype=np.int64)
        self.mem_free = np.zeros(0, dtype=np.int64)
        # kind -> row -> seconds per step at batch b, for b = 0 .. width-1 (inf beyond max batch)
        self.lat_by_batch = np.zeros((3, 0, 2))
        # kind, row -> step latency at the current batch / at one more request (inf if full or dead)
        self.lat_now = np.zeros((3, 0))
        self.lat_next = np.zeros((3, 0))
        self.row_models: list[str] = []  # row -> the model its instance serves
        self._model_to_rows: dict[str, np.ndarray | None] = {}  # request model -> serving_rows (this table's rows)

    @property
    def models(self) -> set[str]:
        """The models of every row (dead ones included: a row's model never changes)."""
        return set(self.row_models)

    def serving_rows(self, model: str) -> np.ndarray | None:
        """The rows whose instance may run a request of ``model`` (``serves``), as a boolean mask over
        ``num_rows``; None when that is every row (one model in the table, or a request that names
        none): callers then skip the mask, so a one-model cluster pays nothing for it."""
        if model not in self._model_to_rows:
            mask = np.fromiter((serves(m, model) for m in self.row_models), dtype=bool, count=self.num_rows)
            self._model_to_rows[model] = None if mask.all() else mask
        return self._model_to_rows[model]

    def add(self, inst: InstanceView) -> int:
        row = self.num_rows
        self.row_models.append(inst.model)
        self._model_to_rows.clear()
        self._grow(row + 1, inst.max_batch + 2)
        self.num_rows += 1
        self.alive[row] = True
        self.max_batch[row] = inst.max_batch
        self.mem_limit[row] = inst.mem_limit_tokens
        self.mem_free[row] = inst.mem_limit_tokens
        self.time(inst, row)
        return row

    def time(self, inst: InstanceView, row: int) -> None:
        """(Re-)derive a row's latencies per batch size from its instance's profile."""
        for kind in StepCost:
            for b in range(1, inst.max_batch + 1):
                self.lat_by_batch[kind, row, b] = inst.latency(kind, b)
        self.refresh(row, int(self.batch[row]))

    def refresh(self, row: int, batch: int) -> None:
        """Re-derive a row's cached latencies after its batch (or liveness) changed."""
        self.batch[row] = batch
        self.lat_now[:, row] = self.lat_by_batch[:, row, batch]
        room = self.alive[row] and batch < self.max_batch[row]
        self.lat_next[:, row] = self.lat_by_batch[:, row, batch + 1] if room else np.inf

    def _grow(self, num_rows: int, width: int) -> None:
        old_rows, old_width = self.lat_by_batch.shape[1], self.lat_by_batch.shape[2]
        new_rows = max(num_rows, old_rows * 2 if num_rows > old_rows else old_rows)
        new_width = max(width, old_width)
        if (new_rows, new_width) == (old_rows, old_width):
            return
        lat = np.full((3, new_rows, new_width), np.inf)
        lat[:, :, 0] = 0.0
        lat[:, :old_rows, :old_width] = self.lat_by_batch
        self.lat_by_batch = lat
        for name in ("alive", "batch", "max_batch", "mem_limit", "mem_free"):
            old = getattr(self, name)
            new = np.zeros(new_rows, dtype=old.dtype)
            new[:old_rows] = old
            setattr(self, name, new)
        for name in ("lat_now", "lat_next"):
            new = np.full((3, new_rows), np.inf)
            new[:, :old_rows] = getattr(self, name)
            setattr(self, name, new)


class AppendLog:
    """Request ids in the order something happened to them, read by position.

    Positions are absolute (they survive ``trim``), so a reader keeps its place while the driver
    drops entries every reader has seen.
    """

    def __init__(self) -> None:
        self._entries: list[str] = []
        self._base = 0  # absolute position of _entries[0]

    def append(self, request_id: str) -> None:
        self._entries.append(request_id)

    def since(self, position: int) -> tuple[list[str], int]:
        """(entries from ``position`` on, the position after them)."""
        return self._entries[max(position - self._base, 0) :], self._base + len(self._entries)

    def trim(self, position: int) -> None:
        """Drop the entries before ``position`` (every reader has read them)."""
        num_dropped = min(max(position - self._base, 0), len(self._entries))
        del self._entries[:num_dropped]
        self._base += num_dropped

    def __len__(self) -> int:
        return self._base + len(self._entries)

    def __iter__(self):
        return iter(self._entries)


class ClusterView:
    """Instances, requests and the admission queue, with every state transition."""

    def __init__(self) -> None:
        self.instances: dict[str, InstanceView] = {}  # instance id -> instance
        self.row_to_instance_id: list[str] = []
        self.table = InstanceTable()
        self.requests: dict[str, Request] = {}  # request id -> live (non-terminal) request
        self.ready_ids: dict[str, None] = {}  # resident requests whose next step is unassigned
        self.arrival_log = AppendLog()  # request ids in admission order (policies keep a cursor)
        self.removal_log = AppendLog()  # request ids that reached a terminal state, in order
        self._queue: list[tuple[int, int, int, str]] = []  # heap of (-priority, seq, entry, request id)
        self._queue_entry: dict[str, int] = {}  # request id -> its live heap entry number
        self._num_entries = 0
        self._num_admitted = 0
        self.num_instance_changes = 0  # bumps when instances are added, drained or removed

    # instances

    def add_instance(
        self,
        instance_id: str,
        tp: int,
        profile: LatencyProfile,
        *,
        node_id: str = "",
        max_batch: int | None = None,
        mem_limit_tokens: int | None = None,
        model: str = "",
    ) -> InstanceView:
        """Register an instance serving ``model``. Defaults: the profile's largest batch, and memory for
        that many requests of the profile's context length."""
        if instance_id in self.instances:
            raise ValueError(f"instance {instance_id} already exists")
        max_batch = max_batch or profile.max_batch(tp)
        mem = mem_limit_tokens if mem_limit_tokens is not None else max_batch * max(profile.context_tokens, 1)
        inst = InstanceView(instance_id, tp, profile, max_batch, mem, node_id=node_id, model=model)
        inst.row = self.table.add(inst)
        self.row_to_instance_id.append(instance_id)
        self.instances[instance_id] = inst
        self.num_instance_changes += 1
        return inst

    def set_profile(self, instance_id: str, profile: LatencyProfile) -> None:
        """Plan an instance with a new profile from now on (its worker's measured step times moved)."""
        inst = self.instances[instance_id]
        inst.profile = profile
        self.table.time(inst, inst.row)

    def drain_instance(self, instance_id: str) -> None:
        """Stop placing new work on an instance; its requests move away at their next step."""
        inst = self.instances[instance_id]
        inst.alive = False
        self.table.alive[inst.row] = False
        self.table.refresh(inst.row, inst.batch)
        self.num_instance_changes += 1

    def remove_instance(self, instance_id: str) -> None:
        """Forget a drained instance; requests still on it go back to the queue (READY ones only)."""
        inst = self.instances[instance_id]
        if inst.alive:
            self.drain_instance(instance_id)
        for rid in list(inst.resident_ids):
            request = self.requests[rid]
            if request.status != RequestStatus.READY:
                raise ValueError(f"instance {instance_id} still runs a step of {rid}")
            self._evict(request)
        del self.instances[instance_id]
        self.num_instance_changes += 1

    def fail_instance(self, instance_id: str) -> list[str]:
        """Forget an instance that died (its lease expired): every request on it goes back to the
        queue, including those whose step was running there (that step is lost; the request's last
        stored state is where it resumes). Returns the ids of the requests whose step was lost."""
        inst = self.instances[instance_id]
        lost = []
        for rid in list(inst.resident_ids):
            request = self.requests[rid]
            if request.status in (RequestStatus.RUNNING, RequestStatus.MIGRATING):
                request.move(RequestStatus.READY)
                request.reloading = True  # the worker may have stored the step before it died
                lost.append(rid)
        for request in self.requests.values():
            if request.holder_id == instance_id:
                request.holder_id = None
        self.remove_instance(instance_id)
        return lost

    def requeue_request(self, request_id: str) -> None:
        """A request's running step failed without an outcome (stale or missing state on the
        worker): it goes back to READY on its instance, counters unchanged, to be assigned again
        once its state is reloaded (``reloaded``)."""
        request = self.requests[request_id]
        if request.status in (RequestStatus.RUNNING, RequestStatus.MIGRATING):
            request.move(RequestStatus.READY)
            self.ready_ids[request.request_id] = None
        request.holder_id = None
        request.reloading = True

    def reloaded(self, request_id: str, version: int, num_steps: int, num_committed: int, current_block: int) -> int:
        """A lost or failed request's state, read back from the store: its counters catch up with
        steps stored but never reported; returns how many there were."""
        request = self.requests[request_id]
        lost = max(num_steps - request.num_steps_done, 0)
        if lost:
            request.catch_up(num_steps, num_committed, current_block)
        request.state_version = version
        request.reloading = False
        return lost

    def preempt(self, request_id: str) -> str | None:
        """A request yields its instance's memory: it goes back to the queue, behind the requests of its
        priority, and its next step starts from the stored state (whoever held its copy and KV cache
        drops them). From READY (between steps) or from RUNNING/MIGRATING (a step its worker refused:
        the state did not change). Returns the instance that held its state (None: only the store)."""
        request = self.requests[request_id]
        if request.status in (RequestStatus.RUNNING, RequestStatus.MIGRATING):
            request.move(RequestStatus.READY)
        request.num_preemptions += 1
        holder, request.holder_id = request.holder_id, None
        self._evict(request, behind=True)
        return holder

    def alive_instances(self, model: str = "") -> list[InstanceView]:
        """Live instances; with ``model``, those that may run its requests (``serves``)."""
        return [inst for inst in self.instances.values() if inst.alive and serves(inst.model, model)]

    def instance_at(self, row: int) -> InstanceView:
        return self.instances[self.row_to_instance_id[row]]

    # requests

    def add_request(self, request: Request) -> None:
        """Admit a request (status QUEUED)."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id} already exists")
        request.seq = self._num_admitted
        self._num_admitted += 1
        request.status = RequestStatus.QUEUED
        self.requests[request.request_id] = request
        self.arrival_log.append(request.request_id)
        self._enqueue(request)

    def set_prediction(self, request_id: str, prediction: Prediction) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            request.record_prediction(prediction)

    def set_threshold(self, request_id: str, threshold: float) -> None:
        """The threshold a running request's next step will use (a policy's ``replan``, in overlap)."""
        request = self.requests.get(request_id)
        if request is not None:
            request.threshold = threshold

    def cancel_request(self, request_id: str, now: float, detail: str = "cancelled") -> None:
        request = self.requests[request_id]
        request.move(RequestStatus.CANCELLED)
        request.detail = detail
        self._retire(request, now)

    def iter_queued(self) -> Iterator[Request]:
        """Queued requests, highest priority first, then admission order (walks the heap lazily)."""
        heap = self._queue
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            entry, index = heapq.heappop(frontier)
            request = self.requests.get(entry[3])
            if request is not None and self._queue_entry.get(entry[3]) == entry[2]:
                yield request
            for child in (2 * index + 1, 2 * index + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))

    @property
    def num_queued(self) -> int:
        return len(self._queue_entry)

    # transitions

    def log_positions(self) -> tuple[int, int]:
        """(arrival, removal) log ends: what a policy has read once its schedule() call begins."""
        return len(self.arrival_log), len(self.removal_log)

    def trim_logs(self, positions: tuple[int, int]) -> None:
        """Forget log entries before ``positions`` (SchedulingLoop calls this after each schedule)."""
        self.arrival_log.trim(positions[0])
        self.removal_log.trim(positions[1])

    def apply(self, now: float, decisions: Decisions) -> None:
        """Carry out a policy's decisions: placements, migrations, rejections."""
        for rejection in decisions.rejections:
            request = self.requests[rejection.request_id]
            request.move(RequestStatus.REJECTED)
            request.detail = rejection.detail or rejection.reason.name
            self._dequeue(request)
            self._retire(request, now)
        for assignment in decisions.assignments:
            self._assign(self.requests[assignment.request_id], assignment)
        self._trim_queue()

    def apply_step_result(self, now: float, result: BatchOutcome) -> None:
        """Advance every request of a finished step; finished ones leave their instance."""
        for outcome in result.outcomes:
            request = self.requests.get(outcome.request_id)
            if request is None:
                continue  # cancelled while its step ran
            request.record_step(outcome.num_committed, outcome.block_done)
            request.holder_id = result.instance_id
            if outcome.state_version:
                request.state_version = outcome.state_version
            if outcome.confidence is not None:
                request.confidence = outcome.confidence
            if outcome.predicted_end is not None:
                request.predicted_end = outcome.predicted_end
            if outcome.prediction is not None:
                request.record_prediction(outcome.prediction)
            if outcome.finished:
                request.move(RequestStatus.FINISHED)
                self._retire(request, now)
            else:
                request.move(RequestStatus.READY)
                self.ready_ids[request.request_id] = None

    def _assign(self, request: Request, assignment: StepAssignment) -> None:
        request.threshold = assignment.threshold
        self.ready_ids.pop(request.request_id, None)
        if request.status == RequestStatus.QUEUED:
            self._dequeue(request)
            self._join(request, assignment.instance_id)
            request.move(RequestStatus.RUNNING)
        elif assignment.instance_id == request.instance_id:
            request.move(RequestStatus.RUNNING)
        else:
            self._leave(request)
            self._join(request, assignment.instance_id)
            request.num_migrations += 1
            request.last_migration_step = request.num_steps_done
            request.move(RequestStatus.MIGRATING)

    def _join(self, request: Request, instance_id: str) -> None:
        inst = self.instances[instance_id]
        if not serves(inst.model, request.model):  # a policy's bug: never run a request on another model
            raise ValueError(f"request {request.request_id} of model {request.model!r} assigned to instance "
                             f"{instance_id} of model {inst.model!r}")
        inst.resident_ids[request.request_id] = None
        inst.mem_used_tokens += request.context_tokens
        self.table.mem_free[inst.row] -= request.context_tokens
        self.table.refresh(inst.row, inst.batch)
        request.instance_id = instance_id

    def _leave(self, request: Request) -> None:
        inst = self.instances.get(request.instance_id or "")
        if inst is not None:
            del inst.resident_ids[request.request_id]
            inst.mem_used_tokens -= request.context_tokens
            self.table.mem_free[inst.row] += request.context_tokens
            self.table.refresh(inst.row, inst.batch)
        request.previous_instance_id = request.instance_id
        request.instance_id = None

    def _evict(self, request: Request, behind: bool = False) -> None:
        self._leave(request)
        self.ready_ids.pop(request.request_id, None)
        request.move(RequestStatus.QUEUED)
        self._enqueue(request, behind)

    def _retire(self, request: Request, now: float) -> None:
        if request.instance_id is not None:
            self._leave(request)
        self._dequeue(request)
        self.ready_ids.pop(request.request_id, None)
        request.finish_time = now
        del self.requests[request.request_id]
        self.removal_log.append(request.request_id)

    def _enqueue(self, request: Request, behind: bool = False) -> None:
        """Into the queue at its admission order, or (``behind``) after every request admitted so far."""
        self._num_entries += 1
        self._queue_entry[request.request_id] = self._num_entries
        order = request.seq
        if behind:
            order = self._num_admitted  # the next admission's seq: no request so admitted shares it
            self._num_admitted += 1
        heapq.heappush(self._queue, (-request.priority, order, self._num_entries, request.request_id))

    def _dequeue(self, request: Request) -> None:
        self._queue_entry.pop(request.request_id, None)

    def _trim_queue(self) -> None:
        """Drop dead heap entries from the top; rebuild when they outnumber the live ones."""
        heap = self._queue
        while heap and self._queue_entry.get(heap[0][3]) != heap[0][2]:
            heapq.heappop(heap)
        if len(heap) > 64 and len(heap) > 2 * len(self._queue_entry):
            self._queue = [e for e in heap if self._queue_entry.get(e[3]) == e[2]]
            heapq.heapify(self._queue)
