"""The worker service: one model instance (TP degree d) that runs the batched steps the scheduler sends.

A thin loop around the engine (``engine.protocol.Engine``: ``DLMEngine``, or ``TensorParallelEngine`` for d > 1):

- ``step.<instance>``: a ``StepCommand``. Each item names a request, its threshold and the state
  version the step starts from. The worker steps from its local copy (and KV cache) when it holds
  that version, otherwise it loads the state from Redis (a migration, a restart, a lost result;
  ``records``); the engine then runs one forward for the whole batch; the new canvas, counters and a
  ``StepRecord`` per request are written back with one pipelined versioned write
  (``StateStore.save_many``); the outcome goes to ``results`` as ``StepResults``. A stale load or
  write becomes a ``StepFailure`` (the state in Redis is unchanged). Commands with no items only
  drop local copies (requests that moved elsewhere). A conditional command (``after_step_id``, sent
  while that step runs) is held and run the moment the step ends if the batch is unchanged
  (pipelining: ``pipelining.HeldCommands``).
- Events (``events.EventPublisher``): a ``RequestProgress`` per step for streaming requests and
  ``RequestFinished`` when a request finishes.
- ``heartbeat``: a ``WorkerHeartbeat`` lease every ``heartbeat_interval_s`` (``heartbeat.Heartbeats``).
  SIGTERM drains: the heartbeat says DRAINING, the scheduler moves the requests away, and the worker
  exits once it holds none (a last STOPPING heartbeat ends the lease at once).
- Pacing (``pace_profile``): a step is stretched to the latency the profile gives for this batch and
  TP degree, so a CPU machine emulates a GPU cluster's timing while the real model picks the tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import nullcontext

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from services.worker.engine.protocol import Engine
from services.worker.engine.request import StepResult
from services.worker.kv.pages import KVBudgetExceeded
from services.worker.service.events import EventPublisher, wire_confidence
from services.worker.service.heartbeat import Heartbeats
from services.worker.service.online_profile import OnlineProfile
from services.worker.service.pipelining import HeldCommands
from services.worker.service.records import ResidentRequest, advanced, load_problem, state_of
from shared.messages import codec
from shared.messages.base import CacheMode, StepKind
from shared.messages.control import WorkerStatus
from shared.messages.steps import (
    FailureKind,
    RequestStepResult,
    StepCommand,
    StepFailure,
    StepItem,
    StepResults,
)
from shared.metrics import WorkerMetrics, serve_metrics
from shared.profiles import LatencyProfile
from shared.retry import retry_transient
from shared.runtime import freeze_startup_heap
from shared.settings import WorkerSettings
from shared.state import RequestRecord, StateStore, StepRecord
from shared.subjects import Subjects, shard_of
from shared.telemetry import context_of, extract_context, tracer, tracing_active

logger = logging.getLogger("dls.worker")

# the requests of a step that go to the engine, each with the local copy it steps from
Ready = list[tuple[StepItem, ResidentRequest]]


def default_instance_id(settings: WorkerSettings) -> str:
    gpus = "g" + "-".join(map(str, settings.gpu_ids)) if settings.gpu_ids else "cpu"
    return f"{settings.node}-{gpus}-tp{settings.tp}-{os.getpid()}"


class WorkerService:
    """One instance. ``engine`` is a ``DLMEngine`` (or the tensor-parallel one, or the zero-compute fake)
    already loaded."""

    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        nc,
        store: StateStore,
        *,
        instance_id: str | None = None,
        clock: Callable[[], float] | None = None,
        beat_connect: Callable[[], Awaitable] | None = None,
        profile: str = "",
        online: OnlineProfile | None = None,
    ) -> None:
        """``clock``: unix time (default ``time.time``; the process passes ``startup.worker_clock``, offset
        by ``DLS_TEST_CLOCK_OFFSET_S`` when set); ``beat_connect``: makes a NATS connection of its own for
        the periodic heartbeats, which then go from a thread of their own (``heartbeat``: a step that holds
        the event loop cannot delay them); None: they go from a task on this loop over ``nc``. ``profile``:
        the served model's calibrated profile for this device (``shared.calibration``); ``online``: the step
        times this worker measures, which its heartbeats carry when it announces no profile (uncalibrated)."""
        self.settings = settings
        self.engine = engine
        self.nc = nc
        self.store = store
        self.subjects = Subjects(settings.subject_prefix)
        self.instance_id = instance_id or settings.instance_id or default_instance_id(settings)
        shards = settings.scheduler_shards  # the scheduler replica that owns this instance hears its results
        self.shard = settings.shard if settings.shard is not None else shard_of(self.instance_id, shards)
        if self.shard >= shards:
            raise ValueError(f"DLS_WORKER_SHARD {self.shard} is not below DLS_SCHEDULER_SHARDS {shards}")
        self._results_subject = self.subjects.results_for(self.shard, shards)
        self.clock = clock if clock is not None else time.time
        self.status = WorkerStatus.STARTING
        self.started_at = self.clock()
        self.profile = profile
        self.online = online if not self.profile_name else None
        self.pace = None  # the latency profile steps are stretched to (None: no pacing)
        # paced steps whose own compute already took longer than the profile allows: the machine cannot
        # keep this pace (a larger --pace-scale can), and live runs slower than the simulator times it
        self.pace_overruns = 0
        self.pace_overrun_s = 0.0  # the time those steps took beyond their paced time, in all
        self.paced_s = 0.0  # the paced time of every step, in all
        if settings.pace_profile:
            self.pace = LatencyProfile.load(settings.pace_profile).scaled(settings.pace_scale)
            if settings.pace_context_tokens:  # anchored: a request of that context costs one profiled step
                self.pace = dataclasses.replace(self.pace, context_tokens=settings.pace_context_tokens)
        self.resident: dict[str, ResidentRequest] = {}  # request id -> its local copy
        self.held = HeldCommands()  # the scheduler's commands for the step after the running one
        self.heartbeats = Heartbeats(self, beat_connect)
        self.events = EventPublisher(nc, self.subjects, engine, self.instance_id, self.clock,
                                     settings.max_payload_bytes)
        self.num_steps = 0
        self.num_malformed = 0
        self._computing_since: float | None = None  # time.monotonic() the running engine step began
        self._lock = asyncio.Lock()  # one step at a time
        self._step_tasks: set[asyncio.Task] = set()  # steps running or waiting for the lock
        self._stopped = asyncio.Event()
        self._drain_expired = False  # drain_timeout_s passed: leave between two steps
        self._subscription = None
        self._tasks: list[asyncio.Task] = []
        self.metrics = WorkerMetrics(self.instance_id, model_name=engine.name)
        self.metrics_server = None  # the /metrics HTTP server (DLS_METRICS_PORT; None: off)
        self._tracer = tracer("dls.worker")
        # engines declare ``blocking = False`` when a step costs next to nothing (no model)
        self._offload = engine.blocking

    @property
    def profile_name(self) -> str:
        """The profile its heartbeats name: the paced one, the configured one, else its calibration's;
        "" when uncalibrated (the heartbeats carry the measured step times instead)."""
        return self.settings.pace_profile or self.settings.profile or self.profile

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self.metrics_server = serve_metrics(self.metrics.registry, self.settings.metrics_port,
                                            self.settings.metrics_host)
        self._subscription = await self.nc.subscribe(self.subjects.step(self.instance_id), cb=self._on_command)
        self.status = WorkerStatus.READY
        await self.heartbeats.send()
        self._tasks.append(self.heartbeats.start())
        freeze_startup_heap()  # full GC passes in the step loop skip the start-up heap (torch, the model)
        logger.info("worker %s ready (tp %d, model %s, pace %s)", self.instance_id, self.settings.tp,
                    self.engine.name, self.settings.pace_profile or "off")

    def drain(self) -> None:
        """Stop taking new requests; exit once none is held, or after ``drain_timeout_s`` between two
        steps (SIGTERM calls this). Leaving with requests held loses only their local copies and KV
        caches: their state is in Redis after every step, and the scheduler resumes them elsewhere."""
        if self.status == WorkerStatus.READY:
            logger.info("worker %s draining (%d requests held)", self.instance_id, len(self.resident))
            self.status = WorkerStatus.DRAINING
            self._tasks.append(asyncio.create_task(self.heartbeats.send()))
            self._tasks.append(asyncio.create_task(self._drain_deadline()))
            self._check_drained()

    async def _drain_deadline(self) -> None:
        await asyncio.sleep(self.settings.drain_timeout_s)
        if self.status == WorkerStatus.DRAINING:
            logger.info("worker %s: drain timeout with %d requests held; leaving them to the others",
                        self.instance_id, len(self.resident))
            self._drain_expired = True
            self._check_drained()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        """Leave now: a STOPPING heartbeat ends the lease, then unsubscribe."""
        if self.status == WorkerStatus.STOPPING and self._stopped.is_set():
            return
        self.status = WorkerStatus.STOPPING
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        await self.heartbeats.stop()
        try:
            await self.heartbeats.send()
            if self._subscription is not None:
                await self._subscription.unsubscribe()
            await self.nc.flush(timeout=2)
        except Exception as exc:  # noqa: BLE001 (already disconnected: nothing more to tell anyone)
            logger.warning("worker %s: could not say goodbye: %s", self.instance_id, exc)
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server = None
        self._stopped.set()

    def _check_drained(self) -> None:
        done = not self.resident or self._drain_expired
        if self.status == WorkerStatus.DRAINING and done and not self._lock.locked():
            self._tasks.append(asyncio.create_task(self.stop()))

    def step_running_s(self) -> float:
        """How long the engine step now running has been computing (0 when none runs); heartbeats report
        it, so a step that never returns is seen while the heartbeats go on (``shared.leases.step_stuck``)."""
        since = self._computing_since
        return 0.0 if since is None else max(time.monotonic() - since, 1e-6)

    # --- commands --------------------------------------------------------------------------------

    async def _on_command(self, msg) -> None:
        try:
            command = codec.decode(StepCommand, msg.data, self.settings.max_payload_bytes)
        except codec.CodecError as exc:
            self.num_malformed += 1
            self.metrics.malformed.labels(subject="step").inc()
            logger.error("dropping a malformed step command: %s", exc)
            return
        if command.after_step_id:
            late = self.held.hold(command, msg.headers, stopping=self.status == WorkerStatus.STOPPING)
            if late is not None:
                self._run_late(late, msg.headers)
            return
        if command.items:
            self.held.commanded(command)
        self._start(command, msg.headers)

    def _start(self, command: StepCommand, headers: dict | None, continued: bool = False) -> None:
        # the step runs in its own task: the subscription hands over its next message (a conditional
        # command for the step after this one) while this one runs; the lock keeps commands in order
        task = asyncio.create_task(self._execute(command, headers, continued), name=f"step-{command.step_id}")
        self._step_tasks.add(task)
        task.add_done_callback(self._step_tasks.discard)

    def _run_late(self, command: StepCommand, headers: dict | None) -> None:
        """A conditional command that came after its step ended with none in hand, and passed the rule
        (``HeldCommands.hold``): it runs now."""
        self._start(command, headers, continued=True)

    async def _execute(self, command: StepCommand, headers: dict | None, continued: bool = False) -> None:
        try:
            await self._execute_steps(command, headers, continued)
        except Exception:  # noqa: BLE001 (a bug must not stop the worker: the scheduler times the step out)
            logger.exception("step %d failed", command.step_id)
            self.held.failed()

    async def _execute_steps(self, command: StepCommand, headers: dict | None, continued: bool = False) -> None:
        async with self._lock:
            self.held.starting(command)
            for rid in command.drop_request_ids:
                self._forget(rid)
            step: tuple[StepCommand, dict | None] | None = (command, headers)
            while step is not None and step[0].items:
                if step[0] is not command:  # a held command went on: it drops what left the instance
                    for rid in step[0].drop_request_ids:
                        self._forget(rid)
                command, headers = step
                self._step_starting(command, continued)
                # the batched step: a child of the scheduler's step_command span (NATS headers)
                span = self._tracer.start_as_current_span(
                    "worker.step", context=extract_context(headers), kind=SpanKind.CONSUMER,
                    attributes={"dls.instance_id": self.instance_id, "dls.step_id": command.step_id,
                                "dls.batch_size": len(command.items), "dls.continued": continued},
                ) if tracing_active() else nullcontext()
                with span:
                    results = await self._run(command)
                    results, step = self.held.step_ended(command, results, ready=self.status == WorkerStatus.READY,
                                                         listening=self._listening())
                    await self.nc.publish(self._results_subject,
                                          codec.encode(results, self.settings.max_payload_bytes))
                    self._step_published(results)
                continued = True
            self.metrics.resident.set(len(self.resident))
            self._trim_kv()
            self.metrics.kv_used.set(self.engine.kv_memory().used_bytes)
        self._check_drained()

    def _listening(self) -> bool:
        """Subscribed to its commands and connected: only then does a step repeat by itself (with no
        plain command waiting to run)."""
        sub = self._subscription
        return sub is not None and not getattr(sub, "_closed", False) and self.nc.is_connected

    def _step_starting(self, command: StepCommand, continued: bool) -> None:
        """Hook: a step is about to run (``continued``: from a held command, in hand when the step before
        ended, with no round trip; or one that came later, ``_run_late``)."""

    def _step_published(self, results: StepResults) -> None:
        """Hook: a step's results were published."""

    def _forget(self, request_id: str) -> None:
        self.resident.pop(request_id, None)
        self.engine.drop(request_id)

    # --- one step --------------------------------------------------------------------------------

    async def _run(self, command: StepCommand) -> StepResults:
        started = self.clock()
        t0 = time.perf_counter()
        max_batch = self.settings.max_batch
        failures = [StepFailure(request_id=item.request_id, reason=f"batch over max_batch {max_batch}")
                    for item in command.items[max_batch:]]
        ready, loaded = await self._states(command.items[:max_batch], failures)
        ready = self._within_kv_budget(ready, failures)
        ready, outcomes = await self._compute(command, ready, failures, t0)
        duration = time.perf_counter() - t0
        rid_to_stored, rid_to_problem = await self._save(command, ready, outcomes, loaded, started, duration)
        results = []
        for (item, resident), outcome in zip(ready, outcomes, strict=True):
            record = rid_to_stored.get(item.request_id)
            if record is None:
                reason = rid_to_problem.get(item.request_id, "state write failed")
                failures.append(StepFailure(request_id=item.request_id, reason=f"state write failed: {reason}"))
                self._forget(item.request_id)
                continue
            results.append(self._result_of(item, record, outcome))
            self._trace_request_step(record, item, outcome, len(ready), item.request_id in loaded, started,
                                     duration)
            await self.events.publish(record, resident.state, outcome, item.threshold)
            if outcome.finished:
                self._forget(item.request_id)
            else:
                resident.record = record
        self.num_steps += 1
        self._count_step(outcomes, len(loaded), duration)
        return StepResults(
            instance_id=self.instance_id, step_id=command.step_id, results=results, failures=failures,
            started_at=started, duration_s=duration, num_loaded=len(loaded),
        )

    async def _states(self, items: list[StepItem], failures: list[StepFailure]) -> tuple[Ready, set[str]]:
        """(item, local copy) for every item that can step, loading from Redis where needed; and the ids
        of those loaded."""
        to_load = [
            it for it in items
            if it.load_state or (it.request_id not in self.resident)
            or self.resident[it.request_id].record.version != it.state_version
        ]
        loaded: set[str] = set()
        if to_load:
            ids = [it.request_id for it in to_load]
            records = await retry_transient(lambda: self.store.load_many(ids), f"loading {len(ids)} request(s)",
                                            logger)
            for item, record in zip(to_load, records, strict=True):
                self._forget(item.request_id)
                problem = load_problem(item, record)
                if problem:
                    failures.append(StepFailure(request_id=item.request_id, reason=problem))
                    continue
                self.resident[item.request_id] = ResidentRequest(state_of(record), record)
                loaded.add(item.request_id)
        failed = {f.request_id for f in failures}
        ready = [(it, self.resident[it.request_id]) for it in items if it.request_id not in failed]
        return ready, loaded

    def _within_kv_budget(self, ready: Ready, failures: list[StepFailure]) -> Ready:
        """The (item, local copy) pairs whose step fits the KV budget; the others fail as ``KV_FULL``
        (their state is unchanged: the scheduler puts them back in its queue)."""
        over = set(self.engine.kv_overflow([(r.state, item.threshold) for item, r in ready]))
        if not over:
            return ready
        memory = self.engine.kv_memory()
        for item, _ in ready:
            if item.request_id in over:
                failures.append(StepFailure(
                    request_id=item.request_id, kind=FailureKind.KV_FULL,
                    reason=f"KV budget full ({memory.used_bytes} of {memory.budget_bytes} bytes held)"))
        self.metrics.kv_refused.inc(len(over))
        return [(item, r) for item, r in ready if item.request_id not in over]

    async def _compute(self, command: StepCommand, ready: Ready, failures: list[StepFailure],
                       t0: float) -> tuple[Ready, list[StepResult]]:
        """The engine's step of ``ready`` (timed into the online profile, paced, as set): the requests
        that stepped and their outcomes (none when the KV budget refused the step whole)."""
        batch = [(r.state, item.threshold) for item, r in ready]
        if not batch:
            return ready, []
        self._computing_since = time.monotonic()
        try:
            try:
                if self._offload:  # a real forward: off the event loop, so heartbeats and commands keep flowing
                    outcomes = await asyncio.to_thread(self.engine.step, batch)
                else:  # an engine that computes nothing (the zero-compute fake): a thread hop would cost more
                    outcomes = self.engine.step(batch)
            except KVBudgetExceeded as exc:  # refused whole, nothing changed (kv_overflow should have caught it)
                logger.warning("step %d refused by the KV budget: %s", command.step_id, exc)
                failures += [StepFailure(request_id=item.request_id, reason=str(exc), kind=FailureKind.KV_FULL)
                             for item, _ in ready]
                return [], []
            states = [state for state, _ in batch]
            if self.online is not None:
                self._observe(time.perf_counter() - t0, outcomes, states)
            if self.pace is not None:
                await self._pace(t0, outcomes, states)
        finally:
            self._computing_since = None
        return ready, outcomes

    async def _save(self, command: StepCommand, ready: Ready, outcomes: list[StepResult], loaded: set[str],
                    started: float, duration: float) -> tuple[dict[str, RequestRecord], dict[str, str]]:
        """Every stepped request's new record and step record, written with one pipelined versioned
        write: (request id -> its record as stored, request id -> why its write failed)."""
        now = self.clock()
        new_records, new_steps = [], {}  # request id -> its step record
        for (item, resident), outcome in zip(ready, outcomes, strict=True):
            record = advanced(resident.record, resident.state, outcome, item.threshold, instance_id=self.instance_id,
                              mask_id=self.engine.mask_id, eos_id=self.engine.eos_id, now=now)
            new_records.append(record)
            new_steps[item.request_id] = [StepRecord(
                step_index=record.num_steps, instance_id=self.instance_id, kind=outcome.kind,
                block_index=outcome.block_index, threshold=item.threshold,
                committed_positions=list(outcome.committed_positions), batch_size=len(ready),
                loaded_state=item.request_id in loaded, queued=command.num_queued, started_at=started,
                duration_s=duration, confidence=wire_confidence(outcome.confidence),
                predicted_end=outcome.predicted_end,  # for the predictor's retraining on served steps
            )]
        if not new_records:
            return {}, {}
        save = await retry_transient(lambda: self.store.save_many(new_records, new_steps),
                                     f"step {command.step_id}: saving {len(new_records)} request(s)", logger)
        rid_to_stored = {r.request_id: r for r in save.saved}  # request id -> its new version
        rid_to_problem = {e.request_id: str(e) for e in save.stale}  # request id -> why
        rid_to_problem.update({rid: "state missing in Redis" for rid in save.missing_ids})
        return rid_to_stored, rid_to_problem

    def _result_of(self, item: StepItem, stored: RequestRecord, outcome: StepResult) -> RequestStepResult:
        return RequestStepResult(
            request_id=item.request_id, kind=outcome.kind, block_index=outcome.block_index,
            committed_positions=list(outcome.committed_positions),
            committed_token_ids=list(outcome.committed_token_ids),
            block_done=outcome.block_done or outcome.finished,
            finished=outcome.finished, num_steps=stored.num_steps, num_masked=outcome.num_masked,
            confidence=wire_confidence(outcome.confidence), threshold=item.threshold,
            state_version=stored.version, blocks_skipped=outcome.blocks_skipped,
            num_answer_tokens=len(stored.answer(self.engine.eos_id).token_ids) if outcome.finished else 0,
            predicted_end=outcome.predicted_end,
        )

    def _count_step(self, outcomes: list[StepResult], num_loaded: int, duration: float) -> None:
        if outcomes:
            self.metrics.steps.inc()
            self.metrics.batch_size.observe(len(outcomes))
            self.metrics.step_seconds.observe(duration)
            self.metrics.tokens.inc(sum(len(o.committed_positions) for o in outcomes))
            for outcome in outcomes:
                self.metrics.tokens_per_forward.observe(len(outcome.committed_positions))
            self.metrics.blocks_skipped.inc(sum(o.blocks_skipped for o in outcomes))
        self.metrics.loads.inc(num_loaded)

    def _trim_kv(self) -> None:
        """Holding no request: give the KV pool's memory back (it grows again with the next burst)."""
        if not self.resident:
            freed = self.engine.trim_kv()
            if freed:
                logger.debug("worker %s: KV pool trimmed, %d bytes freed", self.instance_id, freed)

    def _observe(self, seconds: float, outcomes, states) -> None:
        """Fold a served step's compute time into the online profile (an uncalibrated model)."""
        contexts, num_cache, no_cache = _shape(outcomes, states)
        self.online.observe(seconds, contexts, num_cache, no_cache=no_cache)

    async def _pace(self, t0: float, outcomes, states) -> None:
        """Stretch the step to what the profile says it takes (``LatencyProfile.batch_step_s``, the
        simulator's step-time model), context-scaled when the pace is anchored (``pace_context_tokens``)."""
        contexts, num_cache, no_cache = _shape(outcomes, states)
        target = self.pace.batch_step_s(self.settings.tp, contexts, num_cache, no_cache=no_cache,
                                        scale_context=bool(self.settings.pace_context_tokens))
        wait = target - (time.perf_counter() - t0)
        self.paced_s += target
        if wait > 0:
            await asyncio.sleep(wait)
        else:
            self.pace_overruns += 1
            self.pace_overrun_s -= wait

    def _trace_request_step(self, record: RequestRecord, item: StepItem, outcome: StepResult, batch_size: int,
                            loaded_state: bool, started: float, duration_s: float) -> None:
        """One span per request-step, in the request's trace (its parent: the admission span named by
        the record's ``trace_context``), linked to this worker's batched ``worker.step`` span."""
        parent = context_of(record.trace_context) if record.trace_context and tracing_active() else None
        if parent is None:
            return
        batch_span = trace.get_current_span().get_span_context()
        start_ns = int(started * 1e9)
        span = self._tracer.start_span(
            "worker.request_step", context=parent, start_time=start_ns,
            links=[trace.Link(batch_span)] if batch_span.is_valid else None,
            attributes={
                "dls.request_id": record.request_id, "dls.instance_id": self.instance_id,
                "dls.threshold": item.threshold, "dls.batch_size": batch_size,
                "dls.step_kind": outcome.kind.name.lower(), "dls.step_index": record.num_steps,
                "dls.tokens_committed": len(outcome.committed_positions), "dls.block_index": outcome.block_index,
                "dls.loaded_state": loaded_state, "dls.finished": bool(outcome.finished),
                "dls.state_version": record.version,
            })
        span.end(end_time=start_ns + int(duration_s * 1e9))


def _shape(outcomes, states) -> tuple[list[int], int, bool]:
    """A step as the profiles time it: the contexts of its full forwards, its number of cache steps, and
    whether its full forwards all ran without a cache."""
    full = [s for s, o in zip(states, outcomes, strict=True) if o.kind == StepKind.RECOMPUTE]
    no_cache = bool(full) and all(s.cache_mode is CacheMode.NONE for s in full)
    return [len(s.prompt_ids) + s.gen_length for s in full], len(outcomes) - len(full), no_cache
