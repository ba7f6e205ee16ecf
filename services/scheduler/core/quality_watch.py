"""Quality kept true while serving: the answers of served requests, decoded again at the highest
threshold (shadow decoding), against what the served model's quality curve promised.

The scheduler service samples finished requests that ran below the highest candidate, decodes each
again at the highest threshold at the lowest priority (it waits for a free slot and is visited last
by load control, so it never lowers anyone's threshold), and reports here whether the two answers
agree. ``QualityWatch`` keeps the agreement per threshold (the lowest one the served request ran at,
snapped to the candidates) and says the lowest threshold still allowed: where a threshold's observed
agreement, over at least ``min_samples`` answers, falls more than ``tolerance`` below what the curve
promised, it and every candidate below it leave the candidates (``ThresholdGrid.quality_floor``).

What a curve promises: an ``agreement`` curve (``dls calibrate`` without labelled problems: the share
of answers equal to the highest threshold's) promises its own value; a labelled accuracy curve
promises that the answers differ from the highest threshold's at most as often as the accuracy
drops, ``1 - (accuracy(top) - accuracy(t))``.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


def promised_agreement(curve: Mapping[str, float], source: str, thresholds: Sequence[float]) -> dict[float, float]:
    """Threshold -> the agreement with the highest threshold's answers that ``curve`` promises."""
    values = {float(t): float(a) for t, a in curve.items()}
    top = max(thresholds)
    promised = {}
    for t in thresholds:
        if t not in values:
            continue
        if source == "agreement":
            promised[t] = values[t]
        elif top in values:
            promised[t] = 1.0 - max(0.0, values[top] - values[t])
    return promised


@dataclass
class QualityWatch:
    """Shadow decodings' agreement per candidate threshold, and the floor it implies."""

    thresholds: tuple[float, ...]  # the candidates, ascending
    promised: dict[float, float]  # threshold -> agreement promised (``promised_agreement``)
    min_samples: int = 20
    tolerance: float = 0.02  # how far below the promise an observed agreement may fall
    rate: float = 0.01  # share of the requests served below the highest threshold decoded again
    step_budget: float = 0.02  # most shadow steps as a share of every request-step (a new one waits below it)
    counts: dict[float, list[int]] = field(default_factory=dict)  # threshold -> [agreed, observed]

    def __post_init__(self) -> None:
        self.thresholds = tuple(sorted(self.thresholds))

    @property
    def top(self) -> float:
        return self.thresholds[-1]

    def wants(self, lowest_threshold: float, draw: float, shadow_steps: int = 0, steps: int = 0,
              reserved_steps: float = 0.0) -> bool:
        """Decode again a request served as low as ``lowest_threshold``? (``draw``: uniform in [0, 1);
        ``shadow_steps`` of ``steps`` request-steps so far were shadow decodings', and ``reserved_steps``
        more are expected of those running and of this one: it starts only where all of them stay
        within the step budget)."""
        within = shadow_steps + reserved_steps <= self.step_budget * steps
        return lowest_threshold < self.top - 1e-9 and draw < self.rate and within

    def snap(self, threshold: float) -> float:
        """The candidate a served threshold counts under: the nearest at or below it."""
        i = bisect.bisect_right(self.thresholds, threshold + 1e-9) - 1
        return self.thresholds[max(i, 0)]

    def observe(self, threshold: float, agreed: bool) -> float:
        """One shadow decoding of a request served as low as ``threshold``; the candidate it counted under."""
        key = self.snap(threshold)
        count = self.counts.setdefault(key, [0, 0])
        count[0] += int(agreed)
        count[1] += 1
        return key

    def agreement(self, threshold: float) -> float | None:
        count = self.counts.get(threshold)
        return count[0] / count[1] if count and count[1] else None

    def broken(self) -> list[float]:
        """Thresholds whose observed agreement fell below their promise (with enough samples)."""
        out = []
        for t, (agreed, observed) in sorted(self.counts.items()):
            if observed >= self.min_samples and t in self.promised:
                if agreed / observed < self.promised[t] - self.tolerance:
                    out.append(t)
        return out

    def floor(self) -> float:
        """The lowest candidate still allowed: above every broken threshold (0.0: none broken)."""
        broken = self.broken()
        if not broken:
            return 0.0
        above = [t for t in self.thresholds if t > max(broken)]
        return above[0] if above else self.thresholds[-1]
