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
- Any failure (a malformed payload, a prediction error) is logged, counted and answered with
  ``error`` set; the service never crashes on a message.
- SIGTERM / SIGINT: the subscription is drained (requests already received are answered), then
  the connection closes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.trace import SpanKind

from services.predictor.core.loading import ONE_SHOT_DIR
from services.predictor.core.model import RECOMPUTE_FILE, TOTAL_FILE, StepModel
from services.predictor.core.predictor import BoundPredictor, InProcessPredictor, OneShotPredictor, Predictor
from services.predictor.core.predictor import PredictionQuery as CoreQuery
from services.predictor.core.predictor import StepPrediction as CoreStepPrediction
from shared.calibration import of_service, uncalibrated_message
from shared.messages import codec
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
    (``settings.model_dir``, ``shared.calibration``); an uncalibrated model gets ``BoundPredictor``."""

    def __init__(self, settings: PredictorSettings, nc) -> None:
        self.settings = settings
        self.nc = nc
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

    async def drain(self) -> None:
        """Stop taking requests; those already received are answered first."""
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


async def serve(settings: PredictorSettings) -> None:
    """Run until SIGTERM or SIGINT."""

    setup_tracing("dls-predictor", settings)
    service = PredictorService(settings, nc=None)
    await asyncio.to_thread(service.load_models)
    serve_metrics(service.metrics.registry, settings.metrics_port, settings.metrics_host)
    service.nc = await connect_nats(settings, "dls-predictor")
    stop = on_stop_signals()
    await service.start()
    try:
        await stop.wait()
    finally:
        logger.info("predictor stopping: %d answered, %d errors (%d malformed)", service.num_requests,
                    service.num_errors, service.num_malformed)
        await service.drain()
        await service.nc.drain()
        shutdown_tracing()
