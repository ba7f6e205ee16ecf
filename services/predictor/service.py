"""The predictor service: remaining-step predictions over NATS request/reply.

A thin loop around the core's predictors (``services/predictor/core/predictor.py``):

- ``predict`` (queue group ``queue_group``, so replicas share the load): a ``PredictRequest`` with
  every query of a scheduling round. Its queries become the core's ``PredictionQuery`` field by
  field, the whole batch goes to the LightGBM boosters in one call (in a thread, so the loop keeps
  answering while it runs), and the answer is a ``PredictReply`` in query order with the model's
  version. ``one_shot`` requests (or every request, with ``mode = "one-shot"``) use the arrival-time
  model (``oneshot/`` beside the online one in the served model's calibration bundle), loaded the
  first time it is needed. A model with no calibration is answered by ``BoundPredictor`` (the most
  steps a request can take), said at start.
- Served requests (``DLS_PREDICTOR_RETRAIN``, ``DLS_PREDICTOR_LIVE_ERROR_ROWS``): on each
  ``RequestFinished`` (``<p>.events.*``) the request's record and step records are read back from the
  state store and turned into labelled states (``core/served.py``: the rows ``dls collect-traces``
  writes); the serving predictor's error on them feeds ``dls_predictor_live_error``, and they join the
  retraining window. Every ``DLS_PREDICTOR_RETRAIN_INTERVAL_S`` a new online model is trained on the
  window in a thread (answers go on meanwhile) and replaces the serving one only where its error on the
  most recent requests, held out, is lower (``core/retraining.py``); replies carry its version from then
  on. A restart serves the calibration's predictor again (``DLS_PREDICTOR_LIVE_DIR`` keeps a copy of
  each replacement to inspect or install).
- Any failure (a malformed payload, a prediction error) is logged, counted and answered with
  ``error`` set; the service never crashes on a message.
- SIGTERM / SIGINT: the subscription is drained (requests already received are answered), then
  the connection closes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.trace import SpanKind

from services.predictor.core.loading import ONE_SHOT_DIR
from services.predictor.core.model import RECOMPUTE_FILE, TOTAL_FILE, StepModel
from services.predictor.core.predictor import BoundPredictor, InProcessPredictor, OneShotPredictor, Predictor
from services.predictor.core.predictor import PredictionQuery as CoreQuery
from services.predictor.core.predictor import StepPrediction as CoreStepPrediction
from services.predictor.core.retraining import (
    LiveError,
    RetrainConfig,
    RetrainOutcome,
    ServedWindow,
    not_ready,
    relative_errors,
    retrain,
)
from services.predictor.core.served import LabelledState, UnusableSteps, states_from_steps
from shared.calibration import of_service, uncalibrated_message
from shared.messages import codec
from shared.messages.events import RequestEvent, RequestFinished
from shared.messages.predictor import (
    PredictionQuery,
    PredictReply,
    PredictRequest,
    RemainingSteps,
    StepPrediction,
)
from shared.metrics import PredictorMetrics, serve_metrics
from shared.runtime import connect_nats, on_stop_signals
from shared.settings import PredictorSettings
from shared.state import RedisStateStore, StateStore
from shared.subjects import Subjects
from shared.telemetry import extract_context, setup_tracing, shutdown_tracing, tracer

logger = logging.getLogger("dls.predictor")


@dataclass(frozen=True)
class LoadedPredictor:
    """A core predictor and the version string its replies carry."""

    predictor: Predictor
    version: str  # "<feature set>:<hash of the booster files>"


def load(directory: str | Path, one_shot: bool) -> LoadedPredictor:
    """The predictor trained in ``directory`` (``ModelError`` if unusable)."""
    model = StepModel.load(directory)
    predictor = OneShotPredictor(model) if one_shot else InProcessPredictor(model)
    return LoadedPredictor(predictor, model_version(directory, model))


def model_version(directory: str | Path, model: StepModel) -> str:
    digest = hashlib.sha256()
    for name in (TOTAL_FILE, RECOMPUTE_FILE):
        digest.update((Path(directory) / name).read_bytes())
    return f"{model.feature_set}:{digest.hexdigest()[:12]}"


def trained_version(model: StepModel) -> str:
    """The version of a model trained in this process (the same form: a hash of its boosters' text)."""
    digest = hashlib.sha256()
    for booster in (model.total, model.recompute):
        digest.update(booster.model_to_string().encode())
    return f"{model.feature_set}:{digest.hexdigest()[:12]}"


def to_core_query(query: PredictionQuery) -> CoreQuery:
    """The wire query as the core's (the two mirror each other field by field)."""
    return CoreQuery(
        request_id=query.request_id,
        num_steps_done=query.num_steps_done,
        gen_length=query.gen_length,
        prompt_length=query.prompt_length,
        block_length=query.block_length,
        num_committed=query.num_committed,
        block_committed=query.block_committed,
        block_size=query.block_size,
        block_index=query.block_index,
        confidence=None if query.confidence is None else tuple(query.confidence),
        uses_cache=query.uses_cache,
        threshold=query.threshold,
        predicted_end=query.predicted_end,
    )


def to_wire_prediction(prediction: CoreStepPrediction) -> StepPrediction:
    return StepPrediction(
        request_id=prediction.request_id,
        made_at_step=prediction.made_at_step,
        threshold_to_steps={
            threshold: RemainingSteps(recompute_steps=float(steps.recompute_steps), cache_steps=float(steps.cache_steps))
            for threshold, steps in prediction.threshold_to_steps.items()
        },
    )


class PredictorService:
    """Answers ``PredictRequest``s on ``nc`` with the predictors of the served model's calibration
    (``settings.model_dir``, ``shared.calibration``); an uncalibrated model gets ``BoundPredictor``.
    With a ``store`` it reads finished requests back, measures its live error and retrains on them."""

    def __init__(self, settings: PredictorSettings, nc, store: StateStore | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.nc = nc
        self.store = store
        self.clock = clock
        self.subjects = Subjects(settings.subject_prefix)
        self.calibration = of_service(settings)  # refused (naming what differs) when made for other weights
        if self.calibration is None:
            logger.warning(uncalibrated_message(settings.model_dir))
        self.num_requests = 0  # requests answered with predictions
        self.num_errors = 0  # requests answered with an error (malformed ones included)
        self.num_malformed = 0  # payloads that did not decode as a PredictRequest
        self._loaded: dict[bool, LoadedPredictor] = {}  # one_shot -> predictor
        self._subscription = None
        self.metrics = PredictorMetrics()
        self._tracer = tracer("dls.predictor")
        self.window = ServedWindow(settings.retrain_window_rows)  # finished requests' states to retrain on
        self.live = LiveError(max(settings.live_error_rows, 1))
        self.retrain_config = RetrainConfig(settings.retrain_window_rows, settings.retrain_min_rows,
                                            settings.retrain_holdout_share)
        self.retrain_outcomes: list[RetrainOutcome] = []  # every retrain so far, in order
        self._num_added_at_retrain = 0  # ``window.num_added`` when the last retrain took its snapshot
        self._events_subscription = None
        self._retrain_task: asyncio.Task | None = None

    def load_models(self) -> None:
        """Load the predictor the mode needs up front, so a broken model directory fails at start."""
        self._predictor(one_shot=self.settings.mode == "one-shot")

    def _predictor(self, one_shot: bool) -> LoadedPredictor:
        if one_shot not in self._loaded and self.calibration is None:
            self._loaded[one_shot] = LoadedPredictor(BoundPredictor(), BoundPredictor.version)
            logger.info("predicting the most steps a request can take (no trained predictor)")
        if one_shot not in self._loaded:
            directory = self.calibration.predictor_dir
            directory = directory / ONE_SHOT_DIR if one_shot else directory
            self._loaded[one_shot] = load(directory, one_shot)
            logger.info("loaded the %s predictor from %s (%s)", "one-shot" if one_shot else "online", directory,
                        self._loaded[one_shot].version)
        return self._loaded[one_shot]

    async def start(self) -> None:
        self._subscription = await self.nc.subscribe(
            self.subjects.predict, queue=self.settings.queue_group, cb=self._on_request
        )
        logger.info("predictor answering on %s (queue group %s, mode %s)", self.subjects.predict,
                    self.settings.queue_group, self.settings.mode)
        if self.store is None or not self.settings.reads_served_requests:
            return
        # every replica reads every finished request (no queue group): each keeps its own window and model
        self._events_subscription = await self.nc.subscribe(self.subjects.events_all, cb=self._on_event)
        if self.settings.retrain and self.settings.mode == "online":
            self._retrain_task = asyncio.create_task(self._retrain_loop())
            logger.info("retraining on served requests every %g s (from %d rows; window %d rows, %g%% held out)",
                        self.settings.retrain_interval_s, self.settings.retrain_min_rows,
                        self.settings.retrain_window_rows, 100 * self.settings.retrain_holdout_share)
        elif self.settings.retrain:
            logger.info("no retraining in one-shot mode (it retrains the online model); the live error is measured")

    async def drain(self) -> None:
        """Stop taking requests; those already received are answered first."""
        if self._retrain_task is not None:
            self._retrain_task.cancel()
            self._retrain_task = None
        if self._events_subscription is not None:
            await self._events_subscription.unsubscribe()
            self._events_subscription = None
        if self._subscription is not None:
            await self._subscription.drain()
            self._subscription = None

    async def _on_request(self, msg) -> None:
        if not msg.reply:
            logger.warning("dropping a predict message without a reply subject (use request/reply)")
            return
        # a child of the scheduler's predict span (NATS headers), in the trace of the batch's first request
        with self._tracer.start_as_current_span("predictor.predict", context=extract_context(msg.headers),
                                                kind=SpanKind.SERVER):
            reply = await self.answer(msg.data)
        try:
            await msg.respond(codec.encode(reply, self.settings.max_payload_bytes))
        except codec.PayloadTooLargeError as exc:
            self.num_errors += 1
            logger.error("reply too large: %s", exc)
            await msg.respond(codec.encode(PredictReply(error=str(exc)), self.settings.max_payload_bytes))

    async def answer(self, data: bytes) -> PredictReply:
        """The reply to one encoded ``PredictRequest``; errors become ``PredictReply.error``."""
        try:
            request = codec.decode(PredictRequest, data, self.settings.max_payload_bytes)
        except codec.CodecError as exc:
            self.num_malformed += 1
            self.num_errors += 1
            self.metrics.malformed.labels(subject="predict").inc()
            logger.error("malformed predict request (%d so far): %s", self.num_malformed, exc)
            return PredictReply(error=str(exc))
        one_shot = request.one_shot or self.settings.mode == "one-shot"
        try:
            queries = [to_core_query(q) for q in request.queries]
            # NOTE: in a thread (the booster call releases the GIL), so the loop keeps its heartbeats to
            # NATS; a subscription's callbacks run one at a time, so one prediction runs at a time.
            predictions, version = await asyncio.to_thread(self._predict, one_shot, queries, request.thresholds)
        except Exception as exc:  # noqa: BLE001 (answer every request; the scheduler keeps its last prediction)
            self.num_errors += 1
            logger.exception("prediction failed for %d queries", len(request.queries))
            return PredictReply(error=f"{type(exc).__name__}: {exc}")
        self.num_requests += 1
        self.metrics.queries.inc(len(request.queries))
        self.metrics.batch_size.observe(len(request.queries))
        return PredictReply(predictions=[to_wire_prediction(p) for p in predictions], model_version=version)

    def _predict(self, one_shot: bool, queries: list[CoreQuery],
                 thresholds: list[float]) -> tuple[list[CoreStepPrediction], str]:
        loaded = self._predictor(one_shot)
        return loaded.predictor.predict(queries, thresholds), loaded.version

    # --- served requests: the live error and retraining ----------------------------------------------

    async def _on_event(self, msg) -> None:
        try:
            event = codec.decode(RequestEvent, msg.data, self.settings.max_payload_bytes)
        except codec.CodecError as exc:
            self.metrics.malformed.labels(subject="events").inc()
            logger.warning("malformed request event on %s: %s", msg.subject, exc)
            return
        if isinstance(event, RequestFinished):
            await self.served(event.request_id)

    async def served(self, request_id: str) -> list[LabelledState]:
        """Read a finished request back from the state store, score the serving predictor on its states
        (the live error) and keep them to retrain on; its states ([] where it gives none)."""
        try:
            record = await self.store.load(request_id)
            if record is None:
                raise UnusableSteps(f"request {request_id} is not stored (expired?)")
            states = states_from_steps(record, await self.store.load_steps(request_id))
        except UnusableSteps as exc:
            self.metrics.served_requests.labels(outcome="unusable").inc()
            logger.info("not learning from %s: %s", request_id, exc)
            return []
        except Exception as exc:  # noqa: BLE001 (the state store is down or a record does not decode: skip it)
            self.metrics.served_requests.labels(outcome="unusable").inc()
            logger.warning("cannot read finished request %s back: %s", request_id, exc)
            return []
        if not states:
            self.metrics.served_requests.labels(outcome="no_rows").inc()
            return []
        serving = self._predictor(one_shot=self.settings.mode == "one-shot")
        row_errors = await asyncio.to_thread(relative_errors, serving.predictor, states)
        for error in row_errors:
            self.metrics.served_error.observe(float(error))
        self.live.observe(row_errors)
        self.metrics.live_error.set(self.live.mre)
        if self.settings.retrain:
            self.window.add(states)
            self.metrics.window_rows.set(self.window.num_rows)
        self.metrics.served_requests.labels(outcome="used").inc()
        return states

    async def _retrain_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.retrain_interval_s)
            try:
                await self.retrain_once()
            except Exception:  # noqa: BLE001 (a failed retrain leaves the serving model; the next one may work)
                self.metrics.retrains.labels(outcome="failed").inc()
                logger.exception("retraining failed; the serving predictor stays")

    async def retrain_once(self) -> RetrainOutcome | None:
        """Train a new online model on the window (in a thread) and swap it in where it is better; None
        when no retrain is due (too few rows, nothing new)."""
        reason = not_ready(self.window, self.retrain_config, self._num_added_at_retrain)
        if reason is not None:
            logger.info("no retrain: %s", reason)
            return None
        snapshot, self._num_added_at_retrain = self.window.snapshot(), self.window.num_added
        serving = self._predictor(one_shot=False)
        started = time.perf_counter()
        outcome = await asyncio.to_thread(retrain, snapshot, serving.predictor, self.retrain_config,
                                          {"made_at": self.clock(), "replaces": serving.version})
        seconds = time.perf_counter() - started
        version = serving.version
        if outcome.swapped:
            version = trained_version(outcome.model)
            self._loaded[False] = LoadedPredictor(InProcessPredictor(outcome.model), version)
            if self.settings.live_dir:
                await asyncio.to_thread(outcome.model.save, self.settings.live_dir)
        self.retrain_outcomes.append(outcome)
        self._record_retrain(outcome, seconds)
        logger.info("retrained on %d requests (%d rows to train, %d held out) in %.1f s: held-out error %.3f "
                    "(serving %s) vs %.3f (new): %s", outcome.num_requests, outcome.num_train_rows,
                    outcome.num_holdout_rows, seconds, outcome.old_error, serving.version, outcome.new_error,
                    f"swapped, now {version}" if outcome.swapped else "kept the serving model")
        return outcome

    def _record_retrain(self, outcome: RetrainOutcome, seconds: float) -> None:
        self.metrics.retrains.labels(outcome="swapped" if outcome.swapped else "kept").inc()
        self.metrics.retrain_error.labels(model="old").set(outcome.old_error)
        self.metrics.retrain_error.labels(model="new").set(outcome.new_error)
        self.metrics.retrain_rows.labels(split="train").set(outcome.num_train_rows)
        self.metrics.retrain_rows.labels(split="holdout").set(outcome.num_holdout_rows)
        self.metrics.retrain_seconds.set(seconds)


async def serve(settings: PredictorSettings) -> None:
    """Run until SIGTERM or SIGINT."""

    setup_tracing("dls-predictor", settings)
    store = (RedisStateStore.from_url(settings.redis_url, settings.redis_key_prefix)
             if settings.reads_served_requests else None)
    service = PredictorService(settings, nc=None, store=store)
    await asyncio.to_thread(service.load_models)
    serve_metrics(service.metrics.registry, settings.metrics_port, settings.metrics_host)
    service.nc = await connect_nats(settings, "dls-predictor")
    stop = on_stop_signals()
    await service.start()
    try:
        await stop.wait()
    finally:
        logger.info("predictor stopping: %d answered, %d errors (%d malformed), %d retrains (%d swapped)",
                    service.num_requests, service.num_errors, service.num_malformed, len(service.retrain_outcomes),
                    sum(o.swapped for o in service.retrain_outcomes))
        await service.drain()
        await service.nc.drain()
        if store is not None:
            await store.close()
        shutdown_tracing()
