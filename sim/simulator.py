"""The discrete-event loop: arrivals, step start/end per instance, predictions, migrations,
reconfiguration, completions, on a virtual clock. Policies are the scheduler core's, unchanged.

Every scheduling event goes through ``SchedulingLoop`` (``on_arrival``, ``on_step_result``,
``on_prediction``, ``tick``); the decisions it returns are turned into future events here:
assignments make an idle instance start a step (``STEP_START`` at the same instant, after every
same-time scheduling event), migrations delay the moved request's next step by the modelled copy
time (``MIGRATION_DONE``), rejections are recorded. A batched step takes every request assigned to
the instance whose state is there; the engine decides its outcome at the start and the timer its
duration; the outcome is applied at ``STEP_END``.
"""

from __future__ import annotations

import time as wallclock
from dataclasses import dataclass, field

import numpy as np

from services.reconfigurator.core.monitor import ArrivalEvent
from services.scheduler.core import (
    BatchOutcome,
    CacheMode,
    Decisions,
    Request,
    RequestStatus,
    SchedulingLoop,
    StepOutcome,
)
from sim.cluster import PendingStart, SimCluster
from sim.engines import EngineOutcome, SimEngine
from sim.events import EventQueue, SimEvent
from sim.metrics import SimRequestRecord, Timeline
from sim.predictors import FallbackOnly, PredictionSource
from sim.timing import StepTimer
from sim.workload import RequestSpec

_RUNNABLE = (RequestStatus.RUNNING, RequestStatus.MIGRATING)
_PERIODIC = (SimEvent.SAMPLE, SimEvent.RECONFIG)  # they re-arm themselves while work remains


@dataclass
class SimResult:
    records: list[SimRequestRecord]
    timeline: Timeline
    reconfigurations: list[dict] = field(default_factory=list)
    num_events: int = 0
    wall_s: float = 0.0
    end_s: float = 0.0


