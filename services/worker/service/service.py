"""The worker service: one model instance (TP degree d) that runs the batched steps the scheduler sends.

A thin loop around the engine (``services/worker/engine/engine.py``, or ``tp.py`` for d > 1):

- ``step.<instance>``: a ``StepCommand``. Each item names a request, its threshold and the state
  version the step starts from. The worker steps from its local copy (and KV cache) when it holds
  that version, otherwise it loads the state from Redis (a migration, a restart, a lost result);
  the engine then runs one forward for the whole batch; the new canvas, counters and a
  ``StepRecord`` per request are written back with one pipelined versioned write
  (``StateStore.save_many``); the outcome goes to ``results`` as ``StepResults``. A stale load or
  write becomes a ``StepFailure`` (the state in Redis is unchanged). Commands with no items only
  drop local copies (requests that moved elsewhere). A conditional command (``after_step_id``, sent
  while that step runs) is held and run the moment the step ends if the batch is unchanged: no
  round trip between the two steps (pipelining; the results' ``continued_step_id`` says so). Where
  none had come by then (``awaits_held``), the first one for that step that comes and passes the
  rule runs on arrival (the scheduler judges the same, and expects its results).
- Events: a ``RequestProgress`` per step for streaming requests (``text_delta``: the text of the
  block this step completed) and ``RequestFinished`` with the answer and its ``Usage`` when a request
  finishes; the worker has the tokenizer and the canvas at hand, so it is the one that publishes them.
- ``heartbeat``: a ``WorkerHeartbeat`` lease every ``heartbeat_interval_s``. SIGTERM drains: the
  heartbeat says DRAINING, the scheduler moves the requests away, and the worker exits once it holds
  none (a last STOPPING heartbeat ends the lease at once).
- Pacing (``pace_profile``): a step is stretched to the latency the profile gives for this batch and
  TP degree, so a CPU machine emulates a GPU cluster's timing while the real model picks the tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import nullcontext
from dataclasses import dataclass

import msgspec
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from services.worker.kv.cache import KVBudgetExceeded
from services.worker.service.heartbeat import BeatThread
from services.worker.service.online_profile import OnlineProfile
from shared.calibration import Calibration, of_service, uncalibrated_message
from shared.devices import VISIBLE_DEVICES, DeviceError, cuda_problem, is_cuda
from shared.generation import answer_of, stream_release
from shared.messages import codec
from shared.messages.base import CacheMode, StepKind
from shared.messages.base import ConfidenceStats as WireConfidence
from shared.messages.control import KVMemory as KVMemoryBeat
from shared.messages.control import WorkerHeartbeat, WorkerStatus
from shared.messages.events import RequestFinished, RequestProgress, TokenLogprobs, Usage
from shared.messages.steps import (
    FailureKind,
    RequestStepResult,
    StepCommand,
    StepFailure,
    StepItem,
    StepResults,
)
from shared.metrics import WorkerMetrics, serve_metrics
from shared.pipelining import held_step, next_step
from shared.profiles import LatencyProfile
from shared.retry import retry_transient
from shared.runtime import connect_nats, freeze_startup_heap, on_stop_signals
from shared.settings import WorkerSettings
from shared.state import RequestRecord, RequestStatus, StateStore, StepRecord
from shared.subjects import Subjects, shard_of
from shared.telemetry import (
    context_of,
    extract_context,
    setup_tracing,
    shutdown_tracing,
    tracer,
    tracing_active,
)

logger = logging.getLogger("dls.worker")


@dataclass
class _Local:
    """A request this worker stepped last: its engine state and the record it wrote."""

    state: object  # services.worker.engine.engine.RequestState
    record: RequestRecord  # as stored after this worker's last write (its version is the stored one)


def default_instance_id(settings: WorkerSettings) -> str:
    gpus = "g" + "-".join(map(str, settings.gpu_ids)) if settings.gpu_ids else "cpu"
    return f"{settings.node}-{gpus}-tp{settings.tp}-{os.getpid()}"


class WorkerService:
    """One instance. ``engine`` is a ``DLMEngine`` (or the tensor-parallel one) already loaded."""

    def __init__(
        self,
        settings: WorkerSettings,
        engine,
        nc,
        store: StateStore,
        *,
        instance_id: str | None = None,
        clock: Callable[[], float] | None = None,
        beat_connect: Callable[[], Awaitable] | None = None,
        profile: str = "",
        online: OnlineProfile | None = None,
    ) -> None:
        """``clock``: unix time (default ``time.time``, offset by ``DLS_TEST_CLOCK_OFFSET_S`` when set);
        ``beat_connect``: makes a NATS connection of its own for the periodic heartbeats, which then go
        from a thread of their own (``services.worker.service.heartbeat``: a step that holds the event loop cannot
        delay them); None: they go from a task on this loop over ``nc``. ``profile``: the served model's
        calibrated profile for this device (``shared.calibration``); ``online``: the step times this
        worker measures, which its heartbeats carry when it announces no profile (uncalibrated)."""
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
        self.clock = clock if clock is not None else worker_clock(settings.clock_offset_s)
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
        self.local: dict[str, _Local] = {}  # request id -> its local copy
        self.num_steps = 0
        self.num_malformed = 0
        self.num_heartbeats = 0  # sent by this process (each heartbeat's seq)
        self._beat_lock = threading.Lock()  # numbers heartbeats built on this loop and on the beat thread
        self._beat_connect = beat_connect
        self._beats: BeatThread | None = None
        self._loop_tick = time.monotonic()  # when this event loop last ran its tick task (the beat thread reads it)
        self._wedged_logged = False
        self._computing_since: float | None = None  # time.monotonic() the running engine step began
        self._lock = asyncio.Lock()  # one step at a time
        self._open_steps: set[int] = set()  # steps commanded (or continued into) whose results are not out yet
        self._next: dict[int, tuple[StepCommand, dict | None]] = {}  # open step id -> the command for the step after it
        self.num_continued = 0  # steps run from a held conditional command
        self.num_late_next = 0  # conditional commands that came after their step had ended (and did not run)
        self.num_late_held = 0  # steps run from a conditional command that came after its step had ended
        self.num_repeated = 0  # steps run as a held command's repeat (``StepCommand.repeats``), none in hand
        # the chain: the step ids from the last command the scheduler sent that ran, through the
        # repeats run after it, to the latest (a late held command for one of them applies to the latest)
        self._chain = (0, 0)
        self._commanded: set[int] = set()  # plain commands received, not started yet
        # the last step, if it ended with no conditional command in hand (its results say awaits_held):
        # (its command, its results); the first one for it that comes and passes the rule runs then
        self._awaiting: tuple[StepCommand, StepResults] | None = None
        self._step_tasks: set[asyncio.Task] = set()  # steps running or waiting for the lock
        self._stopped = asyncio.Event()
        self._drain_expired = False  # drain_timeout_s passed: leave between two steps
        self._subscription = None
        self._tasks: list[asyncio.Task] = []
        self.metrics = WorkerMetrics(self.instance_id, model_name=getattr(engine, "name", ""))
        self._metrics_server = None  # the /metrics HTTP server (DLS_METRICS_PORT; None: off)
        self._tracer = tracer("dls.worker")
        # engines declare ``blocking = False`` when a step costs next to nothing (no model)
        self._offload = bool(getattr(engine, "blocking", True))

    @property
    def profile_name(self) -> str:
        """The profile its heartbeats name: the paced one, the configured one, else its calibration's;
        "" when uncalibrated (the heartbeats carry the measured step times instead)."""
        return self.settings.pace_profile or self.settings.profile or self.profile

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._metrics_server = serve_metrics(self.metrics.registry, self.settings.metrics_port,
                                             self.settings.metrics_host)
        self._subscription = await self.nc.subscribe(self.subjects.step(self.instance_id), cb=self._on_command)
        self.status = WorkerStatus.READY
        await self._heartbeat()
        if self._beat_connect is not None:
            self._beats = BeatThread(self._beat_connect, self.subjects.heartbeat, self.settings.heartbeat_interval_s,
                                     self._live_beat_bytes, name=f"heartbeat-{self.instance_id}")
            self._tasks.append(asyncio.create_task(self._tick_loop(), name="loop-tick"))
            self._beats.start()
        else:
            self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
        freeze_startup_heap()  # full GC passes in the step loop skip the start-up heap (torch, the model)
        logger.info("worker %s ready (tp %d, model %s, pace %s)", self.instance_id, self.settings.tp,
                    self.engine.name, self.settings.pace_profile or "off")

    def drain(self) -> None:
        """Stop taking new requests; exit once none is held, or after ``drain_timeout_s`` between two
        steps (SIGTERM calls this). Leaving with requests held loses only their local copies and KV
        caches: their state is in Redis after every step, and the scheduler resumes them elsewhere."""
        if self.status == WorkerStatus.READY:
            logger.info("worker %s draining (%d requests held)", self.instance_id, len(self.local))
            self.status = WorkerStatus.DRAINING
            self._tasks.append(asyncio.create_task(self._heartbeat()))
            self._tasks.append(asyncio.create_task(self._drain_deadline()))
            self._check_drained()

    async def _drain_deadline(self) -> None:
        await asyncio.sleep(self.settings.drain_timeout_s)
        if self.status == WorkerStatus.DRAINING:
            logger.info("worker %s: drain timeout with %d requests held; leaving them to the others",
                        self.instance_id, len(self.local))
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
        if self._beats is not None:
            await asyncio.to_thread(self._beats.stop)
        try:
            await self._heartbeat()
            if self._subscription is not None:
                await self._subscription.unsubscribe()
            await self.nc.flush(timeout=2)
        except Exception as exc:  # noqa: BLE001 (already disconnected: nothing more to tell anyone)
            logger.warning("worker %s: could not say goodbye: %s", self.instance_id, exc)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None
        self._stopped.set()

    def _check_drained(self) -> None:
        done = not self.local or self._drain_expired
        if self.status == WorkerStatus.DRAINING and done and not self._lock.locked():
            self._tasks.append(asyncio.create_task(self.stop()))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                await self._heartbeat()
            except Exception as exc:  # noqa: BLE001 (NATS reconnecting: the next beat retries)
                logger.warning("heartbeat failed: %s", exc)

    async def _heartbeat(self) -> None:
        await self.nc.publish(self.subjects.heartbeat, self._beat_bytes())

    async def _tick_loop(self) -> None:
        while True:
            self._loop_tick = time.monotonic()
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    def _live_beat_bytes(self) -> bytes | None:
        """The beat thread's next heartbeat, or None while this event loop is wedged outside any step: not
        ticked for a lease while no engine step computes. A step that holds the loop keeps the lease (its
        ``step_running_s`` reports it, and the scheduler's step timeout deals with a step that never
        returns); a loop stuck anywhere else lets the lease lapse, as a silent worker's does."""
        wedged = self._computing_since is None and time.monotonic() - self._loop_tick > self.settings.lease_ttl_s
        if wedged != self._wedged_logged:
            self._wedged_logged = wedged
            (logger.warning if wedged else logger.info)(
                "worker %s: event loop %s", self.instance_id,
                "wedged outside any step: heartbeats withheld" if wedged else "answers again: heartbeats resume")
        return None if wedged else self._beat_bytes()

    def _beat_bytes(self) -> bytes:
        """The next heartbeat, encoded (called on this loop and on the beat thread: numbered under a lock)."""
        with self._beat_lock:
            beat = WorkerHeartbeat(
                instance_id=self.instance_id, node=self.settings.node, tp=self.settings.tp,
                gpu_ids=list(self.settings.gpu_ids), max_batch=self.settings.max_batch, model=self.engine.name,
                profile=self.profile_name, profile_scale=self.settings.pace_scale if self.pace else 1.0,
                profile_context_tokens=(self.settings.pace_context_tokens or 0) if self.pace else 0,
                status=self.status, num_resident=len(self.local),
                ttl_s=self.settings.lease_ttl_s, sent_at=self.clock(), started_at=self.started_at,
                metrics_port=self._metrics_server.server_port if self._metrics_server is not None else 0,
                shard=self.shard, seq=self.num_heartbeats + 1, step_running_s=self.step_running_s(),
                kv=self.kv_beat(), measured=self.online.wire() if self.online is not None else None,
            )
            self.num_heartbeats += 1
        return codec.encode(beat, self.settings.max_payload_bytes)

    def step_running_s(self) -> float:
        """How long the engine step now running has been computing (0 when none runs); heartbeats report
        it, so a step that never returns is seen while the heartbeats go on (``shared.leases.step_stuck``)."""
        since = self._computing_since
        return 0.0 if since is None else max(time.monotonic() - since, 1e-6)

    # --- steps -----------------------------------------------------------------------------------

    async def _on_command(self, msg) -> None:
        try:
            command = codec.decode(StepCommand, msg.data, self.settings.max_payload_bytes)
        except codec.CodecError as exc:
            self.num_malformed += 1
            self.metrics.malformed.labels(subject="step").inc()
            logger.error("dropping a malformed step command: %s", exc)
            return
        if command.after_step_id:
            self._hold_next(command, msg.headers)
            return
        if command.items:
            self._awaiting = None  # the scheduler decided the next step itself
            self._open_steps.add(command.step_id)
            self._chain = (command.step_id, command.step_id)
            self._commanded.add(command.step_id)  # until it runs, the running step does not repeat
        self._start(command, msg.headers)

    def _start(self, command: StepCommand, headers: dict | None, continued: bool = False) -> None:
        # the step runs in its own task: the subscription hands over its next message (a conditional
        # command for the step after this one) while this one runs; the lock keeps commands in order
        task = asyncio.create_task(self._execute(command, headers, continued), name=f"step-{command.step_id}")
        self._step_tasks.add(task)
        task.add_done_callback(self._step_tasks.discard)

    async def _execute(self, command: StepCommand, headers: dict | None, continued: bool = False) -> None:
        try:
            await self._execute_steps(command, headers, continued)
        except Exception:  # noqa: BLE001 (a bug must not stop the worker: the scheduler times the step out)
            logger.exception("step %d failed", command.step_id)
            self._open_steps.clear()  # nothing held goes on after a step that failed this way
            self._next.clear()
            self._awaiting = None

    async def _execute_steps(self, command: StepCommand, headers: dict | None, continued: bool = False) -> None:
        async with self._lock:
            self._commanded.discard(command.step_id)
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
                    step = self._take_next(command, results)
                    if step is not None:
                        results = msgspec.structs.replace(results, continued_step_id=step[0].step_id)
                        self.num_continued += 1
                    elif self._awaiting is not None and self._awaiting[0] is command:
                        results = msgspec.structs.replace(results, awaits_held=True)
                    await self.nc.publish(self._results_subject,
                                          codec.encode(results, self.settings.max_payload_bytes))
                    self._step_published(results)
                continued = True
            self.metrics.resident.set(len(self.local))
            self._trim_kv()
            kv = getattr(self.engine, "kv_cache_bytes", None)
            if kv is not None:
                self.metrics.kv_used.set(kv)
        self._check_drained()

    # --- pipelining: the scheduler's command for the step after the running one -------------------

    def _hold_next(self, command: StepCommand, headers: dict | None) -> None:
        """Keep a conditional command until the step it follows ends; one for an earlier step of the
        running chain (the worker repeated since) until the chain's step ends. One that comes after
        that step ended with none in hand runs now if it passes the rule (the scheduler, judging the
        same on the results, expects it); any other late one is dropped (its step's results have gone
        out saying the worker did not go on)."""
        after = command.after_step_id
        first, latest = self._chain
        if after in self._open_steps:
            self._next[after] = (command, headers)
        elif first <= after < latest and latest in self._open_steps:
            self._next[latest] = (command, headers)  # rebased onto it when it ends
        elif self._awaiting is not None and first <= after <= self._awaiting[0].step_id == latest:
            self._run_late(command, headers)
        else:
            self.num_late_next += 1

    def _run_late(self, held: StepCommand, headers: dict | None) -> None:
        """A conditional command that came after its step ended with none in hand: run it if it passes
        the rule; else a later one for the same step may still (the scheduler sent them in order)."""
        step, results = self._awaiting
        nxt = held_step(step, held, results.results, len(results.failures))
        if nxt is None or self.status == WorkerStatus.STOPPING:  # stopping: the scheduler hears it leave
            self.num_late_next += 1
            return
        self._awaiting = None
        self.num_late_held += 1
        self._open_steps.add(nxt.step_id)
        self._chain = (nxt.step_id, nxt.step_id)
        self._start(nxt, headers, continued=True)

    def _take_next(self, command: StepCommand, results: StepResults) -> tuple[StepCommand, dict | None] | None:
        """The held command for the step after ``command``'s, if nothing about the batch changed
        (``shared.pipelining.next_step``); with none in hand, the step once more where its command
        allows (``repeats``), else it awaits one (``_run_late``)."""
        held = self._next.pop(command.step_id, None)
        self._open_steps.discard(command.step_id)  # a conditional command arriving from here on is late
        if self.status != WorkerStatus.READY:
            return None
        if held is None and (self._commanded or not self._listening()):
            nxt = None  # the scheduler sent the next step itself, or cannot be heard: no repeat
        else:
            nxt = next_step(command, held[0] if held is not None else None, results.results, len(results.failures))
        if nxt is None:
            if held is None and command.items:
                self._awaiting = (command, results)
            return None
        self._open_steps.add(nxt.step_id)
        if held is None:  # a repeat: the chain goes on
            self.num_repeated += 1
            self._chain = (self._chain[0], nxt.step_id)
            return nxt, None
        self._chain = (nxt.step_id, nxt.step_id)
        return nxt, held[1]

    def _listening(self) -> bool:
        """Subscribed to its commands and connected: only then does a step repeat by itself (with no
        plain command waiting to run: ``_commanded``)."""
        sub = self._subscription
        return sub is not None and not getattr(sub, "_closed", False) and self.nc.is_connected

    def _step_starting(self, command: StepCommand, continued: bool) -> None:
        """Hook: a step is about to run (``continued``: from a held command, in hand when the step before
        ended, with no round trip; or one that came later, ``_run_late``)."""

    def _step_published(self, results: StepResults) -> None:
        """Hook: a step's results were published."""

    def _forget(self, request_id: str) -> None:
        self.local.pop(request_id, None)
        self.engine.drop(request_id)

    async def _run(self, command: StepCommand) -> StepResults:
        started = self.clock()
        t0 = time.perf_counter()
        failures: list[StepFailure] = []
        items = command.items[: self.settings.max_batch]
        for item in command.items[self.settings.max_batch:]:
            failures.append(StepFailure(request_id=item.request_id, reason=f"batch over max_batch {self.settings.max_batch}"))
        ready, loaded = await self._states(items, failures)
        ready = self._within_kv_budget(ready, failures)
        batch = [(local.state, item.threshold) for item, local in ready]
        self._computing_since = time.monotonic() if batch else None
        try:
            if not batch:
                outcomes = []
            else:
                try:
                    if self._offload:  # a real forward: off the event loop, so heartbeats and commands keep flowing
                        outcomes = await asyncio.to_thread(self.engine.step, batch)
                    else:  # an engine that computes nothing (the zero-compute fake): a thread hop would cost more
                        outcomes = self.engine.step(batch)
                except KVBudgetExceeded as exc:  # refused whole, nothing changed (kv_overflow should have caught it)
                    logger.warning("step %d refused by the KV budget: %s", command.step_id, exc)
                    failures += [StepFailure(request_id=item.request_id, reason=str(exc), kind=FailureKind.KV_FULL)
                                 for item, _ in ready]
                    ready, batch, outcomes = [], [], []
            if self.online is not None and batch:
                self._observe(time.perf_counter() - t0, outcomes, [state for state, _ in batch])
            if self.pace is not None and batch:
                await self._pace(t0, outcomes, [state for state, _ in batch])
        finally:
            self._computing_since = None
        duration = time.perf_counter() - t0
        now = self.clock()
        new_records, new_steps = [], {}  # request id -> its step record
        for (item, local), outcome in zip(ready, outcomes, strict=True):
            record = self._advance(local.record, outcome, item, now)
            new_records.append(record)
            new_steps[item.request_id] = [StepRecord(
                step_index=record.num_steps, instance_id=self.instance_id, kind=outcome.kind,
                block_index=outcome.block_index, threshold=item.threshold,
                committed_positions=list(outcome.committed_positions), batch_size=len(batch),
                loaded_state=item.request_id in loaded, queued=command.num_queued, started_at=started,
                duration_s=duration,
                confidence=_wire_confidence(outcome.confidence),
                predicted_end=outcome.predicted_end,  # for the predictor's retraining on served steps
            )]
        save = await retry_transient(lambda: self.store.save_many(new_records, new_steps),
                                     f"step {command.step_id}: saving {len(new_records)} request(s)",
                                     logger) if new_records else None
        rid_to_stored = {r.request_id: r for r in save.saved} if save else {}  # request id -> new version
        rid_to_problem = {e.request_id: str(e) for e in save.stale} if save else {}  # request id -> why
        rid_to_problem.update({rid: "state missing in Redis" for rid in (save.missing_ids if save else [])})
        results = []
        for (item, local), outcome in zip(ready, outcomes, strict=True):
            stored = rid_to_stored.get(item.request_id)
            if stored is None:
                reason = rid_to_problem.get(item.request_id, "state write failed")
                failures.append(StepFailure(request_id=item.request_id, reason=f"state write failed: {reason}"))
                self._forget(item.request_id)
                continue
            block_start, block_end = local.state.block_bounds(outcome.block_index)
            block_done = self.engine.mask_id not in local.state.canvas[block_start:block_end]
            results.append(RequestStepResult(
                request_id=item.request_id, kind=outcome.kind, block_index=outcome.block_index,
                committed_positions=list(outcome.committed_positions),
                committed_token_ids=list(outcome.committed_token_ids), block_done=block_done or outcome.finished,
                finished=outcome.finished, num_steps=stored.num_steps, num_masked=outcome.num_masked,
                confidence=_wire_confidence(outcome.confidence), threshold=item.threshold,
                state_version=stored.version, blocks_skipped=outcome.blocks_skipped,
                num_answer_tokens=len(stored.answer(self.engine.eos_id).token_ids) if outcome.finished else 0,
                predicted_end=outcome.predicted_end,
            ))
            self._trace_request_step(stored, item, outcome, len(batch), item.request_id in loaded, started,
                                     duration)
            await self._publish_events(stored, local, outcome, block_done, item)
            if outcome.finished:
                self._forget(item.request_id)
            else:
                local.record = stored
        self.num_steps += 1
        if batch:
            self.metrics.steps.inc()
            self.metrics.batch_size.observe(len(batch))
            self.metrics.step_seconds.observe(duration)
            self.metrics.tokens.inc(sum(len(o.committed_positions) for o in outcomes))
            for outcome in outcomes:
                self.metrics.tokens_per_forward.observe(len(outcome.committed_positions))
            self.metrics.blocks_skipped.inc(sum(o.blocks_skipped for o in outcomes))
        self.metrics.loads.inc(len(loaded))
        return StepResults(
            instance_id=self.instance_id, step_id=command.step_id, results=results, failures=failures,
            started_at=started, duration_s=duration, num_loaded=len(loaded),
        )

    def _within_kv_budget(self, ready: list, failures: list[StepFailure]) -> list:
        """The (item, local copy) pairs whose step fits the KV budget; the others fail as ``KV_FULL``
        (their state is unchanged: the scheduler puts them back in its queue)."""
        overflow = getattr(self.engine, "kv_overflow", None)
        over = set(overflow([(local.state, item.threshold) for item, local in ready])) if overflow else set()
        if not over:
            return ready
        memory = self.engine.kv_memory()
        for item, _ in ready:
            if item.request_id in over:
                failures.append(StepFailure(
                    request_id=item.request_id, kind=FailureKind.KV_FULL,
                    reason=f"KV budget full ({memory.used_bytes} of {memory.budget_bytes} bytes held)"))
        self.metrics.kv_refused.inc(len(over))
        return [(item, local) for item, local in ready if item.request_id not in over]

    def _trim_kv(self) -> None:
        """Holding no request: give the KV pool's memory back (it grows again with the next burst)."""
        trim = getattr(self.engine, "trim_kv", None)
        if trim is not None and not self.local:
            freed = trim()
            if freed:
                logger.debug("worker %s: KV pool trimmed, %d bytes freed", self.instance_id, freed)

    def kv_beat(self) -> KVMemoryBeat | None:
        """The KV pool as the heartbeat reports it (plain counter reads: safe from the beat thread)."""
        memory_of = getattr(self.engine, "kv_memory", None)
        if memory_of is None:
            return None
        m = memory_of()
        return KVMemoryBeat(
            budget_bytes=m.budget_bytes, pool_bytes=m.pool_bytes, used_bytes=m.used_bytes, free_bytes=m.free_bytes,
            used_tokens=m.used_tokens, free_tokens=m.free_bytes // m.bytes_per_token if m.bytes_per_token else 0,
            capacity_tokens=m.capacity_tokens(self.settings.max_batch), bytes_per_token=m.bytes_per_token,
            page_tokens=m.page_tokens)

    async def _states(self, items: list[StepItem], failures: list[StepFailure]):
        """(item, local copy) for every item that can step, loading from Redis where needed."""
        to_load = [
            it for it in items
            if it.load_state or (it.request_id not in self.local)
            or self.local[it.request_id].record.version != it.state_version
        ]
        loaded: set[str] = set()
        if to_load:
            ids = [it.request_id for it in to_load]
            records = await retry_transient(lambda: self.store.load_many(ids), f"loading {len(ids)} request(s)",
                                            logger)
            for item, record in zip(to_load, records, strict=True):
                self._forget(item.request_id)
                problem = _load_problem(item, record)
                if problem:
                    failures.append(StepFailure(request_id=item.request_id, reason=problem))
                    continue
                self.local[item.request_id] = _Local(self._state_of(record), record)
                loaded.add(item.request_id)
        failed = {f.request_id for f in failures}
        ready = [(it, self.local[it.request_id]) for it in items if it.request_id not in failed]
        return ready, loaded

    def _trace_request_step(self, record: RequestRecord, item: StepItem, outcome, batch_size: int,
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

    def _state_of(self, record: RequestRecord):
        from services.worker.decoding.sampling import SamplingParams
        from services.worker.engine.engine import RequestState

        return RequestState(
            record.request_id, list(record.prompt_token_ids), list(record.canvas), record.block_length,
            record.cache_mode, num_steps=record.num_steps, ignore_eos=record.ignore_eos,
            sampling=SamplingParams(record.temperature, record.top_p, record.top_k, record.seed),
            num_top_logprobs=record.logprobs or 0, stop=tuple(record.stop), max_tokens=record.max_tokens,
            confidences=list(record.confidences), top_token_ids=[list(ids) for ids in record.top_token_ids],
            top_probs=[list(probs) for probs in record.top_probs], stop_length=record.stop_length,
        )

    def _advance(self, record: RequestRecord, outcome, item: StepItem, now: float) -> RequestRecord:
        state = self.local[item.request_id].state
        history = list(record.instance_history)
        if self.instance_id not in history:
            history.append(self.instance_id)
        moved = record.last_instance_id is not None and record.last_instance_id != self.instance_id
        changes = dict(
            canvas=list(state.canvas), num_steps=record.num_steps + 1,
            num_committed=len(state.canvas) - state.canvas.count(self.engine.mask_id),
            current_block=_current_block(state, self.engine.mask_id),
            threshold_history=[*record.threshold_history, item.threshold], last_instance_id=self.instance_id,
            instance_history=history, num_migrations=record.num_migrations + int(moved),
            num_recompute_steps=record.num_recompute_steps + int(outcome.kind == StepKind.RECOMPUTE),
            status=RequestStatus.RUNNING, confidences=list(state.confidences), stop_length=state.stop_length,
        )
        if record.logprobs:
            changes.update(top_token_ids=[list(ids) for ids in state.top_token_ids],
                           top_probs=[list(probs) for probs in state.top_probs])
        if outcome.finished:
            answer = answer_of(state.canvas, self.engine.eos_id, record.max_tokens, record.ignore_eos,
                               state.stop_length)
            changes.update(status=RequestStatus.FINISHED, finished_at=now, finish_reason=answer.finish_reason)
        return msgspec.structs.replace(record, **changes)

    def _observe(self, seconds: float, outcomes, states) -> None:
        """Fold a served step's compute time into the online profile (an uncalibrated model)."""
        full = [s for s, o in zip(states, outcomes, strict=True) if o.kind == StepKind.RECOMPUTE]
        self.online.observe(seconds, [len(s.prompt_ids) + s.gen_length for s in full], len(outcomes) - len(full),
                            no_cache=bool(full) and all(s.cache_mode is CacheMode.NONE for s in full))

    async def _pace(self, t0: float, outcomes, states) -> None:
        """Stretch the step to what the profile says it takes (``LatencyProfile.batch_step_s``, the
        simulator's step-time model), context-scaled when the pace is anchored (``pace_context_tokens``)."""
        full = [s for s, o in zip(states, outcomes, strict=True) if o.kind == StepKind.RECOMPUTE]  # full forwards
        target = self.pace.batch_step_s(
            self.settings.tp, [len(s.prompt_ids) + s.gen_length for s in full], len(outcomes) - len(full),
            no_cache=bool(full) and all(s.cache_mode is CacheMode.NONE for s in full),
            scale_context=bool(self.settings.pace_context_tokens))
        wait = target - (time.perf_counter() - t0)
        self.paced_s += target
        if wait > 0:
            await asyncio.sleep(wait)
        else:
            self.pace_overruns += 1
            self.pace_overrun_s -= wait

    # --- events ----------------------------------------------------------------------------------

    async def _publish_events(self, record: RequestRecord, local: _Local, outcome, block_done: bool, item) -> None:
        subject = self.subjects.events(record.request_id)
        limit = self.settings.max_payload_bytes
        if record.stream:
            delta, delta_ids, logprobs = "", [], None
            if block_done or outcome.finished:
                delta, delta_ids, logprobs = self._stream_delta(record, local.state, outcome)
            progress = RequestProgress(
                request_id=record.request_id, seq=record.num_steps + 1, num_steps=record.num_steps,
                block_index=outcome.block_index, committed_positions=list(outcome.committed_positions),
                committed_token_ids=list(outcome.committed_token_ids), num_committed=record.num_committed,
                gen_length=record.gen_length, text_delta=delta, threshold=item.threshold,
                instance_id=self.instance_id, delta_token_ids=delta_ids, logprobs=logprobs,
            )
            await self.nc.publish(subject, codec.encode(progress, limit))
        if outcome.finished:
            tokens = record.answer(self.engine.eos_id).token_ids
            latency = (record.finished_at or self.clock()) - record.arrival_time
            usage = Usage(
                prompt_tokens=len(record.prompt_token_ids), completion_tokens=len(tokens),
                num_steps=record.num_steps, num_recompute_steps=record.num_recompute_steps,
                thresholds=list(record.threshold_history), instance_ids=list(record.instance_history),
                num_migrations=record.num_migrations, latency_s=latency,
                slo_met=latency * 1000.0 <= record.slo_ms,
            )
            finished = RequestFinished(
                request_id=record.request_id, seq=record.num_steps + 2, text=self._text(tokens),
                token_ids=tokens, finish_reason=record.finish_reason or "stop", usage=usage,
                logprobs=record.token_logprobs(0, len(tokens)),
            )
            await self.nc.publish(subject, codec.encode(finished, limit))

    def _stream_delta(self, record: RequestRecord, state, outcome) -> tuple[str, list[int], TokenLogprobs | None]:
        """The text a stream gets at this step (its block done, or the request finished): the answer's
        tokens in the canvas up to the block's end, less what the step that completed the block before
        released, less (until the end) the last tokens a stop string could still take back."""
        start, end = state.block_bounds(outcome.block_index)
        eos = self.engine.eos_id
        if outcome.finished:
            tokens = record.answer(eos).token_ids
        else:
            tokens = answer_of(record.canvas[:end], eos, record.max_tokens, record.ignore_eos).token_ids
        before = answer_of(record.canvas[:start], eos, record.max_tokens, record.ignore_eos).token_ids
        released_before = stream_release(len(before), record.stop, finished=False)
        released = max(stream_release(len(tokens), record.stop, outcome.finished), released_before)
        text = self._text(tokens[:released])[len(self._text(tokens[:released_before])):]
        return text, tokens[released_before:released], record.token_logprobs(released_before, released)

    def _text(self, ids: list[int]) -> str:
        return self.engine.decode([i for i in ids if i != self.engine.mask_id])


def worker_clock(offset_s: float) -> Callable[[], float]:
    """``time.time``, or (tests only: ``DLS_TEST_CLOCK_OFFSET_S``) a clock ``offset_s`` off it, as on a host
    whose clock is wrong; leases never depend on it (``shared.leases``)."""
    if not offset_s:
        return time.time
    logger.warning("worker clock offset by %+.1f s (DLS_TEST_CLOCK_OFFSET_S)", offset_s)
    return functools.partial(_offset_time, offset_s)


def _offset_time(offset_s: float) -> float:
    return time.time() + offset_s


def _current_block(state, mask_id: int) -> int:
    if mask_id not in state.canvas:
        return state.num_blocks
    return state.canvas.index(mask_id) // state.block_length


def _load_problem(item: StepItem, record: RequestRecord | None) -> str:
    if record is None:
        return "state missing in Redis (expired or never stored)"
    if record.is_terminal:
        return f"request is {record.status.name}"
    if record.version != item.state_version:
        return f"stale state: command names version {item.state_version}, Redis holds {record.version}"
    return ""


def _wire_confidence(stats) -> WireConfidence:
    return WireConfidence(min=stats.min, q25=stats.q25, median=stats.median, mean=stats.mean, q75=stats.q75)


# --- process entry -----------------------------------------------------------------------------


def make_engine(settings: WorkerSettings):
    """The instance's engine: a plain ``DLMEngine`` at TP 1, a ``TensorParallelEngine`` above; the model's
    tokenizer code runs only with ``DLS_TRUST_REMOTE_CODE`` (as in the gateway)."""
    from services.worker.parallel.tp_engine import make_engine as make_any_engine

    return make_any_engine(settings.model_dir, settings.tp, settings.device,
                           trust_remote_code=settings.trust_remote_code)


def kv_budget_bytes(settings: WorkerSettings) -> int:
    """The KV pool's byte budget per GPU: ``kv_budget_bytes``, else on CUDA ``kv_memory_fraction`` of the
    memory free now (the model loaded), else 0 (no cap)."""
    if settings.kv_budget_bytes:
        return settings.kv_budget_bytes
    import torch

    device = torch.device(settings.device)
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * settings.kv_memory_fraction)


