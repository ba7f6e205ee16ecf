"""The quality curve per canvas: each canvas with enough problems gets ``accuracy@<canvas>``, which the
scheduler's per-canvas floors read (``services.scheduler.core.threshold.canvas_floors``)."""

from __future__ import annotations

from calibrate.prompts import EncodedPrompt
from calibrate.quality import AGREEMENT, LABELLED, MIN_PER_CANVAS, _curve
from services.scheduler.core.threshold import canvas_floors


def _items(canvas: int, n: int) -> list[EncodedPrompt]:
    return [EncodedPrompt(i, "eval", (5, 6), canvas, canvas, "x") for i in range(n)]


def test_each_canvas_with_enough_problems_gets_a_curve_of_its_own():
    n = MIN_PER_CANVAS
    items = _items(16, n) + _items(128, n) + _items(64, n - 1)  # 64: too few for a curve
    tight = [i < n // 2 for i in range(n)]  # half right at 0.7 on the 16-token canvas
    by_tau = {0.7: {"correct": tight + [True] * n + [True] * (n - 1), "texts": [""] * len(items),
                    "steps": [3] * len(items)},
              0.9: {"correct": [True] * len(items), "texts": [""] * len(items), "steps": [6] * len(items)}}
    curve = _curve(LABELLED, by_tau, items)
    assert curve["by_canvas"] == {16: {"0.7": 0.5, "0.9": 1.0}, 128: {"0.7": 1.0, "0.9": 1.0}}
    document = {"accuracy": curve["accuracy"], **{f"accuracy@{c}": v for c, v in curve["by_canvas"].items()}}
    assert canvas_floors((0.7, 0.9), document, 1.0) == {16: 0.9, 128: 0.7}  # the tight canvas keeps 0.9


def test_agreement_is_counted_per_canvas_too():
    items = _items(16, MIN_PER_CANVAS)
    texts_top = ["a"] * MIN_PER_CANVAS
    texts_low = ["b"] + ["a"] * (MIN_PER_CANVAS - 1)
    by_tau = {0.7: {"texts": texts_low, "steps": [2] * MIN_PER_CANVAS},
              0.9: {"texts": texts_top, "steps": [4] * MIN_PER_CANVAS}}
    curve = _curve(AGREEMENT, by_tau, items)
    assert curve["by_canvas"][16] == {"0.7": 0.95, "0.9": 1.0} == curve["accuracy"]
