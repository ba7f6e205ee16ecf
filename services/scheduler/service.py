"""The scheduler service: the scheduling core's ``SchedulingLoop`` over NATS, request state in Redis.

Inputs, each turned into one call of the core (``services/scheduler/core``):

- intake (JetStream work queue): ``StateStore.create``, then ack, then ``RequestAccepted``, then
  ``SchedulingLoop.on_arrivals`` (one pass per fetched batch);
- ``results``: workers' ``StepResults``, coalesced (all those received before the loop turns) ->
  one ``on_step_results``; asynchronous predictions for the requests that stepped (one ``predict``
  request/reply per pass, paused ``PREDICTOR_RETRY_S`` after a call that got no reply) ->
  ``on_prediction`` when they arrive;
- ``heartbeat``: worker leases -> instances added to (or drained from, or failed out of) the view,
  then ``tick``; a lease that expires fails the instance: its requests go back to the queue and
  resume elsewhere from their state in Redis;
- ``cancel``: ``view.cancel_request`` and a versioned CANCELLED write.

Outputs: a ``StepCommand`` per idle instance with runnable requests (``step.<instance>``; the items
name the state version each step starts from, and ``load_state`` when the instance does not hold the
request's latest state: a migration); ``drop_request_ids`` to the instance a request left;
``RequestFailed`` for rejections and cancellations; ``WorkloadStats`` every ``stats_interval_s``.

On start the service resumes every in-flight request found in Redis (a restarted scheduler).
Everything runs on one asyncio loop and every core call is synchronous, so the view is never seen
half-updated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind

from services.scheduler.core import (
    BatchOutcome,
    CacheMode,
    Decisions,
    Prediction,
    Request,
    RequestStatus,
    SchedulingLoop,
    StepOutcome,
    make_config,
    make_policy,
)
from services.scheduler.core.decisions import RejectReason
from services.scheduler.core.threshold import within_quality_budgets
from shared.jetstream import IntakeConsumer, IntakeDelivery, ensure_intake_stream
from shared.leases import LeaseTable, Observed, step_stuck
from shared.messages import codec
from shared.messages.control import Arrival, WorkerHeartbeat, WorkerStatus, WorkloadStats
from shared.messages.events import FailureReason, RequestAccepted, RequestFailed
from shared.messages.intake import CancelRequest, CompletionRequest
from shared.messages.predictor import PredictionQuery, PredictReply, PredictRequest
from shared.messages.steps import StepCommand, StepItem, StepResults
from shared.metrics import SchedulerMetrics, predictor_error, serve_metrics
from shared.profiles import LatencyProfile, ProfileError
from shared.retry import retry_transient
from shared.runtime import connect_nats, freeze_startup_heap, on_stop_signals
from shared.settings import SchedulerSettings
from shared.state import RequestRecord, StaleStateError, StateStore
from shared.state import RequestStatus as StoredStatus
from shared.subjects import Subjects, shard_of
from shared.telemetry import (
    context_of,
    extract_context,
    header_context,
    link_to,
    setup_tracing,
    shutdown_tracing,
    traceparent_of,
    tracer,
    tracing_active,
)

logger = logging.getLogger("dls.scheduler")

_RUNNABLE = (RequestStatus.RUNNING, RequestStatus.MIGRATING)
PREDICTOR_RETRY_S = 1.0  # after a predict call that got no reply (no predictor, timeout), pause this long
_REJECT_TO_FAILURE = {  # the core's reason -> the wire's
    RejectReason.DEADLINE_INFEASIBLE: FailureReason.DEADLINE_INFEASIBLE,
    RejectReason.FLOOR_UNSATISFIABLE: FailureReason.FLOOR_UNSATISFIABLE,
    RejectReason.NO_INSTANCE: FailureReason.NO_INSTANCE,
}


@dataclass
class _Tracked:
    """What the service knows about a live request besides the core's view."""

    version: int  # stored state version its next step starts from
    prompt_len: int
    gen_len: int
    block_len: int
    uses_cache: bool
    num_steps: int = 0
    num_committed: int = 0
    block_index: int = -1  # the block its last step decoded
    block_committed: int = 0  # committed positions of that block
    block_size: int = 0
    confidence: tuple | None = None
    threshold: float | None = None
    holder_id: str | None = None  # the instance holding its latest state (local copy, KV cache)
    resyncing: bool = False  # its last step failed: reload its state before the next
    trace_context: str = ""  # traceparent of its admission span (parent of its spans); "": not traced
    # its first prediction, kept for the predictor-error metric: (made at step, threshold -> remaining steps)
    first_prediction: tuple[int, dict[float, int]] | None = None
    threshold_sum: float = 0.0  # thresholds of its steps since that prediction, summed
    num_threshold_steps: int = 0  # and counted
    model: str = ""  # the model_name label of its serving metrics
    arrival_time: float = 0.0  # unix time (s) the gateway accepted it
    first_output_at: float | None = None  # when its first block was committed (TTFT)
    last_output_at: float | None = None  # when its latest block was committed (inter-token latency)


@dataclass
class _Worker:
    """A leased instance."""

    heartbeat: WorkerHeartbeat
    busy_step_id: int | None = None  # the command in flight
    busy_since: float = 0.0  # when that command was sent (a step past step_timeout_s is lost)
    in_flight_ids: list[str] = field(default_factory=list)  # its requests
    drop_ids: list[str] = field(default_factory=list)  # to drop with the next command
    # pipelining: the conditional commands sent for the step after the one in flight (the worker runs
    # the latest that reached it before the step ended): step id -> ((request id, threshold, may start
    # a block) items, whether finished requests may be left out); and the latest one's id (0: none)
    next_sent: dict[int, tuple[list[tuple[str, float, bool]], bool]] = field(default_factory=dict)
    next_step_id: int = 0


def load_policy(settings: SchedulerSettings):
    config = {}
    if settings.policy_config:
        path = Path(settings.policy_config)
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"DLS_SCHEDULER_POLICY_CONFIG: cannot read {path}: {exc}") from None
    config_cls = type(make_config(settings.policy))
    if "thresholds" in config_cls.model_fields and "thresholds" not in config:
        config["thresholds"] = candidate_thresholds(settings)
    return make_policy(settings.policy, config)


def candidate_thresholds(settings: SchedulerSettings) -> tuple[float, ...]:
    """``DLS_SCHEDULER_THRESHOLDS`` within ``DLS_SCHEDULER_QUALITY_BUDGET_PP`` accuracy points of the
    highest's on each of the served model's measured curves (``quality.json`` beside its weights,
    written with its model card by ``bench.model_card``: the short families' mix and each task family
    as served), so that no family loses more than the budget; all of them when the budget is negative
    or the model has no curve."""
    thresholds = tuple(settings.thresholds)
    if settings.quality_budget_pp < 0:
        return thresholds
    path = Path(settings.model_dir) / "quality.json"
    try:
        data = json.loads(path.read_text())
        curves = [data["accuracy"], *data.get("families", {}).values()]
    except FileNotFoundError:
        logger.info("no %s: every threshold of %s is a candidate", path, list(thresholds))
        return thresholds
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"DLS_SCHEDULER_QUALITY_BUDGET_PP: cannot read the accuracy curve {path}: {exc}") from None
    try:
        kept = within_quality_budgets(thresholds, [{float(t): float(a) for t, a in c.items()} for c in curves],
                                      settings.quality_budget_pp)
    except ValueError as exc:
        raise ValueError(f"DLS_SCHEDULER_QUALITY_BUDGET_PP: {exc}") from None
    logger.info("candidate thresholds %s (within %.2f accuracy points on %s)", list(kept),
                settings.quality_budget_pp, path)
    return kept


