"""The discrete-event loop: arrivals, batched steps per instance, predictions, reconfiguration and
completions, on a virtual clock. Every step decision is the scheduler core's, unchanged.

The simulator makes the scheduler service's calls on ``StepScheduler`` (``on_arrivals``,
``on_results`` then ``finish_results``, ``on_prediction``, ``tick``, ``drain_instance``) and carries
out the ``StepDecisions`` they return as the live workers would: a ``StepCommand`` starts a batched
step on its instance at once (the engine decides its outcome, ``StepTimer`` its duration, a moved
request's state copy included); a held command (``after_step_id``: pipelining) waits on its instance
and runs the moment the step it follows ends if ``shared.pipelining.held_step`` says the batch is
unchanged, before the core hears of that step, as a worker does; rejections and completions are
recorded. So overlap and pipelining run here as live: a continued step goes before the scheduling
pass, at the thresholds it had, and a pipelined step at the thresholds replanned after the step
before last. The stored state version of each request is emulated (one more per step), so held
commands are checked as a worker checks them.
"""

from __future__ import annotations

import dataclasses
import time as wallclock
from dataclasses import dataclass, field

import numpy as np

from services.reconfigurator.core.monitor import ArrivalEvent
from services.scheduler.core import (
    BatchOutcome,
    CacheMode,
    Prediction,
    Request,
    SchedulingLoop,
    StepConfig,
    StepDecisions,
    StepOutcome,
    StepScheduler,
)
from shared.messages.steps import StepCommand
from shared.pipelining import next_step
from sim.cluster import PendingStart, SimCluster
from sim.engines import EngineOutcome, SimEngine
from sim.events import EventQueue, SimEvent
from sim.metrics import SimRequestRecord, Timeline
from sim.predictors import FallbackOnly, PredictionSource
from sim.timing import StepTimer
from sim.workload import RequestSpec

_PERIODIC = (SimEvent.SAMPLE, SimEvent.RECONFIG)  # they re-arm themselves while work remains


@dataclass
class SimResult:
    records: list[SimRequestRecord]
    timeline: Timeline
    reconfigurations: list[dict] = field(default_factory=list)
    num_events: int = 0
    wall_s: float = 0.0
    end_s: float = 0.0


@dataclass(frozen=True, slots=True)
class _Running:
    """A step running on an instance."""

    command: StepCommand
    token: int  # the engine's
    duration_s: float


