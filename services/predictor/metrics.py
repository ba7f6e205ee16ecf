"""The predictor's per-model series, beside ``shared.metrics.PredictorMetrics`` on the same registry.

``PredictorMetrics``' own series stay what they were (every model's together: a one-model service reads
as before); these split them by the served model (label ``model``: the name queries and records use).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Info


class ModelMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.version = Info("dls_predictor_model", "the version of each served model's predictor answering now, by "
                            "kind (online, one_shot)", ["model", "kind"], registry=r)
        self.queries = Counter("dls_predictor_model_queries", "queries answered, by the model they named", ["model"],
                               registry=r)
        self.live_error = Gauge("dls_predictor_model_live_error", "dls_predictor_live_error of one served model: "
                                "the mean relative error of its serving predictor over its most recent rows",
                                ["model"], registry=r)
        self.window_rows = Gauge("dls_predictor_model_retrain_window_rows", "rows of one model's finished requests "
                                 "kept to retrain its predictor on", ["model"], registry=r)
        self.retrains = Counter("dls_predictor_model_retrains", "retrains of one model's predictor, by outcome "
                                "(swapped, kept, failed)", ["model", "outcome"], registry=r)

    def serving(self, model: str, one_shot: bool, version: str) -> None:
        """The version now answering ``model``'s queries of one kind."""
        self.version.labels(model=model, kind="one_shot" if one_shot else "online").info({"version": version})
