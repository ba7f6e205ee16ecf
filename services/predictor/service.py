"""The predictor service: remaining-step predictions over NATS request/reply.

A thin loop around the core's predictors (``services/predictor/core/predictor.py``), one set per served
model (``models.py``: ``DLS_PREDICTOR_MODEL_DIRS``, else ``DLS_PREDICTOR_MODEL_DIR`` alone):

- ``predict`` (queue group ``queue_group``, so replicas share the load): a ``PredictRequest`` with
  every query of a scheduling round. Its queries become the core's ``PredictionQuery`` field by
  field, each query is answered by the predictor of the model it names (its request's; "": the first
  served; with one model served, that one whatever it names), each model's queries go to its LightGBM
  boosters in one call (in a thread, so the loop keeps answering while it runs), and the answer is a
  ``PredictReply`` in query order with the version of each model's predictor that answered. A query
  naming a model not served (several served) gets the whole reply's ``error``, naming it and the served
  ones. ``one_shot`` requests (or every request, with ``mode = "one-shot"``) use the arrival-time model
  (``oneshot/`` beside the online one in the model's calibration bundle), loaded the first time it is
  needed. A model with no calibration is answered by ``BoundPredictor`` (the most steps a request can
  take), said at start for that model.
- Served requests (``DLS_PREDICTOR_RETRAIN``, ``DLS_PREDICTOR_LIVE_ERROR_ROWS``): on each
  ``RequestFinished`` (``<p>.events.*``) the request's record and step records are read back from the
  state store and turned into labelled states (``core/served.py``: the rows ``dls collect-traces``
  writes); the record names its model, whose serving predictor's error on them feeds
  ``dls_predictor_live_error`` (and the model's ``dls_predictor_model_live_error``), and they join that
  model's retraining window. Every ``DLS_PREDICTOR_RETRAIN_INTERVAL_S`` each model's loop trains a new
  online model on its window in a thread (answers go on meanwhile), which replaces that model's serving
  one only where its error on the most recent requests, held out, is lower (``core/retraining.py``);
  replies carry its version from then on. A restart serves the calibrations' predictors again
  (``DLS_PREDICTOR_LIVE_DIR`` keeps a copy of each replacement to inspect or install; with several
  models, in a folder per model).
- Any failure (a malformed payload, a prediction error) is logged, counted and answered with
  ``error`` set; the service never crashes on a message.
- SIGTERM / SIGINT: the subscription is drained (requests already received are answered), then
  the connection closes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from opentelemetry.trace import SpanKind

from services.predictor.core.predictor import InProcessPredictor
from services.predictor.core.predictor import PredictionQuery as CoreQuery
from services.predictor.core.predictor import StepPrediction as CoreStepPrediction
from services.predictor.core.retraining import (
    LiveError,
    RetrainConfig,
    RetrainOutcome,
    not_ready,
    relative_errors,
    retrain,
)
from services.predictor.core.served import LabelledState, UnusableSteps, states_from_steps
from services.predictor.models import (
    LoadedPredictor,
    ServedPredictor,
    UnknownModelError,
    load,
    model_version,
    served_predictors,
    trained_version,
)
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

# where they were before several models (``models.py`` is their home now)
__all__ = ["LoadedPredictor", "PredictorService", "load", "model_version", "serve", "trained_version"]


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
        model=query.model,
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


def reply_version(model_to_version: dict[str, str]) -> str:
    """``PredictReply.model_version``: the one version that answered, or ``name=version`` of each model's."""
    if len(model_to_version) == 1:
        return next(iter(model_to_version.values()))
    return ",".join(f"{name}={version}" for name, version in sorted(model_to_version.items()))


# the queries of one model: (its predictors, the queries' positions in the request, the core queries)
QueryGroup = tuple[ServedPredictor, list[int], list[CoreQuery]]