@dataclass(frozen=True, slots=True)
class _Stepped:
    """One request's outcome of a step, as ``held_step`` reads it (a worker's ``RequestStepResult``)."""

    request_id: str
    finished: bool
    block_done: bool
    num_masked: int
    state_version: int


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
        steps: StepConfig | None = None,
        timers: dict[str, StepTimer] | None = None,
    ) -> None:
        """``steps``: overlap and pipelining (default: as the live scheduler runs them). Several
        models: ``timers`` times each model's steps (a model not named: ``timer``), and a
        ``reconfigurator`` that divides GPUs between models (``ModelsReconfigurator`` or a baseline)
        is stepped with the model of every running instance."""
        self.clock = clock or VirtualClock()
        self.core = StepScheduler(loop, steps or StepConfig())
        self.view = loop.view
        self.cluster = cluster
        self.engine = engine
        self.timer = timer
        self.timers = timers or {}
        self.startup_s: dict[str, float] = {}  # model -> its load and warm-up (absent: the spec's startup_s)
        self.predictor = predictor or FallbackOnly()
        self.reconfigurator = reconfigurator
        self.cache_mode = cache_mode
        self.sample_period_s = sample_period_s
        self.queue = _WorkCountingQueue()
        self.records = {s.request_id: SimRequestRecord(s.request_id, s.arrival_s, s.slo_s, s.slo_class)
                        for s in requests}
        self.timeline = Timeline()
        self.reconfigurations: list[dict] = []
        self._plan_waves: dict[str, list] = {}  # plan id -> its waves not applied yet
        self._running: dict[str, _Running] = {}  # instance id -> its step in flight
        self.batched_steps = 0  # batched steps started, all instances (what the live workers count)
        self.batched_items = 0  # requests those steps carried
        # steps that started while requests waited for their first step (queued, or placed on an
        # instance whose step still runs), the requests they carried, and the instances' maximum
        # batches summed over them (how full batches are while work is waiting)
        self._num_waiting = 0
        self.queued_steps = 0
        self.queued_items = 0
        self.queued_max_items = 0
        # the same over the steps composed while requests sat in the scheduler's queue, placed nowhere
        # (StepCommand.num_queued): a deep queue, where an instance with free slots should fill them
        self.deep_steps = 0
        self.deep_items = 0
        self.deep_max_items = 0
        self.reconfiguration_instance_s = 0.0  # instance-seconds out of service for plans (start-up, drain)
        self._draining_since: dict[str, float] = {}
        self._held: dict[str, StepCommand] = {}  # instance id -> the command held for the step after it
        self._versions: dict[str, int] = {}  # request id -> version of its stored state (emulated)
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
            SimEvent.STEP_END: self._on_step_end,
            SimEvent.PREDICTION: self._on_prediction,
            SimEvent.INSTANCE_UP: self._on_instance_up,
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
        self._num_waiting += 1
        self.engine.admit(spec, self.cache_mode)
        prompt_len = self.engine.prompt_len(spec)
        self._versions[spec.request_id] = 1  # stored, as the live scheduler's create() does
        request = Request(
            spec.request_id, spec.arrival_s, prompt_len, spec.gen_len, spec.slo_s, block_len=spec.block_len,
            priority=spec.priority, cache_mode=self.cache_mode, min_threshold=spec.min_threshold, model=spec.model,
            max_threshold=spec.max_threshold, state_version=1,
        )
        if self.reconfigurator is not None:
            self.reconfigurator.observe(ArrivalEvent(self.now, prompt_len, spec.gen_len, spec.slo_s), spec.model)
        self._carry_out(self.core.on_arrivals(self.now, [request]))
        if spec.request_id in self.view.requests:  # asked at arrival too, as the live scheduler does
            for rid, prediction in self._predict([spec.request_id]).items():
                self.core.on_prediction(self.now, rid, prediction)

    def _on_step_end(self, payload: tuple[str, int]) -> None:
        """The instance's step is done: it goes on to the command it holds if nothing changed (a
        worker's rule), then the core hears of the step (``on_results``, then ``finish_results``
        with the fresh predictions)."""
        instance_id, step_id = payload
        run = self._running.pop(instance_id)
        outcomes = self.engine.finish(run.token)
        for o in outcomes:
            self._versions[o.request_id] += 1
        nxt = self._go_on(instance_id, run.command, outcomes)
        report = BatchOutcome(
            instance_id,
            tuple(StepOutcome(o.request_id, o.num_committed, o.block_done, o.finished, o.recompute,
                              state_version=self._versions[o.request_id], confidence=o.confidences or None,
                              predicted_end=o.predicted_end)
                  for o in outcomes),
            run.duration_s, step_id=step_id, continued_step_id=nxt.step_id if nxt is not None else 0,
        )
        for o in outcomes:
            if o.finished:
                self._complete(o.request_id)
        passed = self.core.on_results(self.now, [report])
        self._carry_out(passed.decisions)
        predictions = self._predict(passed.pending.stepped_ids)
        self._carry_out(self.core.finish_results(self.now, passed.pending, predictions))

    def _go_on(self, instance_id: str, step: StepCommand, outcomes: list[EngineOutcome]) -> StepCommand | None:
        held = self._held.pop(instance_id, None)
        if instance_id in self.cluster.draining_ids:
            return None
        stepped = [_Stepped(o.request_id, o.finished, o.block_done, o.num_masked, self._versions[o.request_id])
                   for o in outcomes]
        nxt = next_step(step, held, stepped)  # the held command, or the step once more (repeats)
        if nxt is not None:
            self._start(nxt)
        return nxt

    def _predict(self, request_ids: list[str]) -> dict[str, Prediction]:
        """Fresh predictions for the requests that stepped: with their results, or (``latency_s``) later."""
        queries = self.core.queries(request_ids)
        rid_to_prediction = {q.request_id: p for q, p in zip(queries, self.predictor.predict(queries), strict=True)
                             if p is not None}  # request id -> fresh prediction
        if self.predictor.latency_s <= 0:
            return rid_to_prediction
        for rid, prediction in rid_to_prediction.items():
            self.queue.push(self.now + self.predictor.latency_s, SimEvent.PREDICTION, (rid, prediction))
        return {}

    def _on_prediction(self, payload) -> None:
        rid, prediction = payload
        self.core.on_prediction(self.now, rid, prediction)

    def _on_instance_up(self, pending: PendingStart) -> None:
        self.cluster.start_now(pending.instance, pending.model)
        for inst in pending.replaces:  # its GPUs' outgoing instance drains now (one step plus migration)
            self._drain(inst)
        left = self.cluster.plan_to_num_pending[pending.plan_id] - 1
        self.cluster.plan_to_num_pending[pending.plan_id] = left
        self._carry_out(self.core.tick(self.now))
        if left == 0 and self.reconfigurator is not None:
            self._next_wave(pending.plan_id)  # the next wave, or the acknowledgement after the last

    def _on_reconfig(self, _payload) -> None:
        several = getattr(self.reconfigurator, "divides_models", False)  # GPUs divided between models
        cluster = self.cluster.as_reconfig_cluster()
        result = (self.reconfigurator.step(cluster, self.cluster.running_models()) if several
                  else self.reconfigurator.step(cluster))
        plan = result.plan_to_apply
        entry = {"time_s": round(self.now, 3), "applied": plan is not None, "reason": result.decision.reason}
        if plan is not None and several:
            entry["plan_id"] = plan.plan_id
            entry["instances_by_model"] = {name: {str(k): v for k, v in sorted(by_tp.items()) if v}
                                           for name, by_tp in plan.division.instances_by_model_tp.items()}
            self._apply_division(plan)
        elif plan is not None:
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
        if self.cluster.profiles:
            self.timeline.gpus_by_model.append(self.cluster.gpus_by_model())
        self.timeline.mean_threshold.append(total / count if count else None)
        self.timeline.arrivals_rps.append(self._window_arrivals / self.sample_period_s)
        self._window_threshold = [0.0, 0]
        self._window_arrivals = 0
        if self._num_outstanding > 0 and self.queue.num_work > 0:
            self.queue.push(self.now + self.sample_period_s, SimEvent.SAMPLE)

    # --- the core's decisions, carried out as the workers would ------------------------------------

    def _carry_out(self, decisions: StepDecisions) -> None:
        for rejection in decisions.rejections:
            record = self.records[rejection.request_id]
            record.rejected = True
            if record.first_step_s is None:
                self._num_waiting -= 1
            record.finish_s = self.now
            self.engine.release(rejection.request_id)
            self._num_outstanding -= 1
        for migration in decisions.migrations:
            self.records[migration.request_id].num_migrations += 1
        for preemption in decisions.preemptions:
            self.records[preemption.request_id].num_preemptions += 1
        for command in decisions.commands:
            for rid in command.drop_request_ids:  # before its steps, as a worker drops them
                self.engine.drop_cache(rid, command.instance_id)
            if command.after_step_id:
                self._held[command.instance_id] = command  # a later one replaces it, as on a worker
            elif command.items:
                self._start(command)
        for instance_id in decisions.removed_ids:
            self.reconfiguration_instance_s += self.now - self._draining_since.pop(instance_id, self.now)
            self.cluster.release(instance_id)
            self._start_ready()

    def _start(self, command: StepCommand) -> None:
        """A batched step starts now: the engine decides its outcome, the timer its duration (a moved
        request's state is copied first, as a worker loads it before the forward)."""
        iid = command.instance_id
        requests = [self.view.requests[it.request_id] for it in command.items]
        token, recompute = self.engine.start(iid, [(it.request_id, float(it.threshold)) for it in command.items])
        contexts = [r.context_tokens for r, rec in zip(requests, recompute, strict=True) if rec]
        instance = self.view.instances[iid]
        timer = self.timers.get(instance.model, self.timer)
        duration = timer.duration(instance.tp, contexts, len(recompute) - len(contexts),
                                  self.cache_mode == CacheMode.NONE)
        duration += max((self.cluster.migration_s(r.context_tokens) for it, r in zip(command.items, requests, strict=True)
                         if it.load_state and r.holder_id not in (None, iid)), default=0.0)
        self._running[iid] = _Running(command, token, duration)
        self.batched_steps += 1
        self.batched_items += len(command.items)
        if self._num_waiting > sum(self.records[it.request_id].first_step_s is None for it in command.items):
            self.queued_steps += 1
            self.queued_items += len(command.items)
            self.queued_max_items += self.view.instances[iid].max_batch
        if command.num_queued:
            self.deep_steps += 1
            self.deep_items += len(command.items)
            self.deep_max_items += self.view.instances[iid].max_batch
        for it, r in zip(command.items, requests, strict=True):
            record = self.records[it.request_id]
            if record.first_step_s is None:
                record.first_step_s = self.now
                self._num_waiting -= 1
            if it.load_state and r.holder_id not in (None, iid):
                record.migration_s += self.cluster.migration_s(r.context_tokens)
            record.num_steps += 1
            record.threshold_sum += float(it.threshold)
            self._window_threshold[0] += float(it.threshold)
            self._window_threshold[1] += 1
        self.queue.push(self.now + duration, SimEvent.STEP_END, (iid, command.step_id))

    def _complete(self, request_id: str) -> None:
        record = self.records[request_id]
        record.finish_s = self.now
        record.correct = self.engine.correct(request_id)
        self.engine.release(request_id)
        self._num_outstanding -= 1

    def _apply_plan(self, plan) -> None:
        """Every node at once, or node by node (``ClusterSpec.rolling``: ``PlacementPlan.waves``,
        each wave once the previous one's new instances are up); acknowledged when all are up."""
        waves = list(plan.placement.waves()) if self.cluster.spec.rolling else [plan.placement.nodes]
        self._plan_waves[plan.plan_id] = waves
        self._next_wave(plan.plan_id)

    def _apply_division(self, outcome) -> None:
        """A division between models (``ModelsOutcome``), every node at once: every model's stops
        drain first; each start waits for its GPUs, then for the start-up time."""
        stops = [inst for plan in outcome.placement.by_model.values() for node in plan.nodes for inst in node.stop]
        starts = [PendingStart(inst, outcome.plan_id, model)
                  for model, plan in outcome.placement.by_model.items() for node in plan.nodes for inst in node.start]
        if self.cluster.spec.overlap_switch:  # make before break: each start replaces the stops on its GPUs
            starts = [dataclasses.replace(p, replaces=tuple(
                s for s in stops if s.node == p.instance.node and set(s.gpu_ids) & set(p.instance.gpu_ids)))
                for p in starts]
        replaced = {s for p in starts for s in p.replaces}
        for inst in stops:
            if inst not in replaced:
                self._drain(inst)
        self.cluster.plan_to_num_pending[outcome.plan_id] = len(starts)
        for pending in starts:
            if pending.replaces:  # loads now, beside the instance it replaces
                self.cluster.reserve(pending.instance)
                startup_s = self.startup_s.get(pending.model, self.cluster.spec.startup_s)
                self.queue.push(self.now + startup_s, SimEvent.INSTANCE_UP, pending)
            else:
                self.cluster.pending.append(pending)
        self._plan_waves[outcome.plan_id] = []
        self._start_ready()
        self._carry_out(self.core.tick(self.now))
        if not starts:
            self._next_wave(outcome.plan_id)  # acknowledged at once

    def _drain(self, inst) -> None:
        iid = self.cluster.drain(inst)
        if iid is not None:
            self._draining_since[iid] = self.now
            self._carry_out(self.core.drain_instance(self.now, iid))

    def _next_wave(self, plan_id: str) -> None:
        waves = self._plan_waves[plan_id]
        while waves:
            nodes = waves.pop(0)
            starts = [i for node in nodes for i in node.start]
            for node in nodes:
                for inst in node.stop:
                    self._drain(inst)
            self.cluster.plan_to_num_pending[plan_id] = len(starts)
            self.cluster.pending.extend(PendingStart(i, plan_id) for i in starts)
            self._start_ready()
            self._carry_out(self.core.tick(self.now))
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
                startup_s = self.startup_s.get(pending.model, self.cluster.spec.startup_s)
                self.reconfiguration_instance_s += startup_s
                self.queue.push(self.now + startup_s, SimEvent.INSTANCE_UP, pending)
            else:
                still.append(pending)
        self.cluster.pending = still


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")
