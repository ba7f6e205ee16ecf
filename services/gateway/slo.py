"""Default SLOs: a multiple of the latency a request would have alone on a TP-1 instance.

The isolated latency is the one-shot step predictor's estimate at the highest candidate threshold
(the slowest, best-quality plan), split into recompute and cache steps, each timed by the latency
profile at batch 1 on TP 1. The default SLO is ``factor`` times that, and at least ``floor_ms``: on a
small model the isolated latency is tens of milliseconds, below what the NATS and Redis round trips
of a busy host add. Pure: a predictor and a profile in, a number out.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from shared.messages.base import CacheMode
from shared.profiles import LatencyProfile, ProfileError

logger = logging.getLogger(__name__)

REFERENCE_THRESHOLD = 0.9  # the highest candidate threshold: the slowest plan the scheduler would pick
REFERENCE_TP = 1  # the smallest instance
REFERENCE_BATCH = 1  # alone on it


class SloEstimator:
    """Predicted isolated latency and the default SLO derived from it."""

    def __init__(self, predictor, profile: LatencyProfile, factor: float, floor_ms: float) -> None:
        """``predictor``: a ``services.predictor`` one-shot ``Predictor`` (``predict(queries, thresholds)``)."""
        self.predictor = predictor
        self.profile = profile
        self.factor = factor
        self.floor_ms = floor_ms
        profile.alpha(REFERENCE_TP, REFERENCE_BATCH)  # ProfileError now if the profile has no TP 1

    def steps(self, prompt_length: int, gen_length: int, block_length: int,
              cache_mode: CacheMode) -> tuple[float, float]:
        """Predicted (recompute, cache) steps of the whole request at the reference threshold.

        The answer needs one block at least (a recompute step with a cache), and at most every block
        of the canvas (it stops at the block that completes its EOS), so the prediction is kept within
        those bounds (the trees do not extrapolate past trained lengths).
        """
        from services.predictor.adapters import PredictionQuery

        uses_cache = cache_mode is not CacheMode.NONE
        query = PredictionQuery.from_counts("default-slo", 0, gen_length, prompt_length, block_length, 0, None,
                                            uses_cache=uses_cache)
        [prediction] = self.predictor.predict([query], [REFERENCE_THRESHOLD])
        recompute, cache = prediction.threshold_to_steps[REFERENCE_THRESHOLD]
        num_blocks = math.ceil(gen_length / block_length)
        if not uses_cache:
            return max(recompute + cache, 1.0), 0.0
        recompute = min(max(recompute, 1.0), num_blocks)
        return recompute, max(cache, 0.0)

    def isolated_latency_s(self, prompt_length: int, gen_length: int, block_length: int,
                           cache_mode: CacheMode) -> float:
        recompute, cache = self.steps(prompt_length, gen_length, block_length, cache_mode)
        if cache_mode is CacheMode.NONE:
            return recompute * self.profile.full(REFERENCE_TP, REFERENCE_BATCH)
        return (recompute * self.profile.alpha(REFERENCE_TP, REFERENCE_BATCH)
                + cache * self.profile.beta(REFERENCE_TP, REFERENCE_BATCH))

    def default_slo_ms(self, prompt_length: int, gen_length: int, block_length: int,
                       cache_mode: CacheMode) -> float:
        latency_ms = 1000.0 * self.isolated_latency_s(prompt_length, gen_length, block_length, cache_mode)
        return max(self.floor_ms, self.factor * latency_ms)


def load_slo_estimator(model_dir: str | Path, profile_path: str | Path, factor: float,
                       floor_ms: float, profile_scale: float = 1.0) -> SloEstimator | None:
    """The estimator for the served model, or None (logged once) if its predictor or profile is unusable."""
    try:
        from services.predictor.adapters import load_predictor  # LightGBM: imported only when used

        predictor = load_predictor(model_dir, one_shot=True)
        return SloEstimator(predictor, LatencyProfile.load(profile_path).scaled(profile_scale), factor, floor_ms)
    except (ProfileError, ImportError, OSError, ValueError) as exc:
        logger.warning("default SLOs fall back to DLS_GATEWAY_DEFAULT_SLO_MS: cannot load the one-shot predictor "
                       "of %s or the profile %s (%s)", model_dir, profile_path, exc)
        return None