class SchedulerService:
    def __init__(
        self,
        settings: SchedulerSettings,
        nc,
        js,
        store: StateStore,
        *,
        policy=None,
        mask_token_id: int = 1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.nc = nc
        self.js = js
        self.store = store
        self.subjects = Subjects(settings.subject_prefix)
        self.loop = SchedulingLoop(policy if policy is not None else load_policy(settings))
        self.view = self.loop.view
        self.mask_token_id = mask_token_id
        self.clock = clock
        self.tracked: dict[str, _Tracked] = {}  # request id -> service-side state
        self.workers: dict[str, _Worker] = {}  # instance id -> the instance as the step loop uses it
        self.leases = LeaseTable()  # every instance heard within its lease (counted from receipt)
        self._profiles: dict[str, LatencyProfile] = {}  # path -> loaded profile
        # step ids start at the clock in microseconds, so a restarted scheduler never reuses an id
        # that a worker may still answer for its predecessor
        self._step_seq = int(clock() * 1_000_000)
        self._subscriptions = []
        self._tasks: list[asyncio.Task] = []
        self._intake: IntakeConsumer | None = None
        self._stopping = asyncio.Event()
        # workload window for the reconfigurator
        self._window_start = clock()
        self._window_arrivals: list[Arrival] = []
        self._window = {"finished": 0, "slo_met": 0, "rejected": 0, "threshold_sum": 0.0, "steps": 0}
        self.counters = {"malformed": 0, "lost_steps": 0, "failed_steps": 0, "migrations": 0,
                         "continued_steps": 0, "pipelined_steps": 0}
        self.metrics = SchedulerMetrics()
        self.model_name = Path(settings.model_dir).name  # the served model (the gateway's name for it)
        self._metrics_server = None
        self._tracer = tracer("dls.scheduler")
        self._pending_results: list[StepResults] = []  # received, not handled yet (coalesced)
        self._results_scheduled = False  # a _drain_results call is scheduled
        self._outbox: list[tuple[str, bytes, dict | None]] = []  # step commands to publish, in order
        self._outbox_task: asyncio.Task | None = None
        self._deferred: list[Callable[[], None]] = []  # work to run once the queued commands are written
        self._threshold_samples: list[float] = []  # step thresholds not yet in the histogram
        self._predictor_down_until = 0.0  # no predict calls before this (the last one got no reply)

    def _owns(self, key: str) -> bool:
        """Is this request id this replica's (``DLS_SCHEDULER_SHARDS`` > 1: by hash)? (An instance's
        shard is in its heartbeat.)"""
        return shard_of(key, self.settings.scheduler_shards) == self.settings.shard

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        await ensure_intake_stream(self.js, self.subjects, num_replicas=self.settings.intake_replicas)
        shard, shards = self.settings.shard, self.settings.scheduler_shards
        self._intake = await IntakeConsumer.create(
            self.js, self.subjects, durable=self.settings.consumer_name + (f"-{shard}" if shards > 1 else ""),
            shard=shard, shards=shards, ack_wait_s=self.settings.ack_wait_s,
            max_payload_bytes=self.settings.max_payload_bytes,
        )
        results = self.subjects.results_for(shard, shards)
        for subject, cb in ((self.subjects.heartbeat, self._on_heartbeat), (results, self._on_results),
                            (self.subjects.cancel, self._on_cancel)):
            self._subscriptions.append(await self.nc.subscribe(subject, cb=cb))
        await self._resume_in_flight()
        self._metrics_server = serve_metrics(self.metrics.registry, self.settings.metrics_port,
                                             self.settings.metrics_host)
        self._tasks += [
            asyncio.create_task(self._intake_loop(), name="intake"),
            asyncio.create_task(self._lease_loop(), name="leases"),
            asyncio.create_task(self._stats_loop(), name="stats"),
        ]
        freeze_startup_heap()  # full GC passes in the step loop skip the start-up heap
        logger.info("scheduler ready (policy %s, prefix %s)", self.loop.policy.name, self.subjects.prefix)

    async def stop(self) -> None:
        self._stopping.set()
        tasks = self._tasks + ([self._outbox_task] if self._outbox_task is not None else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sub in self._subscriptions:
            await sub.unsubscribe()
        if self._intake is not None:
            await self._intake.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()

    # --- intake ----------------------------------------------------------------------------------

    async def _intake_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                deliveries = await self._intake.fetch(self.settings.intake_batch, timeout_s=0.5)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (NATS reconnecting: retry after a pause)
                logger.warning("intake fetch failed: %r", exc)
                await asyncio.sleep(0.5)
                continue
            if deliveries:
                try:
                    await self._admit(deliveries)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 (Redis gone for long: unacked arrivals are redelivered)
                    logger.exception("admitting %d arrival(s) failed; unacked ones will be redelivered",
                                     len(deliveries))

    async def _admit(self, deliveries: list[IntakeDelivery]) -> None:
        spans: list = []  # one admission span per new request, ended once the batch is placed
        try:
            await self._admit_batch(deliveries, spans)
        finally:
            for span in spans:
                span.end()

    def _admission_span(self, delivery: IntakeDelivery):
        """The span of a request's admission: a child of the gateway's context (intake headers)."""
        request = delivery.request
        return self._tracer.start_span(
            "scheduler.admit", context=extract_context(delivery.headers), kind=SpanKind.CONSUMER,
            attributes={"dls.request_id": request.request_id, "dls.prompt_tokens": len(request.prompt_token_ids or []),
                        "dls.gen_length": request.gen_length, "dls.slo_ms": request.slo_ms,
                        "dls.num_delivered": delivery.num_delivered})

    async def _admit_batch(self, deliveries: list[IntakeDelivery], spans: list) -> None:
        admitted: list[tuple[CompletionRequest, RequestRecord]] = []
        for delivery in deliveries:
            request = delivery.request
            if request.request_id in self.tracked:
                await delivery.ack()  # a redelivery of a request already running here
                continue
            problem = _invalid(request)
            if problem:
                await delivery.ack()
                await self._fail(request.request_id, FailureReason.INVALID, problem, seq=2)
                continue
            spans.append(self._admission_span(delivery))
            record = self._new_record(request, traceparent_of(spans[-1]))
            try:
                stored = await self.store.create(record)
            except Exception as exc:  # noqa: BLE001 (includes RequestExistsError, handled below)
                from shared.state import RequestExistsError

                if not isinstance(exc, RequestExistsError):
                    logger.warning("could not store %s (%s): it will be redelivered", request.request_id, exc)
                    await delivery.nak(delay_s=1.0)
                    continue
                stored = await self.store.load(request.request_id)
                if stored is None or stored.is_terminal:
                    await delivery.ack()
                    continue
            await delivery.ack()
            admitted.append((request, stored))
        if not admitted:
            return
        now = self.clock()
        requests = []
        for request, stored in admitted:
            await self._publish_event(RequestAccepted(
                request_id=request.request_id, seq=1, prompt_tokens=len(stored.prompt_token_ids),
                deadline=stored.deadline,
            ))
            self._window_arrivals.append(Arrival(time_s=stored.arrival_time, prompt_tokens=len(stored.prompt_token_ids),
                                                 output_tokens=stored.gen_length, slo_s=stored.slo_ms / 1000.0))
            requests.append(self._track(stored))
            self.metrics.prompt_tokens.labels(stored.model or self.model_name).inc(len(stored.prompt_token_ids))
        self._handle(self.loop.on_arrivals(now, requests))
        self._ask_predictions([r.request_id for r in requests])

    def _new_record(self, request: CompletionRequest, trace_context: str = "") -> RequestRecord:
        return RequestRecord(
            request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids or []),
            canvas=[self.mask_token_id] * request.gen_length, mask_token_id=self.mask_token_id,
            gen_length=request.gen_length, block_length=request.block_length, cache_mode=request.cache_mode,
            max_tokens=request.max_tokens, ignore_eos=request.ignore_eos, arrival_time=request.arrival_time,
            deadline=request.deadline, slo_ms=request.slo_ms,
            priority=request.priority, min_threshold=request.min_threshold, max_threshold=request.max_threshold,
            seed=request.seed, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
            logprobs=request.logprobs, stop=list(request.stop),
            stream=request.stream, model=request.model or "", owner=request.owner,
            trace_context=trace_context,
        )

    def _track(self, record: RequestRecord) -> Request:
        """Register a stored request with the service and build the core's view of it."""
        cache = CacheMode[record.cache_mode.name]
        self.tracked[record.request_id] = _Tracked(
            version=record.version, prompt_len=len(record.prompt_token_ids), gen_len=record.gen_length,
            block_len=record.block_length, uses_cache=cache != CacheMode.NONE, num_steps=record.num_steps,
            num_committed=record.num_committed, holder_id=None, trace_context=record.trace_context,
            model=record.model or self.model_name, arrival_time=record.arrival_time,
        )
        request = Request(
            record.request_id, record.arrival_time, len(record.prompt_token_ids), record.gen_length,
            record.slo_ms / 1000.0, block_len=record.block_length, priority=record.priority, cache_mode=cache,
            min_threshold=record.min_threshold, max_threshold=record.max_threshold,
        )
        # a resumed request keeps its progress (its next step is a recompute: no instance holds a cache)
        request.num_steps_done = record.num_steps
        request.num_tokens_committed = record.num_committed
        request.current_block = record.current_block
        return request

    async def _resume_in_flight(self) -> None:
        ids = await retry_transient(self.store.list_in_flight, "listing in-flight requests", logger)
        if not ids:
            return
        loaded = await retry_transient(lambda: self.store.load_many(ids), "loading in-flight requests", logger)
        records = [r for r in loaded if r is not None and not r.is_terminal and self._owns(r.request_id)]
        requests = [self._track(r) for r in records if r.request_id not in self.tracked]
        if requests:
            logger.info("resuming %d in-flight requests from Redis", len(requests))
            self._handle(self.loop.on_arrivals(self.clock(), requests))

    # --- workers ---------------------------------------------------------------------------------

    async def _on_heartbeat(self, msg) -> None:
        try:
            beat = codec.decode(WorkerHeartbeat, msg.data, self.settings.max_payload_bytes)
        except codec.CodecError as exc:
            self.counters["malformed"] += 1
            self.metrics.malformed.labels(subject="heartbeat").inc()
            logger.warning("dropping a malformed heartbeat: %s", exc)
            return
        if beat.shard != self.settings.shard and self.settings.scheduler_shards > 1:
            return  # another scheduler shard's instance
        now = self.clock()
        observed = self.leases.observe(beat, now)
        if observed is Observed.IGNORED:
            return  # a late heartbeat, older than one already taken
        worker = self.workers.get(beat.instance_id)
        if worker is not None and observed is Observed.RESTARTED:
            logger.warning("instance %s restarted: its steps in flight are lost", beat.instance_id)
            self._fail_instance(beat.instance_id)
            worker = None
        if observed is Observed.ENDED:
            if worker is not None:
                self._fail_instance(beat.instance_id)
            return
        if step_stuck(beat, self.settings.step_timeout_s):  # alive, but its step never returns: hung
            if worker is not None:
                logger.warning("instance %s: its step has been computing for %.0f s (hung); its requests resume "
                               "elsewhere", beat.instance_id, beat.step_running_s)
                self._fail_instance(beat.instance_id)
            return
        if worker is None:
            if beat.status != WorkerStatus.READY:
                return  # starting (or draining before we ever used it): nothing to do yet
            profile = self._profile(beat)
            if profile is None:
                return
            self.view.add_instance(beat.instance_id, beat.tp, profile, node_id=beat.node,
                                   max_batch=min(beat.max_batch, profile.max_batch(beat.tp)))
            self.workers[beat.instance_id] = _Worker(beat)
            logger.info("instance %s joined (tp %d, node %s)", beat.instance_id, beat.tp, beat.node)
            self._handle(self.loop.tick(now))
            return
        worker.heartbeat = beat
        inst = self.view.instances.get(beat.instance_id)
        if beat.status == WorkerStatus.DRAINING and inst is not None and inst.alive:
            logger.info("instance %s draining: its requests move away", beat.instance_id)
            self.view.drain_instance(beat.instance_id)
            self._handle(self.loop.tick(now))
            self._check_drained(beat.instance_id)

    def _profile(self, beat: WorkerHeartbeat) -> LatencyProfile | None:
        for path in (beat.profile, self.settings.profile):
            if not path:
                continue
            if path not in self._profiles:
                try:
                    self._profiles[path] = LatencyProfile.load(path)
                except (OSError, ProfileError) as exc:
                    logger.warning("instance %s: profile %s unusable (%s)", beat.instance_id, path, exc)
                    continue
            profile = self._profiles[path]
            if beat.profile_scale != 1.0 and path == beat.profile:
                profile = profile.scaled(beat.profile_scale)
            if beat.profile_context_tokens and path == beat.profile:  # anchored as the worker paces it
                profile = dataclasses.replace(profile, context_tokens=beat.profile_context_tokens)
            if beat.tp in profile.tp_degrees:
                return profile
            lower = [tp for tp in profile.tp_degrees if tp < beat.tp]
            if lower:  # e.g. the measured CPU profile has TP-1 only: plan with it (pessimistic)
                logger.warning("instance %s: profile %s has no TP-%d curve; planning it as TP-%d", beat.instance_id,
                               path, beat.tp, max(lower))
                return profile.with_alias(beat.tp, max(lower))
        logger.error("instance %s (tp %d): no latency profile covers it; not using it", beat.instance_id, beat.tp)
        return None

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = self.clock()
            self._update_gauges()
            for lease in self.leases.expire(now):
                if lease.instance_id in self.workers:
                    logger.warning("instance %s: lease expired (no heartbeat for %.1f s); its requests resume "
                                   "elsewhere", lease.instance_id, now - lease.received_at)
                    self._fail_instance(lease.instance_id)
            for iid, worker in list(self.workers.items()):
                if worker.busy_step_id is not None and now - worker.busy_since > self.settings.step_timeout_s:
                    # the command or its results got lost (a NATS node went away): the instance is
                    # dropped and joins again with its next heartbeat; its requests resume from Redis
                    logger.warning("instance %s: step %d unanswered after %.0f s; its requests resume from Redis",
                                   iid, worker.busy_step_id, now - worker.busy_since)
                    self.counters["timed_out_steps"] = self.counters.get("timed_out_steps", 0) + 1
                    self._fail_instance(iid)

    def _fail_instance(self, instance_id: str) -> None:
        self.workers.pop(instance_id, None)
        if instance_id not in self.view.instances:
            return
        lost = self.view.fail_instance(instance_id)
        self.counters["lost_steps"] += len(lost)
        for rid in self.tracked:
            if self.tracked[rid].holder_id == instance_id:
                self.tracked[rid].holder_id = None
        for rid in lost:
            self.tracked[rid].resyncing = True  # the worker may have written before it died
            self._tasks.append(asyncio.create_task(self._resync(rid)))
        self._handle(self.loop.tick(self.clock()))

    def _check_drained(self, instance_id: str) -> None:
        inst = self.view.instances.get(instance_id)
        worker = self.workers.get(instance_id)
        if inst is None or inst.alive or inst.batch or (worker and worker.busy_step_id is not None):
            return
        self.view.remove_instance(instance_id)
        if worker is not None and worker.drop_ids:
            self._send(instance_id, [], worker)
        logger.info("instance %s drained", instance_id)

    # --- steps -----------------------------------------------------------------------------------

    def _handle(self, decisions: Decisions) -> None:
        for rejection in decisions.rejections:
            tracked = self.tracked.pop(rejection.request_id, None)
            self._window["rejected"] += 1
            self.metrics.rejected.inc()
            self._tasks.append(asyncio.create_task(self._finish_failed(
                rejection.request_id, _REJECT_TO_FAILURE[rejection.reason], rejection.detail or rejection.reason.name,
                StoredStatus.REJECTED, tracked,
            )))
        for a in decisions.assignments:
            if a.is_migration:
                self.counters["migrations"] += 1
                self.metrics.migrations.inc()
                self._trace_migration(a)
        self._dispatch()

    def _dispatch(self) -> None:
        for iid, worker in self.workers.items():
            if worker.busy_step_id is not None:
                continue
            inst = self.view.instances.get(iid)
            if inst is None:
                continue
            items = []
            for rid in inst.resident_ids:
                request = self.view.requests[rid]
                tracked = self.tracked.get(rid)
                if request.status not in _RUNNABLE or tracked is None or tracked.resyncing:
                    continue
                items.append(StepItem(request_id=rid, threshold=float(request.threshold),
                                      state_version=tracked.version, load_state=tracked.holder_id != iid))
                if tracked.holder_id is not None and tracked.holder_id != iid:
                    old = self.workers.get(tracked.holder_id)
                    if old is not None:
                        old.drop_ids.append(rid)
            if items:
                self._send(iid, items, worker)
        for iid, worker in self.workers.items():  # requests that left an idle instance: free its copies
            if worker.drop_ids and worker.busy_step_id is None:
                self._send(iid, [], worker)

    def _send(self, instance_id: str, items: list[StepItem], worker: _Worker) -> None:
        self._step_seq += 1
        command = StepCommand(instance_id=instance_id, step_id=self._step_seq, items=items,
                              drop_request_ids=worker.drop_ids, issued_at=self.clock())
        worker.drop_ids = []
        headers = None
        if items:
            worker.busy_step_id = self._step_seq
            worker.busy_since = command.issued_at
            worker.in_flight_ids = [it.request_id for it in items]
            worker.next_step_id, worker.next_sent = 0, {}
            self.metrics.batch_size.observe(len(items))
            if tracing_active():
                span = self._batch_span("scheduler.step_command", worker.in_flight_ids, SpanKind.PRODUCER, {
                    "dls.instance_id": instance_id, "dls.step_id": self._step_seq, "dls.batch_size": len(items),
                    "dls.num_load_state": sum(it.load_state for it in items)})
                headers = header_context(span) or None
                span.end()
        self._publish(self.subjects.step(instance_id), command, headers)
        if items:
            self._send_next(instance_id, worker)

    @property
    def _pipelining(self) -> bool:
        return self.settings.pipeline_steps and self.settings.overlap_min_tokens > 0

    def _send_next(self, instance_id: str, worker: _Worker) -> None:
        """Pipelining: the command for the step after the one in flight, at the requests' current
        thresholds, sent now so that the worker goes on the moment its step ends. The worker checks
        the batch: a request that completed its block goes on only if the policy would keep it here
        at its block start (``may_start_block``, asked now); one that finished is left out when the
        queue is empty (``drop_finished``: no one waits for its slot), else the worker waits for a
        pass. Sent only where a pass could not place anything else there: every request on the
        instance is in the step, and the queue is empty or the instance full. Re-sent when
        ``replan`` changed a threshold (the worker keeps the latest)."""
        if not self._pipelining or worker.busy_step_id is None or worker.heartbeat.status != WorkerStatus.READY:
            return
        inst = self.view.instances.get(instance_id)
        if inst is None or not inst.alive or len(inst.resident_ids) != len(worker.in_flight_ids):
            return
        if self.view.num_queued > 0 and inst.batch < inst.max_batch:
            return
        pairs, items = [], []
        stays = self.loop.would_stay(instance_id, worker.in_flight_ids)
        for rid in worker.in_flight_ids:
            request, tracked = self.view.requests.get(rid), self.tracked.get(rid)
            if (request is None or tracked is None or tracked.resyncing or request.instance_id != instance_id
                    or request.status != RequestStatus.RUNNING or request.threshold is None):
                return
            pairs.append((rid, float(request.threshold), rid in stays))
            # the step in flight writes one version on top of the one it started from
            items.append(StepItem(request_id=rid, threshold=float(request.threshold),
                                  state_version=tracked.version + 1, may_start_block=rid in stays))
        drop_finished = self.view.num_queued == 0
        if worker.next_step_id and worker.next_sent[worker.next_step_id] == (pairs, drop_finished):
            return  # the held command is already this one
        self._step_seq += 1
        command = StepCommand(instance_id=instance_id, step_id=self._step_seq, items=items, issued_at=self.clock(),
                              after_step_id=worker.busy_step_id, drop_finished=drop_finished)
        worker.next_step_id = self._step_seq
        worker.next_sent[self._step_seq] = (pairs, drop_finished)
        self._publish(self.subjects.step(instance_id), command)

    async def _on_results(self, msg) -> None:
        try:
            results = codec.decode(StepResults, msg.data, self.settings.max_payload_bytes)
        except codec.CodecError as exc:
            self.counters["malformed"] += 1
            self.metrics.malformed.labels(subject="results").inc()
            logger.warning("dropping malformed step results: %s", exc)
            return
        # coalesced: every StepResults already received is handled by one scheduling pass, which
        # runs once the subscription has handed over all the messages read so far
        self._pending_results.append(results)
        if not self._results_scheduled:
            self._results_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain_results)

    def _drain_results(self) -> None:
        self._results_scheduled = False
        batch, self._pending_results = self._pending_results, []
        if self._stopping.is_set():
            return
        # one results message per instance per pass: a pipelined worker's next results name the step
        # that this pass makes the one in flight, so they wait for the next turn
        seen: set[str] = set()
        now_batch, later = [], []
        for results in batch:
            (later if results.instance_id in seen else now_batch).append(results)
            seen.add(results.instance_id)
        if later:
            self._pending_results = later + self._pending_results
            self._results_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain_results)
        batch = now_batch
        try:
            collected = self._collect_results(batch)
            if not collected:
                return
            if self.settings.overlap_min_tokens > 0:
                self._apply_overlapped(collected)
                return
            stepped = [o.request_id for _, _, outcomes, _ in collected for o in outcomes if not o.finished]
            if self._waits_for_predictions(stepped):
                self._tasks.append(asyncio.create_task(self._apply_after_predictions(collected, stepped)))
            else:
                self._apply_results(collected, {})
        except Exception:  # noqa: BLE001 (a bug must not stop the step loop: log it, keep serving)
            logger.exception("handling %d step result(s) failed", len(batch))

    def _collect_results(self, batch: list[StepResults]) -> list[tuple]:
        """Record each worker's results on the service's side; the core hears of them in
        ``_apply_results``. Until then the instances stay busy, so nothing re-dispatches their requests."""
        now = self.clock()
        collected = []  # (worker, results, outcomes, failures of requests still tracked)
        for results in batch:
            worker = self.workers.get(results.instance_id)
            if worker is None or worker.busy_step_id != results.step_id:
                logger.warning("ignoring results of step %d from %s (not the step in flight)", results.step_id,
                               results.instance_id)
                continue
            outcomes = self._record_outcomes(results, now)
            failures = [f for f in results.failures if f.request_id in self.tracked]
            collected.append((worker, results, outcomes, failures))
        return collected

    async def _apply_after_predictions(self, collected: list[tuple], stepped: list[str]) -> None:
        """Fresh predictions for the requests that stepped, waited for at most ``predict_wait_s``, so
        that their next thresholds use them (a fire-and-forget request would land one step late)."""
        try:
            predictions = await self._request_predictions(self._queries(stepped), self.settings.predict_wait_s)
            self._apply_results(collected, predictions or {})
        except Exception:  # noqa: BLE001 (a bug must not stop the step loop: log it, keep serving)
            logger.exception("applying %d step result(s) failed", len(collected))

    def _waits_for_predictions(self, stepped: list[str]) -> bool:
        return self.settings.predict_wait_s > 0 and bool(stepped) and self.clock() >= self._predictor_down_until

    def _release(self, collected: list[tuple], predictions: dict[str, Prediction], running: dict | None = None):
        """Free the instances whose results these are: (the core's step results, failures as
        (instance id, failure), instance ids); instances that failed meanwhile are left out.

        An instance whose worker went straight on to the conditional command it held (pipelining)
        stays busy with that step instead; ``running`` gets its (request id, threshold) pairs."""
        step_results: list[BatchOutcome] = []
        failures = []  # (instance id, failure)
        instance_ids: list[str] = []
        for worker, results, outcomes, worker_failures in collected:
            if self.workers.get(results.instance_id) is not worker or worker.busy_step_id != results.step_id:
                continue  # the instance failed while the predictions were on their way
            if results.continued_step_id:
                # the worker went straight on to one of the conditional commands sent for this step
                sent = worker.next_sent.get(results.continued_step_id)
                finished = {r.request_id for r in results.results if r.finished}  # left out of it
                if sent is None:  # cannot happen unless commands cross a scheduler restart: go by the step's
                    logger.warning("instance %s went on to step %d, which this scheduler did not send",
                                   results.instance_id, results.continued_step_id)
                    sent = ([(rid, float(self.view.requests[rid].threshold), False) for rid in worker.in_flight_ids
                             if rid in self.view.requests and self.view.requests[rid].threshold is not None], True)
                pairs = [(rid, threshold) for rid, threshold, _ in sent[0] if rid not in finished]
                worker.busy_step_id, worker.busy_since = results.continued_step_id, self.clock()
                worker.in_flight_ids = [rid for rid, _ in pairs]
                if running is not None:
                    running[results.instance_id] = pairs
                self.counters["pipelined_steps"] += 1
            else:
                worker.busy_step_id = None
                worker.in_flight_ids = []
            worker.next_step_id, worker.next_sent = 0, {}
            if predictions:
                outcomes = [dataclasses.replace(o, prediction=predictions.get(o.request_id)) for o in outcomes]
            step_results.append(BatchOutcome(results.instance_id, tuple(outcomes), results.duration_s))
            failures += [(results.instance_id, f) for f in worker_failures]
            instance_ids.append(results.instance_id)
        return step_results, failures, instance_ids

    def _requeue_failed(self, failures: list) -> None:
        for instance_id, failure in failures:
            tracked = self.tracked.get(failure.request_id)
            if tracked is None:
                continue
            self.counters["failed_steps"] += 1
            logger.warning("step of %s failed on %s: %s", failure.request_id, instance_id, failure.reason)
            self.view.requeue_request(failure.request_id)
            tracked.holder_id = None
            tracked.resyncing = True
            self._tasks.append(asyncio.create_task(self._resync(failure.request_id)))

    def _apply_results(self, collected: list[tuple], predictions: dict[str, Prediction]) -> None:
        """Tell the core (one ``on_step_results`` pass, predictions attached), dispatch, predict the rest."""
        now = self.clock()
        step_results, failures, instance_ids = self._release(collected, predictions)
        if not step_results:
            return
        unpredicted = [o.request_id for r in step_results for o in r.outcomes  # go on without a fresh prediction
                       if not o.finished and o.prediction is None]
        for rid, prediction in predictions.items():
            self._note_prediction(rid, prediction)
        decisions = self.loop.on_step_results(now, step_results)
        self._requeue_failed(failures)
        self._handle(decisions)
        if failures:
            self._handle(self.loop.tick(now))
        for instance_id in instance_ids:
            self._check_drained(instance_id)
        self._ask_predictions(unpredicted)

    # overlap (settings.overlap_min_tokens > 0): the pass off the critical path

    def _apply_overlapped(self, collected: list[tuple]) -> None:
        """Instances whose requests simply go on get their next step before any scheduling pass
        (``SchedulingLoop.continue_steps``); once those commands are written, the pass for the rest
        (after the fresh predictions, as without overlap) and the continued requests' next
        thresholds (``SchedulingLoop.replan``)."""
        running: dict[str, list[tuple[str, float]]] = {}  # instances whose workers went on by themselves
        step_results, failures, instance_ids = self._release(collected, {}, running)
        if not step_results:
            return
        now = self.clock()
        cont = self.loop.continue_steps(now, step_results, self.settings.overlap_min_tokens, running)
        if cont.continued_ids:
            self.counters["continued_steps"] += len({self.view.requests[rid].instance_id for rid in cont.continued_ids
                                                     if rid in self.view.requests})
            self._handle(cont.decisions)
        stepped = [o.request_id for r in step_results for o in r.outcomes if not o.finished]
        self._after_dispatch(lambda: self._overlap_rest(cont, failures, instance_ids, stepped))

    def _overlap_rest(self, cont, failures: list, instance_ids: list[str], stepped: list[str]) -> None:
        self._requeue_failed(failures)
        if self._waits_for_predictions(stepped):
            self._tasks = [t for t in self._tasks if not t.done()]
            self._tasks.append(asyncio.create_task(self._overlap_after_predictions(cont, instance_ids, stepped)))
        else:
            self._overlap_pass(cont, instance_ids)
            self._ask_predictions(stepped)

    async def _overlap_after_predictions(self, cont, instance_ids: list[str], stepped: list[str]) -> None:
        try:
            predictions = await self._request_predictions(self._queries(stepped), self.settings.predict_wait_s)
            now = self.clock()
            for rid, prediction in (predictions or {}).items():
                self.loop.on_prediction(now, rid, prediction)
                self._note_prediction(rid, prediction)
            self._overlap_pass(cont, instance_ids)
        except Exception:  # noqa: BLE001 (a bug must not stop the step loop: log it, keep serving)
            logger.exception("the scheduling pass after %d step result(s) failed", len(instance_ids))

    def _overlap_pass(self, cont, instance_ids: list[str]) -> None:
        now = self.clock()
        if cont.needs_pass or self.view.ready_ids:  # failed steps' requests are READY again too
            self._handle(self.loop.tick(now))
        else:  # no pass, but a freed instance may hold requests a pass assigned it while it was busy
            self._dispatch()
        self.loop.replan(now, cont.continued_ids)
        if self._pipelining:  # the step after the continued ones, at the thresholds replan chose
            for iid in {a.instance_id for a in cont.decisions.assignments}:
                worker = self.workers.get(iid)
                if worker is not None:
                    self._send_next(iid, worker)
        for instance_id in instance_ids:
            self._check_drained(instance_id)

    def _record_outcomes(self, results: StepResults, now: float) -> list[StepOutcome]:
        """Update the service's side of each request of one worker's results; the core's outcomes."""
        outcomes = []
        window = self._window
        for r in results.results:
            tracked = self.tracked.get(r.request_id)
            if tracked is None:
                continue  # cancelled while its step ran
            tracked.version = r.state_version
            tracked.holder_id = results.instance_id
            tracked.num_steps = r.num_steps
            tracked.num_committed = tracked.gen_len - r.num_masked
            if r.block_index != tracked.block_index:
                tracked.block_index, tracked.block_committed = r.block_index, 0
            tracked.block_size = min(tracked.block_len, tracked.gen_len - r.block_index * tracked.block_len)
            tracked.block_committed = min(tracked.block_committed + len(r.committed_positions), tracked.block_size)
            tracked.confidence = r.confidence.as_tuple
            tracked.threshold = r.threshold
            window["threshold_sum"] += r.threshold
            window["steps"] += 1
            self._threshold_samples.append(r.threshold)
            tracked.threshold_sum += r.threshold
            tracked.num_threshold_steps += 1
            outcomes.append(StepOutcome(r.request_id, len(r.committed_positions), r.block_done, r.finished,
                                        int(r.kind) == 0))
            if r.block_done or r.finished:
                self._observe_output(tracked, now)
            if r.finished:
                self.tracked.pop(r.request_id, None)
                window["finished"] += 1
                request = self.view.requests.get(r.request_id)
                if request is not None and now <= request.deadline:
                    window["slo_met"] += 1
                self._observe_finish(r.request_id, tracked, request, r.num_steps, now, r.num_answer_tokens)
        if outcomes:
            self.metrics.steps.inc(len(outcomes))
            if len(self._threshold_samples) == len(outcomes):  # the first of this batch: observe them later
                self._after_dispatch(self._observe_thresholds)
        return outcomes

    def _observe_thresholds(self) -> None:
        """The step thresholds' histogram, filled once the step commands are out (off the hot path)."""
        samples, self._threshold_samples = self._threshold_samples, []
        for threshold in samples:
            self.metrics.threshold.observe(threshold)

    async def _resync(self, request_id: str) -> None:
        """Reload a request whose step was lost or failed, and catch the core up with what Redis says."""
        record = await retry_transient(lambda: self.store.load(request_id), f"reloading {request_id}", logger)
        tracked = self.tracked.get(request_id)
        request = self.view.requests.get(request_id)
        if tracked is None or request is None:
            return
        if record is None or record.is_terminal:
            self.tracked.pop(request_id, None)
            if request.status == RequestStatus.QUEUED or request.status == RequestStatus.READY:
                # finished (a worker wrote it, its result was lost) or gone: the core forgets it; the
                # gateway, hearing no final event, finds the result in Redis (DLS_GATEWAY_RESULT_POLL_S)
                self.view.cancel_request(request_id, self.clock(), detail="finished while its result was lost")
            if record is None:
                await self._fail(request_id, FailureReason.INTERNAL, "request state vanished from Redis",
                                 seq=10**6)
            self._handle(self.loop.tick(self.clock()))
            return
        delta = record.num_steps - request.num_steps_done
        if delta > 0:  # steps the worker stored but never reported: the core counts them now
            committed = record.num_committed - request.num_tokens_committed
            request.num_steps_done = record.num_steps
            request.num_tokens_committed = record.num_committed
            request.current_block = record.current_block
            request.num_block_steps = 0
            logger.info("request %s: %d stored step(s) recovered (%d tokens)", request_id, delta, committed)
        tracked.version = record.version
        tracked.num_steps = record.num_steps
        tracked.num_committed = record.num_committed
        tracked.resyncing = False
        self._handle(self.loop.tick(self.clock()))

    # --- predictions -----------------------------------------------------------------------------

    def _ask_predictions(self, request_ids: list[str]) -> None:
        """Fire-and-forget: the predictions reach the core when they come (``on_prediction``)."""
        if not request_ids or self.clock() < self._predictor_down_until:
            return  # the last call got no reply: no predictor for a while (the core keeps its estimates)
        queries = self._queries(request_ids)
        if queries:
            self._tasks = [t for t in self._tasks if not t.done()]
            self._tasks.append(asyncio.create_task(self._predict(queries)))

    def _queries(self, request_ids: list[str]) -> list[PredictionQuery]:
        queries = []
        for rid in request_ids:
            t = self.tracked.get(rid)
            if t is None:
                continue
            queries.append(PredictionQuery(
                request_id=rid, num_steps_done=t.num_steps, gen_length=t.gen_len, prompt_length=t.prompt_len,
                block_length=t.block_len, num_committed=t.num_committed, block_committed=t.block_committed,
                block_size=t.block_size or None, block_index=max(t.block_index, 0), confidence=t.confidence,
                uses_cache=t.uses_cache,
                threshold=t.threshold,
            ))
        return queries

    async def _predict(self, queries: list[PredictionQuery]) -> None:
        predictions = await self._request_predictions(queries, self.settings.predictor_timeout_s)
        now = self.clock()
        for rid, prediction in (predictions or {}).items():
            self.loop.on_prediction(now, rid, prediction)
            self._note_prediction(rid, prediction)

    async def _request_predictions(self, queries: list[PredictionQuery], timeout_s: float
                                   ) -> dict[str, Prediction] | None:
        """Request id -> prediction from the predictor service; None when it did not answer in time."""
        if not queries:
            return {}
        thresholds = sorted(set(self.settings.thresholds))
        request = PredictRequest(queries=queries, thresholds=thresholds)
        span = self._batch_span("scheduler.predict", [q.request_id for q in queries], SpanKind.CLIENT,
                                {"dls.num_queries": len(queries)}) if tracing_active() else None
        try:
            msg = await self.nc.request(self.subjects.predict, codec.encode(request, self.settings.max_payload_bytes),
                                        timeout=timeout_s,
                                        headers=(header_context(span) or None) if span is not None else None)
            reply = codec.decode(PredictReply, msg.data, self.settings.max_payload_bytes)
        except Exception as exc:  # noqa: BLE001 (no predictor, timeout: the core keeps its last estimate)
            logger.debug("no prediction (%s); next try in %.1f s", exc, PREDICTOR_RETRY_S)
            self._predictor_down_until = self.clock() + PREDICTOR_RETRY_S
            return None
        finally:
            if span is not None:
                span.end()
        self._predictor_down_until = 0.0
        if reply.error:
            logger.warning("predictor error: %s", reply.error)
            return None
        return {p.request_id: Prediction({float(t): (s.recompute_steps, s.cache_steps)
                                          for t, s in p.threshold_to_steps.items()}, p.made_at_step)
                for p in reply.predictions}

    # --- cancellations, failures, events -----------------------------------------------------------

    async def _on_cancel(self, msg) -> None:
        try:
            cancel = codec.decode(CancelRequest, msg.data, self.settings.max_payload_bytes)
        except codec.CodecError as exc:
            self.counters["malformed"] += 1
            self.metrics.malformed.labels(subject="cancel").inc()
            logger.warning("dropping a malformed cancel: %s", exc)
            return
        request = self.view.requests.get(cancel.request_id)
        if request is None or request.status.is_terminal:
            return
        holder = self.tracked.get(cancel.request_id)
        self.view.cancel_request(cancel.request_id, self.clock(), detail=cancel.reason or "cancelled")
        tracked = self.tracked.pop(cancel.request_id, None)
        if holder is not None and holder.holder_id in self.workers:
            self.workers[holder.holder_id].drop_ids.append(cancel.request_id)
        await self._finish_failed(cancel.request_id, FailureReason.CANCELLED, cancel.reason or "cancelled",
                                  StoredStatus.CANCELLED, tracked)
        self._handle(self.loop.tick(self.clock()))

    async def _finish_failed(self, request_id: str, reason: FailureReason, detail: str, status: StoredStatus,
                             tracked: _Tracked | None) -> None:
        """Store the terminal status (retrying a lost race with a worker's write), then tell the gateway."""
        num_steps = tracked.num_steps if tracked else 0
        for _ in range(5):
            record = await retry_transient(lambda: self.store.load(request_id), f"loading {request_id}", logger)
            if record is None or record.is_terminal:
                break
            try:
                record = await retry_transient(lambda r=record: self.store.save(msgspec.structs.replace(
                    r, status=status, detail=detail, finished_at=self.clock())), f"saving {request_id}", logger)
                num_steps = record.num_steps
                break
            except StaleStateError:
                continue
        await self._fail(request_id, reason, detail, seq=num_steps + 2)

    async def _fail(self, request_id: str, reason: FailureReason, detail: str, seq: int) -> None:
        await self._publish_event(RequestFailed(request_id=request_id, seq=seq, reason=reason, detail=detail))

    async def _publish_event(self, event) -> None:
        await self.nc.publish(self.subjects.events(event.request_id),
                              codec.encode(event, self.settings.max_payload_bytes))

    def _publish(self, subject: str, message, headers: dict[str, str] | None = None) -> None:
        """Publish from synchronous code: queued, in order, and sent by one task per loop turn."""
        self._outbox.append((subject, codec.encode(message, self.settings.max_payload_bytes), headers))
        self._kick_outbox()

    def _after_dispatch(self, work: Callable[[], None]) -> None:
        """Run ``work`` once the step commands queued so far are written to the socket."""
        self._deferred.append(work)
        self._kick_outbox()

    def _kick_outbox(self) -> None:
        if self._outbox_task is None or self._outbox_task.done():
            self._outbox_task = asyncio.create_task(self._send_outbox())

    async def _send_outbox(self) -> None:
        while self._outbox or self._deferred:
            while self._outbox:
                batch, self._outbox = self._outbox, []
                for subject, data, headers in batch:
                    try:
                        await self.nc.publish(subject, data, headers=headers)
                    except Exception as exc:  # noqa: BLE001 (NATS gone: the step times out and is retried)
                        logger.warning("could not publish to %s: %s", subject, exc)
            if self._deferred:
                await asyncio.sleep(0)  # the NATS client's flusher, woken by those publishes, writes first
                work, self._deferred = self._deferred, []
                for fn in work:
                    if self._stopping.is_set():
                        break
                    try:
                        fn()
                    except Exception:  # noqa: BLE001 (a bug must not stop the step loop: log it, keep serving)
                        logger.exception("deferred scheduling work failed")

    # --- telemetry (shared/telemetry.py, shared/metrics.py) ----------------------------------------

    def _request_context(self, request_id: str):
        """The context of a request's admission span (parent of its spans); None when it is not traced."""
        tracked = self.tracked.get(request_id)
        return context_of(tracked.trace_context) if tracked is not None else None

    def _batch_span(self, name: str, request_ids: list[str], kind: SpanKind, attributes: dict):
        """A span about a batch of requests: in the trace of the first, linked to the others'."""
        parent = self._request_context(request_ids[0]) if request_ids else None
        links = [link for rid in request_ids[1:] if rid in self.tracked
                 for link in [link_to(self.tracked[rid].trace_context)] if link is not None]
        return self._tracer.start_span(name, context=parent or otel_context.Context(), kind=kind, links=links,
                                       attributes={**attributes, "dls.request_ids": list(request_ids)})

    def _trace_migration(self, assignment) -> None:
        parent = self._request_context(assignment.request_id)
        if parent is None:
            return
        tracked = self.tracked.get(assignment.request_id)
        self._tracer.start_span("scheduler.migrate", context=parent, attributes={
            "dls.request_id": assignment.request_id, "dls.to_instance_id": assignment.instance_id,
            "dls.from_instance_id": assignment.from_instance_id or (tracked.holder_id if tracked else "") or "",
            "dls.threshold": float(assignment.threshold)}).end()

    def _note_prediction(self, request_id: str, prediction: Prediction) -> None:
        tracked = self.tracked.get(request_id)
        if tracked is None:
            return
        threshold_to_remaining = {t: sum(steps) for t, steps in prediction.threshold_to_steps.items()}
        if tracked.first_prediction is None:  # kept for the predictor-error metric at finish
            tracked.first_prediction = (prediction.made_at_step, threshold_to_remaining)
            tracked.threshold_sum, tracked.num_threshold_steps = 0.0, 0
        parent = context_of(tracked.trace_context)
        if parent is not None:
            thresholds = sorted(threshold_to_remaining)
            self._tracer.start_span("scheduler.prediction", context=parent, attributes={
                "dls.request_id": request_id, "dls.made_at_step": prediction.made_at_step,
                "dls.thresholds": thresholds,
                "dls.predicted_remaining_steps": [threshold_to_remaining[t] for t in thresholds]}).end()

    def _observe_output(self, tracked: _Tracked, now: float) -> None:
        """A block of the request's answer was committed: its TTFT, or a gap between two blocks."""
        if tracked.first_output_at is None:
            tracked.first_output_at = now
            self.metrics.ttft.labels(tracked.model).observe(max(now - tracked.arrival_time, 0.0))
        else:
            self.metrics.itl.labels(tracked.model).observe(max(now - tracked.last_output_at, 0.0))
        tracked.last_output_at = now

    def _observe_finish(self, request_id: str, tracked: _Tracked, request, num_steps: int, now: float,
                        num_answer_tokens: int = 0) -> None:
        self.metrics.finished.inc()
        latency_s = now - request.arrival_time if request is not None else None
        slo_met = request is not None and now <= request.deadline
        if slo_met:
            self.metrics.slo_met.inc()
        if latency_s is not None:
            self.metrics.latency.observe(latency_s)
        e2e_s = max(now - tracked.arrival_time, 0.0)
        self.metrics.e2e.labels(tracked.model).observe(e2e_s)
        self.metrics.generation_tokens.labels(tracked.model).inc(num_answer_tokens)
        if num_answer_tokens > 1 and tracked.first_output_at is not None:
            first = max(tracked.first_output_at - tracked.arrival_time, 0.0)
            self.metrics.tpot.labels(tracked.model).observe((e2e_s - first) / (num_answer_tokens - 1))
        error = None
        if tracked.first_prediction is not None:
            made_at, threshold_to_remaining = tracked.first_prediction
            used = (tracked.threshold_sum / tracked.num_threshold_steps if tracked.num_threshold_steps
                    else tracked.threshold)
            error = predictor_error(made_at, threshold_to_remaining, used, num_steps)
            if error is not None:
                self.metrics.predictor_error.observe(error)
        parent = context_of(tracked.trace_context)
        if parent is not None:
            attributes = {"dls.request_id": request_id, "dls.num_steps": num_steps, "dls.slo_met": slo_met}
            if latency_s is not None:
                attributes["dls.latency_s"] = latency_s
            if error is not None:
                attributes["dls.predictor_error"] = error
            self._tracer.start_span("scheduler.finish", context=parent, attributes=attributes).end()

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.set(self.view.num_queued)
        self.metrics.in_flight.set(len(self.tracked))
        queued = {r.request_id for r in self.view.iter_queued()}
        model_to_counts: dict[str, list[int]] = {self.model_name: [0, 0]}  # model -> [running, waiting]
        for request_id, tracked in self.tracked.items():
            model_to_counts.setdefault(tracked.model, [0, 0])[request_id in queued] += 1
        for model, (running, waiting) in model_to_counts.items():
            self.metrics.running.labels(model).set(running)
            self.metrics.waiting.labels(model).set(waiting)
        tp_to_count: dict[int, int] = {}  # TP degree -> live instances
        for inst in self.view.instances.values():
            if inst.alive:
                tp_to_count[inst.tp] = tp_to_count.get(inst.tp, 0) + 1
        self.metrics.set_instances(tp_to_count)

    # --- workload stats --------------------------------------------------------------------------

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.stats_interval_s)
            self._tasks = [t for t in self._tasks if not t.done()]
            now = self.clock()
            w = self._window
            stats = WorkloadStats(
                window_start=self._window_start, window_end=now, arrivals=self._window_arrivals,
                num_finished=w["finished"], num_slo_met=w["slo_met"], num_rejected=w["rejected"],
                num_in_flight=len(self.tracked),
                mean_threshold=w["threshold_sum"] / w["steps"] if w["steps"] else None,
            )
            self._window_start, self._window_arrivals = now, []
            self._window = {"finished": 0, "slo_met": 0, "rejected": 0, "threshold_sum": 0.0, "steps": 0}
            try:
                await self.nc.publish(self.subjects.stats, codec.encode(stats, self.settings.max_payload_bytes))
            except Exception as exc:  # noqa: BLE001 (too many arrivals for one message, NATS down)
                logger.warning("could not publish workload stats: %s", exc)


