"""A trained step model: LightGBM boosters for remaining steps, their feature set and JSON card.

Two boosters read the same feature columns: ``total`` (remaining steps) and ``recompute`` (remaining
recompute steps as an engine with a KV cache reports them: one per block still to start, fewer when
the answer's EOS ends the request early). Cache steps are the difference. Without a cache every step
is a full forward, so callers count the total as recompute steps (see ``InProcessPredictor``).

On disk (``save``/``load``): ``model.txt`` and ``recompute.txt`` in LightGBM's text format, and
``card.json`` (features, target transform, training size, error table).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import lightgbm as lgb
import numpy as np

from shared.features import FEATURE_SETS, NUM_FEATURES

TOTAL_FILE = "model.txt"
RECOMPUTE_FILE = "recompute.txt"
CARD_FILE = "card.json"
CARD_FORMAT = 1


class ModelError(ValueError):
    """A model directory that cannot be loaded (missing or corrupt file, inconsistent card)."""


class TargetTransform:
    """Name -> (forward, inverse) applied to step counts around the booster."""

    NONE = "none"
    LOG1P = "log1p"

    @staticmethod
    def forward(name: str, values: np.ndarray) -> np.ndarray:
        return np.log1p(values) if name == TargetTransform.LOG1P else values

    @staticmethod
    def inverse(name: str, values: np.ndarray) -> np.ndarray:
        return np.expm1(values) if name == TargetTransform.LOG1P else values


@dataclass
class StepModel:
    """Remaining-step regressors over one feature set (a prefix of ``shared.features.FEATURE_NAMES``)."""

    feature_set: str
    total: lgb.Booster
    recompute: lgb.Booster
    target_transform: str = TargetTransform.NONE
    card: dict = field(default_factory=dict)

    @property
    def feature_names(self) -> tuple[str, ...]:
        return FEATURE_SETS[self.feature_set]

    def predict(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(total, recompute) remaining steps for full 11-feature rows, shape (n, 11).

        Rows describe unfinished requests, so the total is at least 1 step; the recompute count is
        clipped into [0, total].
        """
        rows = np.asarray(rows, dtype=np.float64)
        if rows.ndim != 2 or rows.shape[1] != NUM_FEATURES:
            raise ValueError(f"expected rows of {NUM_FEATURES} features, got shape {rows.shape}")
        columns = rows[:, : len(self.feature_names)]
        total = np.maximum(self._predict(self.total, columns), 1.0)
        recompute = np.clip(self._predict(self.recompute, columns), 0.0, total)
        return total, recompute

    def _predict(self, booster: lgb.Booster, columns: np.ndarray) -> np.ndarray:
        raw = booster.predict(columns, num_threads=1)
        return TargetTransform.inverse(self.target_transform, raw)

    # --- files ----------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.total.save_model(str(directory / TOTAL_FILE))
        self.recompute.save_model(str(directory / RECOMPUTE_FILE))
        card = {
            **self.card,
            "format": CARD_FORMAT,
            "feature_set": self.feature_set,
            "features": list(self.feature_names),
            "target_transform": self.target_transform,
            "files": {"total": TOTAL_FILE, "recompute": RECOMPUTE_FILE},
        }
        (directory / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> StepModel:
        directory = Path(directory)
        card = _read_card(directory / CARD_FILE)
        feature_set = card.get("feature_set")
        if feature_set not in FEATURE_SETS:
            raise ModelError(f"{directory / CARD_FILE}: unknown feature_set {feature_set!r}")
        if list(card.get("features", [])) != list(FEATURE_SETS[feature_set]):
            raise ModelError(f"{directory / CARD_FILE}: features do not match feature set {feature_set!r} "
                             "(trained with another feature list: retrain with `dls train-predictor`)")
        total = _read_booster(directory / TOTAL_FILE, len(FEATURE_SETS[feature_set]))
        recompute = _read_booster(directory / RECOMPUTE_FILE, len(FEATURE_SETS[feature_set]))
        return cls(feature_set, total, recompute, card.get("target_transform", TargetTransform.NONE), card)


def _read_card(path: Path) -> dict:
    try:
        card = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{path}: no model card (train one with `dls train-predictor`)") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(card, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return card


def _read_booster(path: Path, num_features: int) -> lgb.Booster:
    if not path.is_file():
        raise ModelError(f"{path}: missing LightGBM model file")
    try:
        booster = lgb.Booster(model_file=str(path))
    except lgb.basic.LightGBMError as exc:
        raise ModelError(f"{path}: not a LightGBM text model ({str(exc).strip()})") from None
    if booster.num_feature() != num_features:
        raise ModelError(f"{path}: model reads {booster.num_feature()} features, the card says {num_features}")
    return booster
