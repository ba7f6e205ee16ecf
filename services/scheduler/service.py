"""The scheduler service: the scheduling core (``StepScheduler``) over NATS, request state in Redis.

Wiring only: every input becomes one call of the core (``services/scheduler/core``), and the core's
``StepDecisions`` become messages. Nothing here decides a step.

- intake (JetStream work queue): ``StateStore.create``, then ack, then ``RequestAccepted``, then
  ``on_arrivals`` (one pass per fetched batch);
- ``results``: workers' ``StepResults``, coalesced (all those received before the loop turns, one per
  instance) -> ``on_results`` (the critical path: continued steps go out at once) and, once those
  commands are written and the fresh predictions are in (one ``predict`` request/reply, awaited up to
  ``predict_wait_s``; paused ``PREDICTOR_RETRY_S`` after a call that got no reply), ``finish_results``;
- ``heartbeat``: worker leases -> ``add_instance`` (with the model it serves), ``drain_instance``,
  ``fail_instance`` (also when a known instance names another model: it joins again as that model's);
  a lost or failed step's request is read back from Redis -> ``reloaded``; a request's model is the one
  its record names (the core runs it only on instances of that model);
- ``cancel``: ``cancel`` and a versioned CANCELLED write.

Outputs: the core's ``StepCommand``s (``step.<instance>``), ``RequestFailed`` for rejections and
cancellations, ``WorkloadStats`` every ``stats_interval_s``, metrics and traces.

On start the service resumes every in-flight request found in Redis (a restarted scheduler).
Everything runs on one asyncio loop and every core call is synchronous, so the view is never seen
half-updated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind

from services.scheduler.core import (
    BatchOutcome,
    PendingResults,
    Prediction,
    Request,
    SchedulingLoop,
    StepConfig,
    StepDecisions,
    StepOutcome,
    StepScheduler,
    StoredProgress,
    make_config,
    make_policy,
)
from services.scheduler.core.decisions import RejectReason
from services.scheduler.core.load import BACKGROUND_PRIORITY
from services.scheduler.core.quality_watch import QualityWatch, promised_agreement
from services.scheduler.core.threshold import ModelFloors, candidates_from_quality, canvas_floors
from shared.calibration import find, uncalibrated_message
from shared.jetstream import JETSTREAM_TRANSIENT_ERRORS, IntakeConsumer, IntakeDelivery, ensure_intake_stream
from shared.leases import LeaseTable, Observed, step_stuck
from shared.messages import codec
from shared.messages.base import RequestStatus, StepKind
from shared.messages.control import Arrival, WorkerHeartbeat, WorkerStatus, WorkloadStats
from shared.messages.events import FailureReason, RequestAccepted, RequestFailed
from shared.messages.intake import CancelRequest, CompletionRequest
from shared.messages.predictor import PredictionQuery, PredictReply, PredictRequest
from shared.messages.steps import FailureKind, StepCommand, StepResults
from shared.metrics import SchedulerMetrics, predictor_error, serve_metrics
from shared.profiles import LatencyProfile, ProfileError, online_profile
from shared.retry import retry_transient
from shared.runtime import connect_nats, freeze_startup_heap, on_stop_signals
from shared.served import model_name, served_models_of
from shared.settings import SchedulerSettings
from shared.state import RequestRecord, StaleStateError, StateStore
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

PREDICTOR_RETRY_S = 1.0  # after a predict call that got no reply (no predictor, timeout), pause this long
_REJECT_TO_FAILURE = {  # the core's reason -> the wire's
    RejectReason.DEADLINE_INFEASIBLE: FailureReason.DEADLINE_INFEASIBLE,
    RejectReason.FLOOR_UNSATISFIABLE: FailureReason.FLOOR_UNSATISFIABLE,
    RejectReason.NO_INSTANCE: FailureReason.NO_INSTANCE,
}


@dataclass
class _Telemetry:
    """What the service observes of a live request for its metrics and traces (its progress is the core's)."""

    model: str  # the model_name label of its serving metrics
    arrival_time: float  # unix time (s) the gateway accepted it
    deadline: float  # unix time (s)
    trace_context: str = ""  # traceparent of its admission span (parent of its spans); "": not traced
    # its first prediction, kept for the predictor-error metric: (made at step, threshold -> remaining steps)
    first_prediction: tuple[int, dict[float, int]] | None = None
    threshold_sum: float = 0.0  # thresholds of its steps since that prediction, summed
    num_threshold_steps: int = 0  # and counted
    last_threshold: float | None = None  # of its last step
    lowest_threshold: float = 1.0  # the lowest its steps ran at (shadow decoding samples by it)
    first_output_at: float | None = None  # when its first block was committed (TTFT)
    last_output_at: float | None = None  # when its latest block was committed (inter-token latency)


@dataclass(frozen=True)
class ServedQuality:
    """The served model's quality curves (``quality.json`` of its calibration bundle), or None when it
    is uncalibrated; ``where`` names the file for logs and errors."""

    curves: dict | None
    where: str
    profile: str = ""  # the calibration's latency profile ("": uncalibrated)


def served_quality(settings: SchedulerSettings) -> ServedQuality:
    """The quality curves of the first served model's calibration (``served_qualities``)."""
    return next(iter(served_qualities(settings).values()))


def served_qualities(settings: SchedulerSettings) -> dict[str, ServedQuality]:
    """Each served model's quality curves (``shared.served``: model name -> its curves, the first served
    first; ``DuplicateModelName`` when two directories share a name): its own calibration's
    (``shared.calibration``: a bundle made for other weights is refused, naming what differs)."""
    return {m.name: quality_of(m.directory, m.calibration_dir or None)
            for m in served_models_of(settings, "DLS_SCHEDULER_MODEL_DIRS")}


def quality_of(model_dir: str, calibration_dir: str | None) -> ServedQuality:
    """The quality curves of one model's calibration (None: uncalibrated, said)."""
    calibration = find(model_dir, calibration_dir)
    if calibration is None:
        logger.warning(uncalibrated_message(model_dir))
        return ServedQuality(None, f"{model_dir} (uncalibrated)")
    path = calibration.quality_path
    try:
        return ServedQuality(json.loads(path.read_text()), str(path), str(calibration.profile_path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"DLS_SCHEDULER_QUALITY_BUDGET_PP: cannot read the accuracy curve {path}: {exc}") from None


def load_policy(settings: SchedulerSettings, quality: ServedQuality | None = None, *,
                qualities: dict[str, ServedQuality] | None = None):
    """The policy the settings name, its candidate thresholds from the served models' quality curves:
    ``qualities`` (model -> its curves, the first served first; None: read from the served models'
    calibrations), or one model's ``quality`` alone."""
    config = {}
    if settings.policy_config:
        path = Path(settings.policy_config)
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"DLS_SCHEDULER_POLICY_CONFIG: cannot read {path}: {exc}") from None
    fields = type(make_config(settings.policy)).model_fields
    if "thresholds" in fields and "thresholds" not in config:
        if qualities is None:
            qualities = {"": quality} if quality is not None else served_qualities(settings)
        if len(qualities) == 1:
            quality = next(iter(qualities.values()))
            config["thresholds"] = candidate_thresholds(settings, quality)
            # each request bounded by its canvas too (a policy config's own thresholds stand as given)
            if "canvas_floors" in fields and "canvas_floors" not in config:
                config["canvas_floors"] = tuple(sorted(canvas_floors_of(settings, quality,
                                                                        config["thresholds"]).items()))
        else:
            config.update(models_thresholds(settings, qualities, fields, config))
    return make_policy(settings.policy, config)


def models_thresholds(settings: SchedulerSettings, qualities: dict[str, ServedQuality], fields,
                      config: dict) -> dict:
    """Several models: the candidate thresholds are the union of each model's (``candidate_thresholds`` on
    its own curves), and each model's requests are held to its own lowest candidate and canvas floors
    (``model_floors``): an uncalibrated model's at the highest threshold alone. A request that names no
    model has the first served model's floors (the predictor's rule for "" too)."""
    floors, union = {}, set()
    for name, quality in qualities.items():
        candidates = candidate_thresholds(settings, quality)
        union |= set(candidates)
        floors[name] = ModelFloors(min(candidates), tuple(sorted(canvas_floors_of(settings, quality,
                                                                                  candidates).items())))
        logger.info("model %s: its requests run at %s and up", name, floors[name].lowest)
    first = next(iter(floors.values()))
    out = {"thresholds": tuple(sorted(union))}
    if "canvas_floors" in fields and "canvas_floors" not in config:
        out["canvas_floors"] = first.canvas_floors
    if "model_floors" in fields and "model_floors" not in config:
        out["model_floors"] = {"": first, **floors}
    return out


def canvas_floors_of(settings: SchedulerSettings, quality: ServedQuality, thresholds) -> dict[int, float]:
    """Each measured canvas's floor within the quality budget (``canvas_floors`` on the served
    model's quality curves): a request with a tight ``max_tokens`` keeps the budget on its canvas
    too. Empty when the budget is off or the model has no curves per canvas."""
    if settings.quality_budget_pp < 0 or not thresholds or quality.curves is None:
        return {}
    try:
        floors = canvas_floors(thresholds, quality.curves, settings.quality_budget_pp)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"DLS_SCHEDULER_QUALITY_BUDGET_PP: {quality.where}: {exc}") from None
    if floors:
        logger.info("threshold floors per canvas %s (within %.2f accuracy points)", floors, settings.quality_budget_pp)
    return floors


