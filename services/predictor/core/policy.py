"""Update granularity: when a running request gets a fresh prediction.

Every step is the most accurate and the most expensive; the paper picks the coarsest granularity
whose error stays within 5% of per-step updates (Figure 7; ``bench.predictor`` repeats the study).
Between updates the latest prediction is aged by the steps run since it was made.

Any granularity can add ``+final``: a request whose last prediction, so aged, says it is on its final
step skips the update one step after it (its estimate is already the one-step minimum, which an
unfinished request most often meets); the next step is due again, so an underestimate lives at most
two steps. Short requests spend a large share of their steps there: this saves updates at almost no
error.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Granularity(StrEnum):
    STEP = "step"  # after every step
    STEPS = "steps"  # after every k steps
    PROGRESS = "progress"  # once the committed fraction of the output grew by x since the last update
    ONE_SHOT = "oneshot"  # at arrival only (the ablation)


@dataclass(frozen=True, slots=True)
class UpdateMark:
    """Where the request was at its last update."""

    num_steps_done: int
    progress: float  # committed fraction of the output
    predicted_steps: float | None = None  # remaining steps it predicted at the request's threshold


@dataclass(frozen=True, slots=True)
class UpdatePolicy:
    """``every`` is k for STEPS and the fraction x for PROGRESS (ignored otherwise)."""

    granularity: Granularity = Granularity.STEP
    every: float = 1.0
    skip_final: bool = False  # ``+final``: skip one update when the aged prediction says one step is left

    def __post_init__(self) -> None:
        if self.granularity is Granularity.STEPS and (self.every < 1 or self.every != int(self.every)):
            raise ValueError(f"steps granularity needs a whole number of steps >= 1, got {self.every}")
        if self.granularity is Granularity.PROGRESS and not 0 < self.every <= 1:
            raise ValueError(f"progress granularity needs a fraction in (0, 1], got {self.every}")

    @classmethod
    def parse(cls, text: str) -> UpdatePolicy:
        """``step``, ``steps:4``, ``progress:0.25`` or ``oneshot``, each optionally with ``+final``."""
        base, plus, modifier = text.strip().partition("+")
        kind, _, value = base.partition(":")
        try:
            if plus and modifier != "final":
                raise ValueError(f"unknown modifier {modifier!r}")
            return cls(Granularity(kind), float(value) if value else 1.0, skip_final=bool(plus))
        except ValueError as exc:
            raise ValueError(f"bad update granularity {text!r}: {exc}") from None

    @property
    def name(self) -> str:
        if self.granularity is Granularity.STEPS:
            base = f"steps:{int(self.every)}"
        elif self.granularity is Granularity.PROGRESS:
            base = f"progress:{self.every:g}"
        else:
            base = self.granularity.value
        return base + ("+final" if self.skip_final else "")

    def is_due(self, last: UpdateMark | None, num_steps_done: int, progress: float) -> bool:
        """Whether a request at (steps done, progress) needs a fresh prediction now."""
        if last is None:
            return True  # no prediction yet (arrival, or the first state the caller saw)
        since = num_steps_done - last.num_steps_done
        if self.skip_final and last.predicted_steps is not None and since < 2:
            if last.predicted_steps - since <= 1.0:
                return False
        match self.granularity:
            case Granularity.STEP:
                return num_steps_done > last.num_steps_done
            case Granularity.STEPS:
                return num_steps_done - last.num_steps_done >= self.every
            case Granularity.PROGRESS:
                return progress - last.progress >= self.every - 1e-9
            case Granularity.ONE_SHOT:
                return False