def _invalid(request: CompletionRequest) -> str:
    if not request.prompt_token_ids:
        return "prompt_token_ids: the gateway sends tokenized prompts; none given"
    if request.gen_length < 1 or request.block_length < 1:
        return "gen_length and block_length must be positive"
    if request.slo_ms <= 0:
        return "slo_ms must be positive"
    if not request.temperature >= 0 or not 0 < request.top_p <= 1:
        return "temperature must be >= 0 and top_p in (0, 1]"
    if request.logprobs is not None and not 0 <= request.logprobs <= 20:
        return "logprobs must be in 0..20"
    return ""


def read_mask_token_id(model_dir: str) -> int:
    """The mask id from the model's config.json (LLaDA's public checkpoints: 126336)."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"DLS_SCHEDULER_MODEL_DIR: cannot read {model_dir}/config.json: {exc}") from None
    if "mask_token_id" in raw:
        return int(raw["mask_token_id"])
    if str(raw.get("model_type", "")).lower() == "llada":
        return 126336
    raise ValueError(f"{model_dir}/config.json has no mask_token_id")


async def serve(settings: SchedulerSettings) -> None:

    from shared.state import RedisStateStore

    setup_tracing("dls-scheduler", settings)
    nc = await connect_nats(settings, "dls-scheduler")
    store = RedisStateStore.from_url(settings.redis_url, settings.redis_key_prefix,
                                     completed_ttl_s=settings.completed_ttl_s)
    service = SchedulerService(settings, nc, nc.jetstream(), store,
                               mask_token_id=read_mask_token_id(settings.model_dir))
    stop = on_stop_signals()
    await service.start()
    try:
        await stop.wait()
    finally:
        await service.stop()
        await nc.drain()
        await store.close()
        shutdown_tracing()