def candidate_thresholds(settings: SchedulerSettings, quality: ServedQuality) -> tuple[float, ...]:
    """``DLS_SCHEDULER_THRESHOLDS`` within ``DLS_SCHEDULER_QUALITY_BUDGET_PP`` accuracy points of the
    highest's on the served model's measured curves (its calibration's ``quality.json``, written by
    ``dls calibrate``): those ``DLS_SCHEDULER_QUALITY_CURVES`` names (the workload the deployment
    serves), else the short families' mix and every family, so that no family loses more than the
    budget (``candidates_from_quality``, the simulator's rule too). An uncalibrated model has the
    highest threshold alone (quality first: no lowering without a measured curve); a negative budget
    keeps them all, curve or not (the operator's explicit choice)."""
    thresholds = tuple(settings.thresholds)
    if settings.quality_budget_pp < 0:
        return thresholds
    if quality.curves is None:
        kept = (max(thresholds),)
        logger.warning("candidate thresholds %s: %s has no measured quality curve, so no threshold below the "
                       "highest is a candidate", list(kept), quality.where)
        return kept
    try:
        kept = candidates_from_quality(thresholds, quality.curves, settings.quality_budget_pp, settings.quality_curves)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"DLS_SCHEDULER_QUALITY_BUDGET_PP / _CURVES: {quality.where}: {exc}") from None
    logger.info("candidate thresholds %s (within %.2f accuracy points on %s, curves %s)", list(kept),
                settings.quality_budget_pp, quality.where, settings.quality_curves or "all")
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
        # step ids start at the clock in microseconds, so a restarted scheduler never reuses an id
        # that a worker may still answer for its predecessor
        # each served model's quality curves (model -> its curves, the first served first)
        qualities = served_qualities(settings) if policy is None else None
        quality = next(iter(qualities.values())) if qualities is not None else None
        # instances whose heartbeat names no profile (nor step times they measured) are planned with this
        self.fallback_profile = settings.profile or (quality.profile if quality is not None else "")
        self.core = StepScheduler(SchedulingLoop(policy if policy is not None
                                                 else load_policy(settings, qualities=qualities)),
                                  StepConfig(settings.overlap_min_tokens, settings.pipeline_steps,
                                             settings.held_repeats, settings.recompute_tokens,
                                             settings.first_step_waits),
                                  first_step_id=int(clock() * 1_000_000))
        self.view = self.core.view
        self.mask_token_id = mask_token_id
        self.clock = clock
        self.live: dict[str, _Telemetry] = {}  # request id -> what the metrics need (admitted, not ended)
        self.instances: dict[str, WorkerHeartbeat] = {}  # instance id -> its latest heartbeat (in the core)
        self.leases = LeaseTable()  # every instance heard within its lease (counted from receipt)
        self._profiles: dict[str, LatencyProfile] = {}  # path -> loaded profile
        self._measured_seen: dict[str, int] = {}  # instance -> served steps in the step times it last sent
        self._subscriptions = []
        self._tasks: list[asyncio.Task] = []
        self._intake: IntakeConsumer | None = None
        self._stopping = asyncio.Event()
        # workload window for the reconfigurator
        self._window_start = clock()
        self._window_arrivals: list[Arrival] = []
        self._window = {"finished": 0, "slo_met": 0, "rejected": 0, "threshold_sum": 0.0, "steps": 0}
        self._counters = {"malformed": 0, "timed_out_steps": 0}
        self.metrics = SchedulerMetrics()
        self.model_name = model_name(settings.served_model_dirs[0])  # the first served model (shared.served)
        self._metrics_server = None
        self._tracer = tracer("dls.scheduler")
        self._pending_results: list[StepResults] = []  # received, not handled yet (coalesced)
        self._results_scheduled = False  # a _drain_results call is scheduled
        self._outbox: list[tuple[str, bytes, dict | None]] = []  # step commands to publish, in order
        self._outbox_task: asyncio.Task | None = None
        self._deferred: list[Callable[[], None]] = []  # work to run once the queued commands are written
        self._owed: PendingResults | None = None  # results handled whose pass is queued in _deferred, merged
        self._threshold_samples: list[float] = []  # step thresholds not yet in the histogram
        self._predictor_down_until = 0.0  # no predict calls before this (the last one got no reply)
        # the predictor model answering (it changes when a retrain swaps; several models: "name=version,...")
        self.predictor_version = ""
        self.predictor_versions: dict[str, str] = {}  # model -> the version of its predictor that answered last
        # shadow decoding (core.quality_watch): None without a measured curve or a lower candidate. With
        # several models it watches the first served model's requests alone, against that model's curve
        self.quality_watch = quality_watch(settings, quality, self.loop.policy) if quality is not None else None
        self._watched_model = self.model_name if len(settings.served_model_dirs) > 1 else None  # None: every request
        # shadow id -> (the lowest threshold it was served at, its answer; None: not to judge)
        self._shadows: dict[str, tuple[float, list[int] | None]] = {}
        self._rng = random.Random(settings.shard)
        self._request_steps = self._shadow_steps = 0  # request-steps reported, of which shadow decodings'
        self._shadow_steps_running = 0  # steps of the shadow decodings not finished yet
        self._shadow_steps_judged = self._shadows_judged = 0  # steps of the finished ones, and how many
        self._eos_id = read_eos_token_id(settings.model_dir)

    @property
    def counters(self) -> dict[str, int]:
        """The service's counts (malformed messages, timed-out steps) and the core's (steps continued,
        pipelined, failed, lost, recovered; migrations)."""
        return {**self._counters, **self.core.counters}

    @property
    def loop(self) -> SchedulingLoop:
        return self.core.loop

    def _owns(self, key: str) -> bool:
        """Is this request id this replica's (``DLS_SCHEDULER_SHARDS`` > 1: by hash)? (An instance's
        shard is in its heartbeat.)"""
        return shard_of(key, self.settings.scheduler_shards) == self.settings.shard

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        shard, shards = self.settings.shard, self.settings.scheduler_shards

        async def open_intake() -> IntakeConsumer:  # both steps idempotent: a retry redoes them
            await ensure_intake_stream(self.js, self.subjects, num_replicas=self.settings.intake_replicas)
            return await IntakeConsumer.create(
                self.js, self.subjects, durable=self.settings.consumer_name + (f"-{shard}" if shards > 1 else ""),
                shard=shard, shards=shards, ack_wait_s=self.settings.ack_wait_s,
                max_payload_bytes=self.settings.max_payload_bytes,
            )

        # a scheduler (re)started while a NATS node is down or JetStream elects a leader waits for it
        self._intake = await retry_transient(open_intake, f"intake {self.subjects.intake_stream}", logger,
                                             errors=JETSTREAM_TRANSIENT_ERRORS, peer="JetStream")
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
        logger.info("scheduler stopped; step counters: %s", self.counters)

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
            if request.request_id in self.live:
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
                                                 output_tokens=stored.gen_length, slo_s=stored.slo_ms / 1000.0,
                                                 model=stored.model))
            requests.append(self._track(stored))
            self.metrics.prompt_tokens.labels(stored.model or self.model_name).inc(len(stored.prompt_token_ids))
        self._carry_out(self.core.on_arrivals(now, requests))
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
        """Register a stored request's telemetry and build the core's view of it, with its progress."""
        self.live[record.request_id] = _Telemetry(
            model=record.model or self.model_name, arrival_time=record.arrival_time, deadline=record.deadline,
            trace_context=record.trace_context,
        )
        request = Request(
            record.request_id, record.arrival_time, len(record.prompt_token_ids), record.gen_length,
            record.slo_ms / 1000.0, block_len=record.block_length, priority=record.priority,
            cache_mode=record.cache_mode, min_threshold=record.min_threshold, max_threshold=record.max_threshold,
            model=record.model, state_version=record.version,  # as named ("": any instance, as before)
        )
        # a resumed request keeps its progress (its next step is a recompute: no instance holds a cache)
        request.catch_up(record.num_steps, record.num_committed, record.current_block)
        return request

    async def _resume_in_flight(self) -> None:
        ids = await retry_transient(self.store.list_in_flight, "listing in-flight requests", logger)
        if not ids:
            return
        loaded = await retry_transient(lambda: self.store.load_many(ids), "loading in-flight requests", logger)
        records = [r for r in loaded if r is not None and not r.is_terminal and self._owns(r.request_id)]
        requests = [self._track(r) for r in records if r.request_id not in self.live]
        for record in records:  # a shadow decoding an earlier scheduler started: finished, never judged
            if record.request_id.startswith(SHADOW_PREFIX):
                self._shadows.setdefault(record.request_id, (1.0, None))
        if requests:
            logger.info("resuming %d in-flight requests from Redis", len(requests))
            self._carry_out(self.core.on_arrivals(self.clock(), requests))

    # --- workers ---------------------------------------------------------------------------------

    async def _on_heartbeat(self, msg) -> None:
        try:
            beat = codec.decode(WorkerHeartbeat, msg.data, self.settings.max_payload_bytes)
        except codec.CodecError as exc:
            self._counters["malformed"] += 1
            self.metrics.malformed.labels(subject="heartbeat").inc()
            logger.warning("dropping a malformed heartbeat: %s", exc)
            return
        if beat.shard != self.settings.shard and self.settings.scheduler_shards > 1:
            return  # another scheduler shard's instance
        now = self.clock()
        observed = self.leases.observe(beat, now)
        if observed is Observed.IGNORED:
            return  # a late heartbeat, older than one already taken
        known = beat.instance_id in self.instances
        if known and observed is Observed.RESTARTED:
            logger.warning("instance %s restarted: its steps in flight are lost", beat.instance_id)
            self._fail_instance(beat.instance_id)
            known = False
        if known and beat.model != self.instances[beat.instance_id].model:
            # another model under the same id: it leaves (its requests resume on instances of theirs) and joins anew
            logger.warning("instance %s now serves %s (was %s): it leaves and joins again", beat.instance_id,
                           beat.model, self.instances[beat.instance_id].model)
            self._fail_instance(beat.instance_id)
            known = False
        if observed is Observed.ENDED:
            if known:
                self._fail_instance(beat.instance_id)
            return
        if step_stuck(beat, self.settings.step_timeout_s):  # alive, but its step never returns: hung
            if known:
                logger.warning("instance %s: its step has been computing for %.0f s (hung); its requests resume "
                               "elsewhere", beat.instance_id, beat.step_running_s)
                self._fail_instance(beat.instance_id)
            return
        if not known:
            self._join(beat, now)
            return
        self.instances[beat.instance_id] = beat
        inst = self.view.instances.get(beat.instance_id)
        if (beat.measured is not None and inst is not None and inst.alive  # its step times, kept current
                and self._measured_seen.get(beat.instance_id) != beat.measured.served_steps):
            self._measured_seen[beat.instance_id] = beat.measured.served_steps
            profile = self._profile(beat)
            if profile is not None:
                self.view.set_profile(beat.instance_id, profile)
        if beat.status == WorkerStatus.DRAINING and inst is not None and inst.alive:
            logger.info("instance %s draining: its requests move away", beat.instance_id)
            self._carry_out(self.core.drain_instance(now, beat.instance_id))

    def _join(self, beat: WorkerHeartbeat, now: float) -> None:
        if beat.status != WorkerStatus.READY:
            return  # starting (or draining before we ever used it): nothing to do yet
        profile = self._profile(beat)
        if profile is None:
            return
        self.instances[beat.instance_id] = beat
        logger.info("instance %s joined (model %s, tp %d, node %s)", beat.instance_id, beat.model, beat.tp, beat.node)
        memory = beat.kv.capacity_tokens if beat.kv is not None and beat.kv.capacity_tokens > 0 else None
        if memory is not None:
            logger.info("instance %s holds %d KV tokens (%d bytes per GPU)", beat.instance_id, memory,
                        beat.kv.budget_bytes)
        self._carry_out(self.core.add_instance(now, beat.instance_id, beat.tp, profile, node_id=beat.node,
                                               max_batch=min(beat.max_batch, profile.max_batch(beat.tp)),
                                               mem_limit_tokens=memory, model=beat.model))

    def _profile(self, beat: WorkerHeartbeat) -> LatencyProfile | None:
        if not beat.profile and beat.measured is not None:  # uncalibrated: the step times its worker measures
            m = beat.measured
            try:
                return online_profile(beat.model, beat.tp, m.context_tokens, m.block_length,
                                      {"recompute_ms": m.recompute_ms, "cache_ms": m.cache_ms, "full_ms": m.full_ms},
                                      m.served_steps)
            except ProfileError as exc:
                logger.warning("instance %s: its measured step times are unusable (%s)", beat.instance_id, exc)
        for path in (beat.profile, self.fallback_profile):
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
                if lease.instance_id in self.instances:
                    logger.warning("instance %s: lease expired (no heartbeat for %.1f s); its requests resume "
                                   "elsewhere", lease.instance_id, now - lease.received_at)
                    self._fail_instance(lease.instance_id)
            for iid in self.core.overdue(now, self.settings.step_timeout_s):
                # the command or its results got lost (a NATS node went away): the instance is dropped
                # and joins again with its next heartbeat; its requests resume from Redis
                logger.warning("instance %s: its step is unanswered after %.0f s; its requests resume from Redis",
                               iid, self.settings.step_timeout_s)
                self._counters["timed_out_steps"] += 1
                self._fail_instance(iid)

    def _fail_instance(self, instance_id: str) -> None:
        self.instances.pop(instance_id, None)
        self._carry_out(self.core.fail_instance(self.clock(), instance_id))

    # --- the core's decisions, carried out ---------------------------------------------------------

    def _carry_out(self, decisions: StepDecisions) -> None:
        for rejection in decisions.rejections:
            self.live.pop(rejection.request_id, None)
            self._window["rejected"] += 1
            self.metrics.rejected.inc()
            self._tasks.append(asyncio.create_task(self._finish_failed(
                rejection.request_id, _REJECT_TO_FAILURE[rejection.reason], rejection.detail or rejection.reason.name,
                RequestStatus.REJECTED,
            )))
        for migration in decisions.migrations:
            self.metrics.migrations.inc()
            self._trace_migration(migration)
        for preemption in decisions.preemptions:
            self.metrics.preemptions.inc()
            logger.info("request %s on %s yields its KV memory%s", preemption.request_id, preemption.instance_id or "?",
                        f" to {preemption.for_request_id}" if preemption.for_request_id else " (its worker's budget "
                        "refused its step)")
        for command in decisions.commands:
            self._publish_command(command)
        for request_id in decisions.reload_ids:
            self._tasks.append(asyncio.create_task(self._reload(request_id)))
        for instance_id in decisions.removed_ids:
            logger.info("instance %s drained", instance_id)

    def _publish_command(self, command: StepCommand) -> None:
        headers = None
        if command.items and not command.after_step_id:
            self.metrics.batch_size.observe(len(command.items))
            if tracing_active():
                ids = [it.request_id for it in command.items]
                span = self._batch_span("scheduler.step_command", ids, SpanKind.PRODUCER, {
                    "dls.instance_id": command.instance_id, "dls.step_id": command.step_id,
                    "dls.batch_size": len(ids), "dls.num_load_state": sum(it.load_state for it in command.items)})
                headers = header_context(span) or None
                span.end()
        self._publish(self.subjects.step(command.instance_id), command, headers)

    # --- step results --------------------------------------------------------------------------------

    async def _on_results(self, msg) -> None:
        try:
            results = codec.decode(StepResults, msg.data, self.settings.max_payload_bytes)
        except codec.CodecError as exc:
            self._counters["malformed"] += 1
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
        try:
            self._handle_results(now_batch)
        except Exception:  # noqa: BLE001 (a bug must not stop the step loop: log it, keep serving)
            logger.exception("handling %d step result(s) failed", len(now_batch))

    def _handle_results(self, batch: list[StepResults]) -> None:
        """The critical path (``on_results``: continued steps go out at once), then, once those
        commands are written (with overlap) and the fresh predictions are in, ``finish_results``."""
        now = self.clock()
        passed = self.core.on_results(now, [self._outcome_of(results) for results in batch])
        for instance_id, step_id in passed.ignored:
            logger.warning("ignoring results of step %d from %s (not the step in flight)", step_id, instance_id)
        for note in passed.notes:
            logger.warning(note)
        ignored = set(passed.ignored)
        for results in batch:
            if (results.instance_id, results.step_id) not in ignored:
                self._observe_results(results, now)
        self._carry_out(passed.decisions)
        if not passed.pending.instance_ids:
            return
        if not self.core.config.overlap:
            self._finish_results(passed.pending)
        elif self._owed is None:
            self._owed = passed.pending
            self._after_dispatch(self._finish_owed)
        else:  # one pass for all the results handled before it runs (one pass per wake-up)
            self._owed.merge(passed.pending)

    def _finish_owed(self) -> None:
        pending, self._owed = self._owed, None
        if pending is not None:
            self._finish_results(pending)

    def _finish_results(self, pending: PendingResults) -> None:
        if self._waits_for_predictions(pending.stepped_ids):
            self._spawn(self._finish_after_predictions(pending))
        else:
            self._carry_out(self.core.finish_results(self.clock(), pending))
            self._ask_predictions(pending.stepped_ids)

    async def _finish_after_predictions(self, pending: PendingResults) -> None:
        """Fresh predictions for the requests that stepped, waited for at most ``predict_wait_s``, so
        that their next thresholds use them (a fire-and-forget request would land one step late)."""
        try:
            queries = self.core.queries(pending.stepped_ids)
            predictions = await self._request_predictions(queries, self.settings.predict_wait_s) or {}
            for rid, prediction in predictions.items():
                self._note_prediction(rid, prediction)
            self._carry_out(self.core.finish_results(self.clock(), pending, predictions))
            self._ask_predictions([rid for rid in pending.stepped_ids if rid not in predictions])
        except Exception:  # noqa: BLE001 (a bug must not stop the step loop: log it, keep serving)
            logger.exception("the scheduling pass after %d step result(s) failed", len(pending.instance_ids))

    def _waits_for_predictions(self, stepped: list[str]) -> bool:
        return self.settings.predict_wait_s > 0 and bool(stepped) and self.clock() >= self._predictor_down_until

    def _outcome_of(self, results: StepResults) -> BatchOutcome:
        """A worker's results as the core's outcome."""
        for failure in results.failures:
            if failure.request_id in self.live:
                logger.warning("step of %s failed on %s: %s", failure.request_id, results.instance_id,
                               failure.reason)
        outcomes = tuple(
            StepOutcome(r.request_id, len(r.committed_positions), r.block_done, r.finished,
                        r.kind == StepKind.RECOMPUTE, state_version=r.state_version, confidence=r.confidence.as_tuple,
                        num_masked=r.num_masked, predicted_end=r.predicted_end)
            for r in results.results)
        return BatchOutcome(results.instance_id, outcomes, results.duration_s, step_id=results.step_id,
                            failed_ids=tuple(f.request_id for f in results.failures if f.kind != FailureKind.KV_FULL),
                            kv_full_ids=tuple(f.request_id for f in results.failures if f.kind == FailureKind.KV_FULL),
                            continued_step_id=results.continued_step_id, awaits_held=results.awaits_held)

    def _observe_results(self, results: StepResults, now: float) -> None:
        """Metrics of one worker's results: thresholds, outputs (TTFT, inter-token), finishes."""
        window = self._window
        num_observed = 0
        for r in results.results:
            telemetry = self.live.get(r.request_id)
            if telemetry is None:
                continue  # cancelled while its step ran
            num_observed += 1
            self._request_steps += 1
            if r.request_id in self._shadows:  # a shadow decoding: counted apart, judged when it ends
                self._shadow_steps += 1
                self._shadow_steps_running += 1
                self.metrics.shadow_steps.inc()
                if r.finished:
                    self._shadow_steps_running -= r.num_steps
                    self._shadow_steps_judged += r.num_steps
                    self._shadows_judged += 1
                    self.live.pop(r.request_id, None)
                    self._spawn(self._judge_shadow(r.request_id))
                continue
            window["threshold_sum"] += r.threshold
            window["steps"] += 1
            self._threshold_samples.append(r.threshold)
            telemetry.threshold_sum += r.threshold
            telemetry.num_threshold_steps += 1
            telemetry.last_threshold = r.threshold
            telemetry.lowest_threshold = min(telemetry.lowest_threshold, r.threshold)
            if r.block_done or r.finished:
                self._observe_output(telemetry, now)
            if r.finished:
                self.live.pop(r.request_id, None)
                window["finished"] += 1
                window["slo_met"] += now <= telemetry.deadline
                self._observe_finish(r.request_id, telemetry, r.num_steps, now, r.num_answer_tokens)
                watch = self.quality_watch
                if (watch is not None and self._watched_model in (None, telemetry.model)
                        and len(self._shadows) < self.settings.shadow_max_in_flight
                        and watch.wants(telemetry.lowest_threshold, self._rng.random(), self._shadow_steps,
                                    self._request_steps, self._shadow_reserve(r.num_steps))):
                    self._spawn(self._start_shadow(r.request_id, telemetry.lowest_threshold))
        if num_observed:
            self.metrics.steps.inc(num_observed)
            if len(self._threshold_samples) == num_observed:  # the first of this batch: observe them later
                self._after_dispatch(self._observe_thresholds)

    # --- shadow decoding (core.quality_watch) ----------------------------------------------------

    def _spawn(self, coroutine) -> None:
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.create_task(coroutine))

    def _shadow_reserve(self, served_steps: int) -> float:
        """The steps the shadows running and one more are expected to take yet: each as many as the
        shadows judged so far took on average (before any: twice the served request's), less what
        the running ones took already."""
        expected = (self._shadow_steps_judged / self._shadows_judged if self._shadows_judged
                    else 2.0 * served_steps)
        running = len(self._shadows) + 1
        return max(running * expected - self._shadow_steps_running, expected)

    async def _start_shadow(self, request_id: str, lowest: float) -> None:
        """Decode a finished request again at the highest candidate, at the lowest priority: it waits for
        a free slot and load control visits it last, so it lowers nobody's threshold."""
        record = await retry_transient(lambda: self.store.load(request_id), f"loading {request_id}", logger)
        if record is None or record.status != RequestStatus.FINISHED or self.quality_watch is None:
            return
        now = self.clock()
        shadow = shadow_record(record, self.quality_watch.top, now)
        try:
            stored = await self.store.create(shadow)
        except Exception as exc:  # noqa: BLE001 (a shadow is optional: skip it)
            logger.warning("shadow decoding of %s not started: %s", request_id, exc)
            return
        self._shadows[stored.request_id] = (lowest, record.answer(self._eos_id).token_ids)
        self._carry_out(self.core.on_arrivals(now, [self._track(stored)]))
        self._ask_predictions([stored.request_id])

    async def _judge_shadow(self, shadow_id: str) -> None:
        lowest, served = self._shadows.pop(shadow_id)
        if served is None or self.quality_watch is None:
            return
        record = await retry_transient(lambda: self.store.load(shadow_id), f"loading {shadow_id}", logger)
        if record is None or record.status != RequestStatus.FINISHED:
            return
        watch = self.quality_watch
        agreed = record.answer(self._eos_id).token_ids == served
        key = watch.observe(lowest, agreed)
        self.metrics.shadow_decodings.labels(threshold=str(key)).inc()
        self.metrics.shadow_agreement.labels(threshold=str(key)).set(watch.agreement(key))
        floor = watch.floor()
        grid = self.loop.policy.grid
        if floor > grid.lowest_of(self._watched_model):
            logger.warning("shadow decoding: answers served at %s agreed with the highest threshold's %.1f%% of %d "
                           "times, below the %.1f%% the quality curve promised: candidates below %s withdrawn",
                           key, 100 * watch.agreement(key), watch.counts[key][1], 100 * watch.promised.get(key, 1.0),
                           floor)
            grid.withdraw_below(floor, self._watched_model)
            self.metrics.quality_floor.set(floor)

    def _observe_thresholds(self) -> None:
        """The step thresholds' histogram, filled once the step commands are out (off the hot path)."""
        samples, self._threshold_samples = self._threshold_samples, []
        for threshold in samples:
            self.metrics.threshold.observe(threshold)

    async def _reload(self, request_id: str) -> None:
        """Read back a request whose step was lost or failed; the core catches up with what Redis says."""
        record = await retry_transient(lambda: self.store.load(request_id), f"reloading {request_id}", logger)
        if request_id not in self.view.requests:
            return
        stored = None
        if record is None or record.is_terminal:
            # finished (a worker wrote it, its result was lost) or gone: the core forgets it; the
            # gateway, hearing no final event, finds the result in Redis (DLS_GATEWAY_RESULT_POLL_S)
            self.live.pop(request_id, None)
            if record is None:
                await self._fail(request_id, FailureReason.INTERNAL, "request state vanished from Redis", seq=10**6)
        else:
            stored = StoredProgress(record.version, record.num_steps, record.num_committed, record.current_block)
        before = self.core.counters["recovered_steps"]
        self._carry_out(self.core.reloaded(self.clock(), request_id, stored))
        if self.core.counters["recovered_steps"] > before:
            logger.info("request %s: %d stored step(s) recovered", request_id,
                        self.core.counters["recovered_steps"] - before)

    # --- predictions -----------------------------------------------------------------------------

    def _ask_predictions(self, request_ids: list[str]) -> None:
        """Fire-and-forget: the predictions reach the core when they come (``on_prediction``)."""
        if not request_ids or self.clock() < self._predictor_down_until:
            return  # the last call got no reply: no predictor for a while (the core keeps its estimates)
        queries = self.core.queries(request_ids)
        if queries:
            self._spawn(self._predict(queries))

    async def _predict(self, queries: list[PredictionQuery]) -> None:
        predictions = await self._request_predictions(queries, self.settings.predictor_timeout_s)
        now = self.clock()
        for rid, prediction in (predictions or {}).items():
            self.core.on_prediction(now, rid, prediction)
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
        self._note_predictor_versions(reply)
        return {p.request_id: Prediction({float(t): (s.recompute_steps, s.cache_steps)
                                          for t, s in p.threshold_to_steps.items()}, p.made_at_step)
                for p in reply.predictions}

    def _note_predictor_versions(self, reply: PredictReply) -> None:
        """Log each served model's predictor version when it changes (a retrain swapped one in)."""
        model_to_version = reply.model_versions or {"": reply.model_version}  # an older predictor: one version
        for model, version in model_to_version.items():
            before = self.predictor_versions.get(model, "")
            if version != before:
                logger.info("predictions%s now from predictor model %s (before: %s)", f" of {model}" if model else "",
                            version, before or "none")
                self.predictor_versions[model] = version
        versions = self.predictor_versions
        self.predictor_version = (next(iter(versions.values())) if len(versions) == 1
                                  else ",".join(f"{m}={v}" for m, v in sorted(versions.items())))

    # --- cancellations, failures, events -----------------------------------------------------------

    async def _on_cancel(self, msg) -> None:
        try:
            cancel = codec.decode(CancelRequest, msg.data, self.settings.max_payload_bytes)
        except codec.CodecError as exc:
            self._counters["malformed"] += 1
            self.metrics.malformed.labels(subject="cancel").inc()
            logger.warning("dropping a malformed cancel: %s", exc)
            return
        request = self.view.requests.get(cancel.request_id)
        if request is None or request.status.is_terminal:
            return
        num_steps = request.num_steps_done
        self.live.pop(cancel.request_id, None)
        self._carry_out(self.core.cancel(self.clock(), cancel.request_id, cancel.reason or "cancelled"))
        await self._finish_failed(cancel.request_id, FailureReason.CANCELLED, cancel.reason or "cancelled",
                                  RequestStatus.CANCELLED, num_steps)

    async def _finish_failed(self, request_id: str, reason: FailureReason, detail: str, status: RequestStatus,
                             num_steps: int = 0) -> None:
        """Store the terminal status (retrying a lost race with a worker's write), then tell the gateway."""
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
        self._shadows.pop(request_id, None)  # a shadow decoding refused or lost: nobody waits for it
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
        telemetry = self.live.get(request_id)
        return context_of(telemetry.trace_context) if telemetry is not None else None

    def _batch_span(self, name: str, request_ids: list[str], kind: SpanKind, attributes: dict):
        """A span about a batch of requests: in the trace of the first, linked to the others'."""
        parent = self._request_context(request_ids[0]) if request_ids else None
        links = [link for rid in request_ids[1:] if rid in self.live
                 for link in [link_to(self.live[rid].trace_context)] if link is not None]
        return self._tracer.start_span(name, context=parent or otel_context.Context(), kind=kind, links=links,
                                       attributes={**attributes, "dls.request_ids": list(request_ids)})

    def _trace_migration(self, assignment) -> None:
        parent = self._request_context(assignment.request_id)
        if parent is None:
            return
        self._tracer.start_span("scheduler.migrate", context=parent, attributes={
            "dls.request_id": assignment.request_id, "dls.to_instance_id": assignment.instance_id,
            "dls.from_instance_id": assignment.from_instance_id or "",
            "dls.threshold": float(assignment.threshold)}).end()

    def _note_prediction(self, request_id: str, prediction: Prediction) -> None:
        telemetry = self.live.get(request_id)
        if telemetry is None:
            return
        threshold_to_remaining = {t: sum(steps) for t, steps in prediction.threshold_to_steps.items()}
        if telemetry.first_prediction is None:  # kept for the predictor-error metric at finish
            telemetry.first_prediction = (prediction.made_at_step, threshold_to_remaining)
            telemetry.threshold_sum, telemetry.num_threshold_steps = 0.0, 0
        parent = context_of(telemetry.trace_context)
        if parent is not None:
            thresholds = sorted(threshold_to_remaining)
            self._tracer.start_span("scheduler.prediction", context=parent, attributes={
                "dls.request_id": request_id, "dls.made_at_step": prediction.made_at_step,
                "dls.thresholds": thresholds,
                "dls.predicted_remaining_steps": [threshold_to_remaining[t] for t in thresholds]}).end()

    def _observe_output(self, telemetry: _Telemetry, now: float) -> None:
        """A block of the request's answer was committed: its TTFT, or a gap between two blocks."""
        if telemetry.first_output_at is None:
            telemetry.first_output_at = now
            self.metrics.ttft.labels(telemetry.model).observe(max(now - telemetry.arrival_time, 0.0))
        else:
            self.metrics.itl.labels(telemetry.model).observe(max(now - telemetry.last_output_at, 0.0))
        telemetry.last_output_at = now

    def _observe_finish(self, request_id: str, telemetry: _Telemetry, num_steps: int, now: float,
                        num_answer_tokens: int = 0) -> None:
        self.metrics.finished.inc()
        latency_s = now - telemetry.arrival_time
        slo_met = now <= telemetry.deadline
        if slo_met:
            self.metrics.slo_met.inc()
        self.metrics.latency.observe(latency_s)
        e2e_s = max(latency_s, 0.0)
        self.metrics.e2e.labels(telemetry.model).observe(e2e_s)
        self.metrics.generation_tokens.labels(telemetry.model).inc(num_answer_tokens)
        if num_answer_tokens > 1 and telemetry.first_output_at is not None:
            first = max(telemetry.first_output_at - telemetry.arrival_time, 0.0)
            self.metrics.tpot.labels(telemetry.model).observe((e2e_s - first) / (num_answer_tokens - 1))
        error = None
        if telemetry.first_prediction is not None:
            made_at, threshold_to_remaining = telemetry.first_prediction
            used = (telemetry.threshold_sum / telemetry.num_threshold_steps if telemetry.num_threshold_steps
                    else telemetry.last_threshold)
            error = predictor_error(made_at, threshold_to_remaining, used, num_steps)
            if error is not None:
                self.metrics.predictor_error.observe(error)
        parent = context_of(telemetry.trace_context)
        if parent is not None:
            attributes = {"dls.request_id": request_id, "dls.num_steps": num_steps, "dls.slo_met": slo_met,
                          "dls.latency_s": latency_s}
            if error is not None:
                attributes["dls.predictor_error"] = error
            self._tracer.start_span("scheduler.finish", context=parent, attributes=attributes).end()

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.set(self.view.num_queued)
        self.metrics.in_flight.set(len(self.live))
        queued = {r.request_id for r in self.view.iter_queued()}
        model_to_counts: dict[str, list[int]] = {self.model_name: [0, 0]}  # model -> [running, waiting]
        for request_id, telemetry in self.live.items():
            model_to_counts.setdefault(telemetry.model, [0, 0])[request_id in queued] += 1
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
                num_in_flight=len(self.live),
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


