"""Where remaining-step predictions come from, behind one interface.

``fallback``: none; the scheduler core then estimates remaining steps from remaining tokens and its
``fallback_tokens_per_step`` table, which the simulator calibrates from the replay trace (the same
numbers the engine produced). ``predictor``: the step predictor of ``services/predictor`` (issue 4),
loaded from the engine model's directory, through its in-process client. The one-shot ablation is
the scheduler's ``dilaserve-oneshot`` policy: it keeps the first prediction and scales it, and that
prediction comes from the predictor's one-shot model (arrival features only), as the paper's ablation
has it, not from the online model's arrival row.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from services.scheduler.core import Prediction
from services.scheduler.core.threshold import DEFAULT_THRESHOLDS
from shared.messages.predictor import PredictionQuery
from sim.registry import Registry


class PredictionSource(Protocol):
    latency_s: float  # virtual time from a step's end to its predictions' arrival (0: with the result)

    def predict(self, queries: list[PredictionQuery]) -> list[Prediction | None]:
        """Fresh predictions for requests right after a step (the queries the scheduling core builds,
        ``StepScheduler.queries``, as it does for the live predictor service)."""
        ...


class FallbackOnly:
    """No predictions: the scheduler core's fallback estimate."""

    latency_s = 0.0

    def predict(self, queries: list[PredictionQuery]) -> list[Prediction | None]:
        return [None] * len(queries)


class StepPredictorSource:
    """The step predictor (``services.predictor.core.loading.load_predictor``), in process, one
    batched call per finished step. ``one_shot``: its arrival-only ablation model.

    The replay engine records no confidences, so with it the queries carry progress only.
    """

    def __init__(self, model_dir: str, thresholds: tuple[float, ...], one_shot: bool = False, latency_s: float = 0.0):
        from services.predictor.core.loading import load_predictor

        self._predictor = load_predictor(model_dir, one_shot=one_shot)
        self.thresholds = tuple(thresholds)
        self.latency_s = latency_s

    def predict(self, queries: list[PredictionQuery]) -> list[Prediction | None]:
        from services.predictor.core.loading import PredictionQuery as CoreQuery

        if not queries:
            return []
        # the wire query and the predictor core's have the same fields (tests/unit/contracts)
        core_queries = [CoreQuery(**msgspec.structs.asdict(q)) for q in queries]
        predictions = self._predictor.predict(core_queries, self.thresholds)
        return [
            Prediction({t: (float(rc), float(ca)) for t, (rc, ca) in p.threshold_to_steps.items()}, p.made_at_step)
            for p in predictions
        ]


def _step_predictor(model_dir: str = "models/dls-tiny", thresholds=DEFAULT_THRESHOLDS, one_shot: bool = False,
                    **_) -> PredictionSource:
    try:
        return StepPredictorSource(model_dir, tuple(thresholds), one_shot=one_shot)
    except ImportError as exc:
        raise KeyError(f"prediction source 'predictor' is not available ({exc})") from None


def _auto(model_dir: str = "models/dls-tiny", thresholds=DEFAULT_THRESHOLDS, one_shot: bool = False,
          **_) -> PredictionSource:
    """The step predictor when one is trained next to the model, else the fallback."""
    try:
        return StepPredictorSource(model_dir, tuple(thresholds), one_shot=one_shot)
    except Exception:  # noqa: BLE001 (missing package, missing or unreadable model: fall back)
        return FallbackOnly()


# name -> factory(model_dir=..., thresholds=..., one_shot=...): ``one_shot`` asks for the predictor's
# arrival-only ablation model, which a policy planning on its first prediction alone reads
# (``PredictionMode.ONESHOT``: the live predictor service started with its one-shot model serves it)
PREDICTION_SOURCES: Registry = Registry("prediction source")
PREDICTION_SOURCES.register("fallback", lambda **kw: FallbackOnly())
PREDICTION_SOURCES.register("predictor", _step_predictor)
PREDICTION_SOURCES.register("auto", _auto)