def check_device(settings: WorkerSettings) -> None:
    """``DeviceError`` naming the setting when the instance's GPUs are not there (before loading anything)."""
    problem = cuda_problem(settings.device, settings.tp)
    if problem:
        raise DeviceError(f"DLS_WORKER_DEVICE={settings.device} (TP {settings.tp}): {problem}")


def served_calibration(settings: WorkerSettings) -> Calibration | None:
    """The calibration of the served model (``CalibrationMismatch`` naming what differs when it was made
    for other weights), or None: uncalibrated (said)."""
    calibration = of_service(settings)
    if calibration is None:
        logger.warning(uncalibrated_message(settings.model_dir))
    else:
        logger.info("calibration %s", calibration.label)
    return calibration


def served_profile(settings: WorkerSettings, calibration: Calibration | None,
                   engine) -> tuple[str, OnlineProfile | None]:
    """(the calibration's profile, None) or, for a worker that names no profile of its own and serves an
    uncalibrated model (or one whose profile was measured on another kind of device or GPU: refused,
    said), ("", the step times measured now, kept current as it serves)."""
    if settings.pace_profile or settings.profile:
        return "", None
    if calibration is not None:
        from services.worker.profiling import device_name

        refusal = calibration.profile_refusal(settings.device, device_name(settings.device))
        if refusal is None:
            return str(calibration.profile_path), None
        logger.warning("%s; this worker measures its step times instead", refusal)
    return "", OnlineProfile.measured(engine, settings.max_batch)