class _WorkCountingQueue(EventQueue):
    """Counts queued non-periodic events: periodic ones stop re-arming when none is left (so a run
    whose remaining requests can never progress ends, with them unfinished, instead of looping)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_work = 0

    def push(self, time: float, kind: SimEvent, payload=None):
        self.num_work += kind not in _PERIODIC
        return super().push(time, kind, payload)

    def pop(self):
        event = super().pop()
        self.num_work -= event.kind not in _PERIODIC
        return event


class VirtualClock:
    """The simulation's clock, injected into cores that read time through a callable."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Simulator:
    def __init__(
        self,
        loop: SchedulingLoop,
        cluster: SimCluster,
        engine: SimEngine,
        timer: StepTimer,
        requests: list[RequestSpec],
        *,
        predictor: PredictionSource | None = None,
        reconfigurator=None,  # services.reconfigurator.core.Reconfigurator or None
        cache_mode: CacheMode = CacheMode.DUAL,
        sample_period_s: float = 1.0,
        clock: VirtualClock | None = None,
    ) -> None:
        self.clock = clock or VirtualClock()
        self.loop = loop
        self.view = loop.view
        self.cluster = cluster
        self.engine = engine
        self.timer = timer
        self.predictor = predictor or FallbackOnly()
        self.reconfigurator = reconfigurator
        self.cache_mode = cache_mode
        self.sample_period_s = sample_period_s
        self.queue = _WorkCountingQueue()
        self.records = {s.request_id: SimRequestRecord(s.request_id, s.arrival_s, s.slo_s, s.slo_class) for s in requests}
        self.timeline = Timeline()
        self.reconfigurations: list[dict] = []
        self._plan_waves: dict[str, list] = {}  # plan id -> its waves not applied yet
        self._specs = {s.request_id: s for s in requests}  # request id -> spec
        self._busy_ids: set[str] = set()  # instances with a step in flight
        self._start_pending_ids: set[str] = set()  # instances with a STEP_START queued
        self._ready_at: dict[str, float] = {}  # request id -> when its migrated state lands
        self._num_outstanding = len(requests)
        self._window_threshold = [0.0, 0]  # sum of step thresholds, steps, since the last sample
        self._window_arrivals = 0
        for spec in requests:
            self.queue.push(spec.arrival_s, SimEvent.ARRIVAL, spec)

    @property
    def now(self) -> float:
        return self.clock.now

    # --- the loop --------------------------------------------------------------------------------

    def run(self) -> SimResult:
        started = wallclock.perf_counter()
        self.queue.push(0.0, SimEvent.SAMPLE)
        if self.reconfigurator is not None:
            self.queue.push(self.cluster.spec.reconfig_period_s, SimEvent.RECONFIG)
        handlers = {
            SimEvent.ARRIVAL: self._on_arrival,
            SimEvent.STEP_START: self._on_step_start,
            SimEvent.STEP_END: self._on_step_end,
            SimEvent.PREDICTION: self._on_prediction,
            SimEvent.MIGRATION_DONE: self._on_migration_done,
            SimEvent.INSTANCE_UP: self._on_instance_up,
            SimEvent.INSTANCE_DRAINED: self._on_instance_drained,
            SimEvent.RECONFIG: self._on_reconfig,
            SimEvent.SAMPLE: self._on_sample,
        }
        num_events = 0
        while self.queue:
            event = self.queue.pop()
            self.clock.now = event.time
            handlers[event.kind](event.payload)
            num_events += 1
        return SimResult(
            list(self.records.values()), self.timeline, self.reconfigurations, num_events,
            wallclock.perf_counter() - started, self.now,
        )

    # --- handlers --------------------------------------------------------------------------------

    def _on_arrival(self, spec: RequestSpec) -> None:
        self._window_arrivals += 1
        self.engine.admit(spec, self.cache_mode)
        prompt_len = self.engine.prompt_len(spec)
        request = Request(
            spec.request_id, spec.arrival_s, prompt_len, spec.gen_len, spec.slo_s, block_len=spec.block_len,
            priority=spec.priority, cache_mode=self.cache_mode, min_threshold=spec.min_threshold,
        )
        if self.reconfigurator is not None:
            self.reconfigurator.observe(ArrivalEvent(self.now, prompt_len, spec.gen_len, spec.slo_s))
        self._handle(self.loop.on_arrival(self.now, request))

    def _on_step_start(self, instance_id: str) -> None:
        self._start_pending_ids.discard(instance_id)
        inst = self.view.instances.get(instance_id)
        if inst is None or instance_id in self._busy_ids:
            return
        runnable, waiting_for = [], []
        for rid in inst.resident_ids:
            request = self.view.requests[rid]
            if request.status in _RUNNABLE:
                landed = self._ready_at.get(rid, 0.0) <= self.now
                (runnable if landed else waiting_for).append(request)
        if not runnable:
            return  # migrants still in flight start it when they land (MIGRATION_DONE)
        batch = [(r.request_id, float(r.threshold)) for r in runnable]
        token, recompute = self.engine.start(instance_id, batch)
        contexts = [r.context_tokens for r, rec in zip(runnable, recompute, strict=True) if rec]
        num_cache = len(recompute) - len(contexts)
        duration = self.timer.duration(inst.tp, contexts, num_cache, self.cache_mode == CacheMode.NONE)
        self._busy_ids.add(instance_id)
        for r in runnable:
            self._ready_at.pop(r.request_id, None)
            record = self.records[r.request_id]
            record.num_steps += 1
            record.threshold_sum += float(r.threshold)
            self._window_threshold[0] += float(r.threshold)
            self._window_threshold[1] += 1
        self.queue.push(self.now + duration, SimEvent.STEP_END, (instance_id, token, duration))

    def _on_step_end(self, payload: tuple[str, int, float]) -> None:
        instance_id, token, duration = payload
        outcomes: list[EngineOutcome] = self.engine.finish(token)
        self._busy_ids.discard(instance_id)
        live = [(self.view.requests.get(o.request_id), o) for o in outcomes]
        asked = [(r, o) for r, o in live if r is not None and not o.finished]
        rid_to_prediction = {
            r.request_id: p for (r, _), p in zip(asked, self.predictor.predict(asked), strict=True) if p is not None
        }  # request id -> fresh prediction
        delayed = []
        if self.predictor.latency_s > 0:
            delayed, rid_to_prediction = list(rid_to_prediction.items()), {}
        step_outcomes = [
            StepOutcome(o.request_id, o.num_committed, o.block_done, o.finished, o.recompute,
                        rid_to_prediction.get(o.request_id))
            for o in outcomes
        ]
        decisions = self.loop.on_step_result(self.now, BatchOutcome(instance_id, tuple(step_outcomes), duration))
        for o in outcomes:
            if o.finished:
                self._complete(o.request_id)
        for rid, prediction in delayed:
            self.queue.push(self.now + self.predictor.latency_s, SimEvent.PREDICTION, (rid, prediction))
        self._handle(decisions)
        self._wake(instance_id)
        self._check_drained(instance_id)

    def _on_prediction(self, payload) -> None:
        rid, prediction = payload
        self.loop.on_prediction(self.now, rid, prediction)

    def _on_migration_done(self, instance_id: str) -> None:
        self._wake(instance_id)

    def _on_instance_up(self, pending: PendingStart) -> None:
        self.cluster.start_now(pending.instance)
        left = self.cluster.plan_to_num_pending[pending.plan_id] - 1
        self.cluster.plan_to_num_pending[pending.plan_id] = left
        self._handle(self.loop.tick(self.now))
        if left == 0 and self.reconfigurator is not None:
            self._next_wave(pending.plan_id)  # the next wave, or the acknowledgement after the last

    def _on_instance_drained(self, instance_id: str) -> None:
        inst = self.view.instances.get(instance_id)
        if inst is None or inst.batch or instance_id in self._busy_ids:
            return  # already removed (a duplicate event), or work came back
        self.cluster.remove(instance_id)
        self._start_ready()
        self._handle(self.loop.tick(self.now))

    def _on_reconfig(self, _payload) -> None:
        result = self.reconfigurator.step(self.cluster.as_reconfig_cluster())
        plan = result.plan_to_apply
        entry = {"time_s": round(self.now, 3), "applied": plan is not None, "reason": result.decision.reason}
        if plan is not None:
            entry["plan_id"] = plan.plan_id
            entry["instances_by_tp"] = {str(k): v for k, v in sorted(plan.capacity.instances_by_tp.items()) if v}
            self._apply_plan(plan)
        self.reconfigurations.append(entry)
        if self._num_outstanding > 0 and self.queue.num_work > 0:
            self.queue.push(self.now + self.cluster.spec.reconfig_period_s, SimEvent.RECONFIG)

    def _on_sample(self, _payload) -> None:
        total, count = self._window_threshold
        self.timeline.times.append(self.now)
        self.timeline.instances_by_tp.append(self.cluster.instances_by_tp())
        self.timeline.mean_threshold.append(total / count if count else None)
        self.timeline.arrivals_rps.append(self._window_arrivals / self.sample_period_s)
        self._window_threshold = [0.0, 0]
        self._window_arrivals = 0
        if self._num_outstanding > 0 and self.queue.num_work > 0:
            self.queue.push(self.now + self.sample_period_s, SimEvent.SAMPLE)

    # --- helpers ---------------------------------------------------------------------------------

    def _handle(self, decisions: Decisions) -> None:
        for rejection in decisions.rejections:
            record = self.records[rejection.request_id]
            record.rejected = True
            record.finish_s = self.now
            self.engine.release(rejection.request_id)
            self._num_outstanding -= 1
        for a in decisions.assignments:
            if a.is_migration:
                self.records[a.request_id].num_migrations += 1
                request = self.view.requests[a.request_id]
                land = self.now + self.cluster.migration_s(request.context_tokens)
                self._ready_at[a.request_id] = land
                self.queue.push(land, SimEvent.MIGRATION_DONE, a.instance_id)
                if a.from_instance_id:
                    self._check_drained(a.from_instance_id)
            self._wake(a.instance_id)

    def _wake(self, instance_id: str) -> None:
        if instance_id not in self._busy_ids and instance_id not in self._start_pending_ids:
            self._start_pending_ids.add(instance_id)
            self.queue.push(self.now, SimEvent.STEP_START, instance_id)

    def _complete(self, request_id: str) -> None:
        record = self.records[request_id]
        record.finish_s = self.now
        record.correct = self.engine.correct(request_id)
        self.engine.release(request_id)
        self._num_outstanding -= 1

    def _check_drained(self, instance_id: str) -> None:
        if instance_id not in self.cluster.draining_ids or instance_id in self._busy_ids:
            return
        inst = self.view.instances.get(instance_id)
        if inst is not None and inst.batch == 0:
            self.queue.push(self.now, SimEvent.INSTANCE_DRAINED, instance_id)

    def _apply_plan(self, plan) -> None:
        """Every node at once, or node by node (``ClusterSpec.rolling``: ``PlacementPlan.waves``,
        each wave once the previous one's new instances are up); acknowledged when all are up."""
        waves = list(plan.placement.waves()) if self.cluster.spec.rolling else [plan.placement.nodes]
        self._plan_waves[plan.plan_id] = waves
        self._next_wave(plan.plan_id)

    def _next_wave(self, plan_id: str) -> None:
        waves = self._plan_waves[plan_id]
        while waves:
            nodes = waves.pop(0)
            starts = [i for node in nodes for i in node.start]
            for node in nodes:
                for inst in node.stop:
                    iid = self.cluster.drain(inst)
                    if iid is not None:
                        self._check_drained(iid)
            self.cluster.plan_to_num_pending[plan_id] = len(starts)
            self.cluster.pending.extend(PendingStart(i, plan_id) for i in starts)
            self._start_ready()
            self._handle(self.loop.tick(self.now))
            if starts:
                return  # the next wave goes once these are up
        del self._plan_waves[plan_id]
        self.reconfigurator.acknowledge(plan_id)

    def _start_ready(self) -> None:
        """Pending starts whose GPUs are free begin loading the model."""
        still = []
        for pending in self.cluster.pending:
            if self.cluster.gpus_free(pending.instance):
                self.cluster.reserve(pending.instance)
                self.queue.push(self.now + self.cluster.spec.startup_s, SimEvent.INSTANCE_UP, pending)
            else:
                still.append(pending)
        self.cluster.pending = still


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")
