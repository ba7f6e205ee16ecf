"""The step times a worker of an uncalibrated model measures itself: its online profile.

A model served without a calibration (``shared.calibration``) has no profile file for the scheduler
to plan with, and another model's would plan it blind. Its worker measures one instead: at start,
one recompute, cache and full step per batch size (1, 2, 4, ... up to its ``max_batch``, at the
model's default canvas plus a short prompt, as ``dls profile`` measures), then every step it serves
whose requests are all of one kind moves that batch size's time towards what it took (an
exponentially weighted mean; a recompute step's time is brought to the anchor context first, as
``LatencyProfile.batch_step_s`` scales it). Its heartbeats carry the result
(``shared.messages.control.MeasuredSteps``) and the scheduler plans the instance with it
(``shared.profiles.online_profile``).
"""

from __future__ import annotations

import logging
import time

from shared.messages.control import MeasuredSteps

logger = logging.getLogger("dls.worker")

WEIGHT = 0.2  # of a served step in its batch size's mean
KINDS = ("recompute_ms", "cache_ms", "full_ms")
PROMPT_TOKENS = 64  # the warm-up requests' prompt, before the model's default canvas


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... below ``max_batch``, and ``max_batch`` itself."""
    sizes, batch = [], 1
    while batch < max_batch:
        sizes.append(batch)
        batch *= 2
    return [*sizes, max_batch]


class OnlineProfile:
    """Step times per kind and batch size, measured at start and kept current while serving."""

    def __init__(self, context_tokens: int, block_length: int) -> None:
        self.context_tokens = context_tokens
        self.block_length = block_length
        self.ms: dict[str, dict[int, float]] = {kind: {} for kind in KINDS}
        self.served_steps = 0  # steps folded in since the start

    @classmethod
    def measured(cls, engine, max_batch: int, repeats: int = 1) -> OnlineProfile:
        """One measurement per batch size with the engine itself (``services.worker.profiling.measure``)."""
        from services.worker.profiling import measure

        started = time.perf_counter()
        context = engine.default_gen_length + PROMPT_TOKENS
        online = cls(context, engine.default_block_length)
        for batch in batch_sizes(max_batch):
            for kind, ms in measure(engine, batch, context, repeats).items():
                online.ms[kind][batch] = ms
        logger.info("measured the step times at batch %s in %.1f s (no calibration: the scheduler plans with "
                    "them, kept current as steps are served): recompute %s ms, cache %s ms",
                    batch_sizes(max_batch), time.perf_counter() - started, online.ms["recompute_ms"],
                    online.ms["cache_ms"])
        return online

    def observe(self, seconds: float, recompute_contexts: list[int], num_cache: int, no_cache: bool) -> None:
        """A served step's compute time: folded in when its requests were all of one kind."""
        if recompute_contexts and num_cache:
            return  # a mixed step: its parts' times cannot be told apart
        if recompute_contexts:
            kind = "full_ms" if no_cache else "recompute_ms"
            batch = len(recompute_contexts)
            seconds *= self.context_tokens / (sum(recompute_contexts) / batch)
        elif num_cache:
            kind, batch = "cache_ms", num_cache
        else:
            return
        ms = seconds * 1000.0
        old = self.ms[kind].get(batch)
        self.ms[kind][batch] = ms if old is None else (1 - WEIGHT) * old + WEIGHT * ms
        self.served_steps += 1

    def wire(self) -> MeasuredSteps:
        def rounded(kind: str) -> dict[int, float]:
            return {batch: round(ms, 3) for batch, ms in sorted(self.ms[kind].items())}

        return MeasuredSteps(context_tokens=self.context_tokens, block_length=self.block_length,
                             recompute_ms=rounded("recompute_ms"), cache_ms=rounded("cache_ms"),
                             full_ms=rounded("full_ms"), served_steps=self.served_steps)