async def warm_up(engine) -> None:
    """The engine's first forwards (and whatever it prepares then), in a thread, before the worker
    heartbeats READY: the first request served must not pay for them."""
    started = time.perf_counter()
    await asyncio.to_thread(engine.warm_up)
    logger.info("engine warmed up in %.2f s", time.perf_counter() - started)


async def serve(settings: WorkerSettings) -> None:

    from services.worker.parallel.placement import rank_gpus
    from shared.state import RedisStateStore

    check_device(settings)
    calibration = served_calibration(settings)  # refused before the model loads when made for another
    setup_tracing("dls-worker", settings)
    engine = await asyncio.to_thread(make_engine, settings)
    logger.info("engine on %s: GPUs %s of the machine (%s=%s)", settings.device,
                rank_gpus(settings.device, settings.tp) if is_cuda(settings.device) else "none", VISIBLE_DEVICES,
                os.environ.get(VISIBLE_DEVICES, "unset"))
    budget = kv_budget_bytes(settings)
    if budget:
        engine.set_kv_budget(budget)
        logger.info("KV cache budget: %d bytes per GPU", budget)
    await warm_up(engine)
    profile, online = await asyncio.to_thread(served_profile, settings, calibration, engine)
    nc = await connect_nats(settings, "dls-worker")
    store = RedisStateStore.from_url(settings.redis_url, settings.redis_key_prefix)
    service = WorkerService(settings, engine, nc, store,
                            beat_connect=functools.partial(connect_nats, settings, "dls-worker-heartbeat"),
                            profile=profile, online=online)
    on_stop_signals(service.drain)
    await service.start()
    try:
        await service.wait_stopped()
    finally:
        await nc.drain()
        await store.close()
        if hasattr(engine, "close"):
            engine.close()
        overruns = (f", {service.pace_overruns} over their paced time (by {service.pace_overrun_s:.1f} s in all, "
                    f"{service.paced_s:.1f} s paced)") if service.pace is not None else ""
        logger.info("worker %s stopped after %d steps%s", service.instance_id, service.num_steps, overruns)
        shutdown_tracing()

