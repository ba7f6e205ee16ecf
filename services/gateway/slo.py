"""Default SLOs: a multiple of the latency a request would have alone on a TP-1 instance.

The isolated latency is the one-shot step estimate at the highest candidate threshold (the slowest,
best-quality plan), split into recompute and cache steps, each timed by the latency profile at
batch 1 on TP 1. The default SLO is ``factor`` times that, and at least ``floor_ms``: on a small
model the isolated latency is tens of milliseconds, below what the NATS and Redis round trips of a
busy host add.

The estimate comes from the predictor service (``PredictRequest`` with ``one_shot``, over NATS): the
gateway asks the same model the scheduler's predictions come from, loaded once, from one setting
(``DLS_PREDICTOR_MODEL_DIR``, or each of ``DLS_PREDICTOR_MODEL_DIRS``: the query names the model it is for),
and the gateway itself holds no model and none of the predictor's code.
A request shape (prompt length, canvas, block, cache) is asked once and remembered for
``CACHE_TTL_S``; while the predictor does not answer, requests get ``DLS_GATEWAY_DEFAULT_SLO_MS``
and the gateway asks again after ``RETRY_S``.

``SloEstimator`` is pure (a prediction and a profile in, a number out); ``DefaultSlo`` adds the
asking, the cache and the fallback, with the clock and the request/reply call injected.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

from shared.messages.base import CacheMode
from shared.messages.predictor import PredictionQuery, PredictReply, PredictRequest
from shared.profiles import LatencyProfile

logger = logging.getLogger(__name__)

REFERENCE_THRESHOLD = 0.9  # the highest candidate threshold: the slowest plan the scheduler would pick
REFERENCE_TP = 1  # the smallest instance
REFERENCE_BATCH = 1  # alone on it
CACHE_TTL_S = 300.0  # a shape's estimate is asked again after this long (the predictor may have changed)
RETRY_S = 5.0  # after the predictor did not answer, the fixed default for this long


class SloEstimator:
    """The default SLO of a request from its predicted one-shot steps."""

    def __init__(self, profile: LatencyProfile, factor: float, floor_ms: float) -> None:
        self.profile = profile
        self.factor = factor
        self.floor_ms = floor_ms
        profile.alpha(REFERENCE_TP, REFERENCE_BATCH)  # ProfileError now if the profile has no TP 1

    @staticmethod
    def steps(predicted: tuple[float, float], gen_length: int, block_length: int,
              cache_mode: CacheMode) -> tuple[float, float]:
        """(recompute, cache) steps of the whole request from the predicted ones.

        The answer needs one block at least (a recompute step with a cache), and at most every block
        of the canvas (it stops at the block that completes its EOS), so the prediction is kept within
        those bounds (the trees do not extrapolate past trained lengths).
        """
        recompute, cache = predicted
        if cache_mode is CacheMode.NONE:
            return max(recompute + cache, 1.0), 0.0
        num_blocks = math.ceil(gen_length / block_length)
        return min(max(recompute, 1.0), num_blocks), max(cache, 0.0)

    def isolated_latency_s(self, steps: tuple[float, float], cache_mode: CacheMode) -> float:
        recompute, cache = steps
        if cache_mode is CacheMode.NONE:
            return recompute * self.profile.full(REFERENCE_TP, REFERENCE_BATCH)
        return (recompute * self.profile.alpha(REFERENCE_TP, REFERENCE_BATCH)
                + cache * self.profile.beta(REFERENCE_TP, REFERENCE_BATCH))

    def default_slo_ms(self, predicted: tuple[float, float], gen_length: int, block_length: int,
                       cache_mode: CacheMode) -> float:
        steps = self.steps(predicted, gen_length, block_length, cache_mode)
        return max(self.floor_ms, self.factor * 1000.0 * self.isolated_latency_s(steps, cache_mode))


def one_shot_request(prompt_length: int, gen_length: int, block_length: int, cache_mode: CacheMode,
                     model: str = "") -> PredictRequest:
    """What the gateway asks the predictor service: a request of ``model`` ("": the predictor's first served
    model) that has run no step, at the reference threshold."""
    query = PredictionQuery(request_id="default-slo", num_steps_done=0, gen_length=gen_length,
                            prompt_length=prompt_length, block_length=block_length,
                            uses_cache=cache_mode is not CacheMode.NONE, model=model)
    return PredictRequest(queries=[query], thresholds=[REFERENCE_THRESHOLD], one_shot=True)


Shape = tuple[int, int, int, CacheMode]  # prompt length, canvas, block length, cache mode


class DefaultSlo:
    """Default SLOs from the predictor service's one-shot estimates: asked per shape, remembered."""

    def __init__(self, estimator: SloEstimator | None, ask: Callable[[PredictRequest], Awaitable[PredictReply]],
                 fallback_ms: float, clock: Callable[[], float], model: str = "") -> None:
        """``estimator``: None when the profile is unusable (every request gets ``fallback_ms``);
        ``ask``: the request/reply call to the predictor service (raises when it does not answer);
        ``model``: the served model these SLOs are for (its own predictor answers; "": the predictor's first)."""
        self.estimator = estimator
        self.model = model
        self.ask = ask
        self.fallback_ms = fallback_ms
        self.clock = clock
        self._shape_to_slo: dict[Shape, tuple[float, float]] = {}  # shape -> (SLO ms, when it was asked)
        self._down_until = 0.0  # no asking before this (the last ask got no answer)

    async def slo_ms(self, prompt_length: int, gen_length: int, block_length: int, cache_mode: CacheMode) -> float:
        if self.estimator is None:
            return self.fallback_ms
        shape = (prompt_length, gen_length, block_length, cache_mode)
        now = self.clock()
        cached = self._shape_to_slo.get(shape)
        if cached is not None and now - cached[1] < CACHE_TTL_S:
            return cached[0]
        if now < self._down_until:
            return self.fallback_ms
        predicted = await self._predict(shape)
        if predicted is None:
            self._down_until = now + RETRY_S
            return self.fallback_ms
        slo = self.estimator.default_slo_ms(predicted, gen_length, block_length, cache_mode)
        if len(self._shape_to_slo) >= 4096:  # bounded: shapes seen long ago go first
            self._shape_to_slo.pop(next(iter(self._shape_to_slo)))
        self._shape_to_slo[shape] = (slo, now)
        return slo

    async def _predict(self, shape: Shape) -> tuple[float, float] | None:
        try:
            reply = await self.ask(one_shot_request(*shape, model=self.model))
        except Exception as exc:  # noqa: BLE001 (no predictor, a timeout: the fixed default for a while)
            logger.warning("default SLOs are %.0f ms for %.0f s: the predictor did not answer (%s)",
                           self.fallback_ms, RETRY_S, exc)
            return None
        if reply.error or len(reply.predictions) != 1:
            logger.warning("default SLOs are %.0f ms for %.0f s: the predictor answered %s", self.fallback_ms,
                           RETRY_S, reply.error or f"{len(reply.predictions)} predictions")
            return None
        steps = reply.predictions[0].threshold_to_steps.get(REFERENCE_THRESHOLD)
        return None if steps is None else (steps.recompute_steps, steps.cache_steps)