class PredictorService:
    """Answers ``PredictRequest``s on ``nc`` with the predictors of each served model's calibration
    (``settings.served_model_dirs``, ``shared.calibration``); an uncalibrated model gets ``BoundPredictor``.
    With a ``store`` it reads finished requests back, measures its live error and retrains each model's
    predictor on that model's requests."""

    def __init__(self, settings: PredictorSettings, nc, store: StateStore | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.nc = nc
        self.store = store
        self.clock = clock
        self.subjects = Subjects(settings.subject_prefix)
        # model name -> its predictors, window and live error, the first served first (it answers "")
        self.models = served_predictors(settings)  # a calibration made for other weights: refused, naming it
        self.first = next(iter(self.models.values()))
        self.calibration = self.first.calibration
        self.num_requests = 0  # requests answered with predictions
        self.num_errors = 0  # requests answered with an error (malformed ones included)
        self.num_malformed = 0  # payloads that did not decode as a PredictRequest
        self._subscription = None
        self.metrics = PredictorMetrics()
        self._tracer = tracer("dls.predictor")
        self.live = LiveError(max(settings.live_error_rows, 1))  # every model's rows (each has its own too)
        self.retrain_config = RetrainConfig(settings.retrain_window_rows, settings.retrain_min_rows,
                                            settings.retrain_holdout_share)
        self.retrain_outcomes: list[RetrainOutcome] = []  # every retrain so far, of any model, in order
        self._events_subscription = None
        self._retrain_tasks: dict[str, asyncio.Task] = {}  # model -> its retraining loop
        self._names_said: set[str] = set()  # names a one-model service answered for all the same (logged once)

    def load_models(self) -> None:
        """Load the predictors the mode needs up front, so a broken model directory fails at start."""
        for served in self.models.values():
            self._loaded(served, one_shot=self.settings.mode == "one-shot")

    def served_model(self, name: str) -> ServedPredictor:
        """The predictors of the model a query or a record names ("": the first served). With one model
        served, it answers whatever is named (as before several models; a name that differs is logged
        once); with several, a name not served is an ``UnknownModelError`` naming the served ones."""
        served = self.models.get(name or self.first.name)
        if served is not None:
            return served
        if len(self.models) > 1:
            raise UnknownModelError(name, list(self.models))
        if name not in self._names_said:
            self._names_said.add(name)
            logger.warning("model %r named, %s served: answered by %s (it alone is served)", name, self.first.name,
                           self.first.name)
        return self.first

    def _predictor(self, one_shot: bool, model: str = "") -> LoadedPredictor:
        return self._loaded(self.served_model(model), one_shot)

    def _loaded(self, served: ServedPredictor, one_shot: bool) -> LoadedPredictor:
        if one_shot not in served.loaded:
            self.metrics.by_model.serving(served.name, one_shot, served.predictor(one_shot).version)
        return served.predictor(one_shot)

    async def start(self) -> None:
        self._subscription = await self.nc.subscribe(
            self.subjects.predict, queue=self.settings.queue_group, cb=self._on_request
        )
        logger.info("predictor answering on %s (queue group %s, mode %s) for %s", self.subjects.predict,
                    self.settings.queue_group, self.settings.mode, ", ".join(self.models))
        if self.store is None or not self.settings.reads_served_requests:
            return
        # every replica reads every finished request (no queue group): each keeps its own window and model
        self._events_subscription = await self.nc.subscribe(self.subjects.events_all, cb=self._on_event)
        if self.settings.retrain and self.settings.mode == "online":
            self._retrain_tasks = {name: asyncio.create_task(self._retrain_loop(name)) for name in self.models}
            logger.info("retraining on served requests every %g s, each model on its own (from %d rows; window "
                        "%d rows, %g%% held out)", self.settings.retrain_interval_s, self.settings.retrain_min_rows,
                        self.settings.retrain_window_rows, 100 * self.settings.retrain_holdout_share)
        elif self.settings.retrain:
            logger.info("no retraining in one-shot mode (it retrains the online model); the live error is measured")

    async def drain(self) -> None:
        """Stop taking requests; those already received are answered first."""
        for task in self._retrain_tasks.values():
            task.cancel()
        self._retrain_tasks = {}
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
            groups = self._by_model(request.queries)
        except UnknownModelError as exc:
            self.num_errors += 1
            logger.error("predict request of %d queries refused: %s", len(request.queries), exc)
            return PredictReply(error=str(exc))
        try:
            # NOTE: in a thread (the booster call releases the GIL), so the loop keeps its heartbeats to
            # NATS; a subscription's callbacks run one at a time, so one prediction runs at a time.
            predictions, versions = await asyncio.to_thread(self._predict, one_shot, groups, request.thresholds)
        except Exception as exc:  # noqa: BLE001 (answer every request; the scheduler keeps its last prediction)
            self.num_errors += 1
            logger.exception("prediction failed for %d queries", len(request.queries))
            return PredictReply(error=f"{type(exc).__name__}: {exc}")
        self.num_requests += 1
        self.metrics.queries.inc(len(request.queries))
        self.metrics.batch_size.observe(len(request.queries))
        for served, positions, _ in groups:
            self.metrics.by_model.queries.labels(model=served.name).inc(len(positions))
        return PredictReply(predictions=[to_wire_prediction(p) for p in predictions],
                            model_version=reply_version(versions), model_versions=versions)

    def _by_model(self, queries: Sequence[PredictionQuery]) -> list[QueryGroup]:
        """The queries grouped by the model answering them, in order of first appearance (none: the first
        model's empty group, so that a request of no query is answered as before)."""
        groups: dict[str, QueryGroup] = {}
        for i, query in enumerate(queries):
            served = self.served_model(query.model)
            group = groups.setdefault(served.name, (served, [], []))
            group[1].append(i)
            group[2].append(to_core_query(query))
        return list(groups.values()) or [(self.first, [], [])]

    def _predict(self, one_shot: bool, groups: list[QueryGroup],
                 thresholds: list[float]) -> tuple[list[CoreStepPrediction], dict[str, str]]:
        """Each model's queries by its own predictor, back in query order; and model -> the version that answered."""
        predictions: list[CoreStepPrediction | None] = [None] * sum(len(positions) for _, positions, _ in groups)
        versions = {}
        for served, positions, queries in groups:
            loaded = self._loaded(served, one_shot)
            for i, prediction in zip(positions, loaded.predictor.predict(queries, thresholds), strict=True):
                predictions[i] = prediction
            versions[served.name] = loaded.version
        return predictions, versions

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
        """Read a finished request back from the state store, score its model's serving predictor on its
        states (the live error) and keep them to retrain that model's predictor on; its states ([] where it
        gives none, or where its model is not served here)."""
        try:
            record = await self.store.load(request_id)
            if record is None:
                raise UnusableSteps(f"request {request_id} is not stored (expired?)")
            served = self.served_model(record.model)
            states = states_from_steps(record, await self.store.load_steps(request_id))
        except UnknownModelError as exc:
            self.metrics.served_requests.labels(outcome="not_served").inc()
            logger.debug("not learning from %s: %s", request_id, exc)
            return []
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
        serving = self._loaded(served, one_shot=self.settings.mode == "one-shot")
        row_errors = await asyncio.to_thread(relative_errors, serving.predictor, states)
        for error in row_errors:
            self.metrics.served_error.observe(float(error))
        for live in (self.live, served.live):
            live.observe(row_errors)
        self.metrics.live_error.set(self.live.mre)
        self.metrics.by_model.live_error.labels(model=served.name).set(served.live.mre)
        if self.settings.retrain:
            served.window.add(states)
            self.metrics.window_rows.set(sum(m.window.num_rows for m in self.models.values()))
            self.metrics.by_model.window_rows.labels(model=served.name).set(served.window.num_rows)
        self.metrics.served_requests.labels(outcome="used").inc()
        return states

    async def _retrain_loop(self, model: str) -> None:
        while True:
            await asyncio.sleep(self.settings.retrain_interval_s)
            try:
                await self.retrain_once(model)
            except Exception:  # noqa: BLE001 (a failed retrain leaves the serving model; the next one may work)
                self.metrics.retrains.labels(outcome="failed").inc()
                self.metrics.by_model.retrains.labels(model=model, outcome="failed").inc()
                logger.exception("retraining %s failed; its serving predictor stays", model)

    async def retrain_once(self, model: str = "") -> RetrainOutcome | None:
        """Train a new online model of ``model`` ("": the first served) on its window (in a thread) and swap
        it in where it is better; None when no retrain is due (too few rows, nothing new)."""
        served = self.served_model(model)
        reason = not_ready(served.window, self.retrain_config, served.num_added_at_retrain)
        if reason is not None:
            logger.info("no retrain of %s: %s", served.name, reason)
            return None
        snapshot, served.num_added_at_retrain = served.window.snapshot(), served.window.num_added
        serving = self._loaded(served, one_shot=False)
        started = time.perf_counter()
        outcome = await asyncio.to_thread(retrain, snapshot, serving.predictor, self.retrain_config,
                                          {"made_at": self.clock(), "replaces": serving.version,
                                           "served_model": served.name})
        seconds = time.perf_counter() - started
        version = serving.version
        if outcome.swapped:
            version = trained_version(outcome.model)
            served.loaded[False] = LoadedPredictor(InProcessPredictor(outcome.model), version)
            self.metrics.by_model.serving(served.name, False, version)
            if self.settings.live_dir:
                live_dir = Path(self.settings.live_dir)
                await asyncio.to_thread(outcome.model.save, live_dir if len(self.models) == 1 else live_dir / served.name)
        served.retrain_outcomes.append(outcome)
        self.retrain_outcomes.append(outcome)
        self._record_retrain(served.name, outcome, seconds)
        logger.info("retrained %s on %d requests (%d rows to train, %d held out) in %.1f s: held-out error %.3f "
                    "(serving %s) vs %.3f (new): %s", served.name, outcome.num_requests, outcome.num_train_rows,
                    outcome.num_holdout_rows, seconds, outcome.old_error, serving.version, outcome.new_error,
                    f"swapped, now {version}" if outcome.swapped else "kept the serving model")
        return outcome

    def _record_retrain(self, model: str, outcome: RetrainOutcome, seconds: float) -> None:
        kind = "swapped" if outcome.swapped else "kept"
        self.metrics.retrains.labels(outcome=kind).inc()
        self.metrics.by_model.retrains.labels(model=model, outcome=kind).inc()
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
