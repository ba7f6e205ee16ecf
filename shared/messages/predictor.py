"""Scheduler <-> predictor request/reply (subject ``predict``): remaining steps per threshold.

Mirrors ``services.predictor.core.predictor``: ``PredictionQuery``, ``RemainingSteps`` and
``StepPrediction`` have the same fields, so the predictor service converts field by field. One request carries
every query of a scheduling round; the predictor answers all (request, threshold) rows in one batch.
"""

from __future__ import annotations

from shared.messages.base import Message, Part

# (min, q25, median, mean, q75) of the current block's still-masked confidences
Confidence = tuple[float, float, float, float, float]


class PredictionQuery(Part, kw_only=True):
    """A request's state between steps: everything the features need except the threshold."""

    request_id: str  # the request
    num_steps_done: int  # steps run so far
    gen_length: int  # canvas length
    prompt_length: int  # prompt tokens
    block_length: int  # block length
    num_committed: int = 0  # committed canvas positions
    block_committed: int = 0  # committed positions of the block the last step decoded
    block_size: int | None = None  # that block's size (the last block may be short)
    block_index: int = 0  # the block the last step decoded
    confidence: Confidence | None = None  # confidence stats after the last step; None before any step
    uses_cache: bool = True  # False: every step is a full forward (cache mode none)
    threshold: float | None = None  # the threshold it runs at now
    predicted_end: int | None = None  # canvas position where the engine expects the EOS; None: not known
    model: str = ""  # the request's model (its name, as requests name it); "": the predictor's first served model


class PredictRequest(Message, kw_only=True):
    """Predict remaining steps for many requests at every candidate threshold."""

    queries: list[PredictionQuery]  # one per request
    thresholds: list[float]  # candidate thresholds
    one_shot: bool = False  # True: the arrival-time estimate (ablation), ignoring progress


class RemainingSteps(Part, kw_only=True):
    """Predicted steps left, split by cost."""

    recompute_steps: float  # full forwards
    cache_steps: float  # cheap steps against the cache

    @property
    def total(self) -> float:
        return self.recompute_steps + self.cache_steps


class StepPrediction(Part, kw_only=True):
    """Remaining steps per candidate threshold, counted from step ``made_at_step``."""

    request_id: str  # the request
    made_at_step: int  # the request's num_steps_done when its features were taken
    threshold_to_steps: dict[float, RemainingSteps]  # threshold -> remaining steps


class PredictReply(Message, kw_only=True):
    """The predictor's answer, in the order of the queries."""

    predictions: list[StepPrediction] = []  # one per query
    error: str | None = None  # set (and predictions empty) when the predictor could not answer
    model_version: str = ""  # which predictor model answered, for the timeline (several: "name=version,...")
    model_versions: dict[str, str] = {}  # served model -> the version of its predictor that answered its queries
