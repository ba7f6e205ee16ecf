"""A request as the engine sees it, and what one step of it returns.

A request's state is plain data (:class:`RequestState`): prompt ids, the generation canvas (mask ids
where nothing is committed yet), block length, cache mode, step count. Any engine can continue a
request from it; the only thing an engine keeps locally is the request's KV cache, which it rebuilds
with a recompute step when it does not have it (that is what makes migration cheap).

The answer in a canvas (:meth:`RequestState.answer`) is said once here for every engine: up to the
first EOS, cut at ``max_tokens``, ended before a stop string (``shared.generation``), unless EOS is
ignored, either by the request (``ignore_eos``: benchmarks decode the whole canvas) or by the engine
(``stop_at_eos=False``: tests and benchmarks decode every canvas whole).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.worker.decoding.sampling import SamplingParams
from shared.generation import Answer, answer_of
from shared.messages.base import CacheMode, StepKind


class EngineError(ValueError):
    """A request the engine cannot run (bad lengths, unknown tokens, bad threshold)."""


@dataclass
class RequestState:
    """Everything needed to continue a request on any engine."""

    request_id: str
    prompt_ids: list[int]
    canvas: list[int]  # generation positions; the mask id where not committed yet
    block_length: int
    cache_mode: CacheMode = CacheMode.DUAL
    num_steps: int = 0
    finished: bool = False
    ignore_eos: bool = False  # decode the whole canvas (benchmarks); otherwise stop at the EOS block
    sampling: SamplingParams = field(default_factory=SamplingParams)  # greedy unless a temperature is set
    num_top_logprobs: int = 0  # record this many most likely tokens at every committed position
    stop: tuple[str, ...] = ()  # stop strings: the answer ends before the first one
    max_tokens: int | None = None  # the answer's cap (stop strings are looked for within it)
    # canvas position -> the model's probability of the token committed there (0.0: none committed by a step)
    confidences: list[float] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)  # canvas position -> most likely tokens
    top_probs: list[list[float]] = field(default_factory=list)  # canvas position -> their probabilities
    stop_length: int | None = None  # answer tokens, once a stop string ended the answer
    # canvas position where the model expects the answer's EOS, from the last full forward (gen_length:
    # none within the canvas; None: no full forward here yet). Kept in memory only: a request that moves
    # runs a full forward first anyway, which tells it again (the step predictor's end feature)
    predicted_end: int | None = None

    @property
    def gen_length(self) -> int:
        return len(self.canvas)

    @property
    def sequence_length(self) -> int:
        """Prompt plus canvas: the positions a KV cache of the request holds."""
        return len(self.prompt_ids) + len(self.canvas)

    def record_commit(self, position: int, probability: float, top: tuple[list[int], list[float]] | None) -> None:
        """Remember what ``position`` was committed with (``logprobs``)."""
        if len(self.confidences) != self.gen_length:
            self.confidences = (self.confidences + [0.0] * self.gen_length)[: self.gen_length]
        self.confidences[position] = probability
        if top is not None:
            if len(self.top_token_ids) != self.gen_length:
                self.top_token_ids = (self.top_token_ids + [[] for _ in range(self.gen_length)])[: self.gen_length]
                self.top_probs = (self.top_probs + [[] for _ in range(self.gen_length)])[: self.gen_length]
            self.top_token_ids[position], self.top_probs[position] = top

    @property
    def num_blocks(self) -> int:
        return -(-self.gen_length // self.block_length)

    def block_bounds(self, block: int) -> tuple[int, int]:
        start = block * self.block_length
        return start, min(start + self.block_length, self.gen_length)

    def current_block(self, mask_id: int) -> int:
        """The block the next step decodes: the one holding the first masked position (``num_blocks``
        once none is masked)."""
        if mask_id not in self.canvas:
            return self.num_blocks
        return self.canvas.index(mask_id) // self.block_length

    def stops_at_eos(self, engine_stops_at_eos: bool = True) -> bool:
        """Whether the answer ends at its first EOS: unless the request or the engine ignores EOS."""
        return engine_stops_at_eos and not self.ignore_eos

    def answer(self, eos_id: int, engine_stops_at_eos: bool = True, max_tokens: int | None = None,
               upto: int | None = None) -> Answer:
        """The answer of the canvas, cut at ``max_tokens`` (default: the request's own cap) and ended
        before a stop string; ``upto``: of the canvas's first ``upto`` positions only (an answer so far)."""
        cap = self.max_tokens if max_tokens is None else max_tokens
        canvas, stopped = (self.canvas, self.stop_length) if upto is None else (self.canvas[:upto], None)
        return answer_of(canvas, eos_id, cap, not self.stops_at_eos(engine_stops_at_eos), stopped)


@dataclass(frozen=True)
class ConfidenceStats:
    """Confidences of the current block's positions still masked after the step (1.0 when none)."""

    min: float
    q25: float
    median: float
    mean: float
    q75: float

    @classmethod
    def of(cls, values: list[float]) -> ConfidenceStats:
        if not values:
            return cls(1.0, 1.0, 1.0, 1.0, 1.0)
        v = sorted(values)
        return cls(v[0], _quantile(v, 0.25), _quantile(v, 0.5), sum(v) / len(v), _quantile(v, 0.75))


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass
class StepResult:
    request_id: str
    kind: StepKind
    block_index: int  # the block this step decoded
    committed_positions: list[int]  # indices into the canvas
    committed_token_ids: list[int]
    finished: bool
    num_steps: int  # steps done so far, this one included
    num_masked: int  # masked canvas positions left
    confidence: ConfidenceStats
    threshold: float
    # every position masked before this step: its top probability, in position order (what the
    # commit rule compared with the threshold; the simulator's replay derives other thresholds' commits)
    masked_confidences: tuple[float, ...] = ()
    blocks_skipped: int = 0  # blocks left undecoded because this step completed one holding an EOS
    predicted_end: int | None = None  # ``RequestState.predicted_end`` after the step
    block_done: bool = False  # no position of the step's block is masked any more (a stream's text is due)


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    num_steps: int
    step_kinds: list[StepKind] = field(default_factory=list)
    finish_reason: str = "stop"  # "stop" (an EOS within max_tokens) or "length"
    blocks_skipped: int = 0  # blocks early stop saved