# below any client's: a shadow decoding takes a slot nobody else wants, and as background work it is
# outside load control's accounting (its hour-long SLO would stretch the capacity window)
SHADOW_PRIORITY = BACKGROUND_PRIORITY
SHADOW_PREFIX = "shadow-"
SHADOW_SLO_S = 3600.0


def shadow_record(record: RequestRecord, top: float, now: float) -> RequestRecord:
    """A finished request's prompt and generation settings as a fresh request fixed at ``top``."""
    return RequestRecord(
        request_id=f"{SHADOW_PREFIX}{record.request_id}", prompt_token_ids=list(record.prompt_token_ids),
        canvas=[record.mask_token_id] * record.gen_length, mask_token_id=record.mask_token_id,
        gen_length=record.gen_length, block_length=record.block_length, cache_mode=record.cache_mode,
        max_tokens=record.max_tokens, ignore_eos=record.ignore_eos, arrival_time=now,
        deadline=now + SHADOW_SLO_S, slo_ms=SHADOW_SLO_S * 1000, priority=SHADOW_PRIORITY,
        min_threshold=top, max_threshold=top, seed=record.seed, temperature=record.temperature,
        top_p=record.top_p, top_k=record.top_k, stop=list(record.stop), model=record.model, owner="shadow",
    )


def quality_watch(settings: SchedulerSettings, quality: ServedQuality, policy) -> QualityWatch | None:
    """The watch over the served model's quality curve (its short mix, ``accuracy``), or None: shadow
    decoding off, no measured curve, or no candidate below the highest."""
    grid = getattr(policy, "grid", None)
    if settings.shadow_rate <= 0 or quality.curves is None or grid is None or len(grid.values) < 2:
        return None
    curve = quality.curves.get("accuracy")
    if not isinstance(curve, dict):
        return None
    source = str(quality.curves.get("source", "labelled"))
    return QualityWatch(grid.values, promised_agreement(curve, source, grid.values), settings.shadow_min_samples,
                        settings.shadow_tolerance_pp / 100.0, settings.shadow_rate, settings.shadow_step_budget)


def read_eos_token_id(model_dir: str) -> int | None:
    """The EOS id of the model's config.json (None: none, or a list of them)."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    eos = raw.get("eos_token_id")
    return eos if isinstance(eos, int) else None


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
