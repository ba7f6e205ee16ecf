"""A FAKE engine of zero compute, for control-plane benchmarks and infrastructure tests.

It has the ``DLMEngine`` interface the worker service uses but runs no model: each step commits a
fixed number of the current block's masked positions (token ``FILL_ID``), so a request of gen length
L finishes after L / tokens_per_step steps. Everything the worker does around a step (state loads,
versioned writes, events, results) is real, so what a benchmark measures is the control plane.
"""

from __future__ import annotations

from services.worker.engine.request import ConfidenceStats, EngineError, RequestState, StepResult
from shared.messages.base import CacheMode, StepKind

FILL_ID = 5  # the token the fake commits


class ZeroComputeEngine:
    """FAKE: commits ``tokens_per_step`` positions per step, computes nothing."""

    name = "zero-compute"
    blocking = False  # a step costs microseconds: the worker runs it on its event loop, no thread hop

    def __init__(self, tokens_per_step: int = 1, mask_id: int = 1, eos_id: int = 2) -> None:
        if tokens_per_step < 1:
            raise EngineError("tokens_per_step must be at least 1")
        self.tokens_per_step = tokens_per_step
        self.mask_id, self.eos_id = mask_id, eos_id
        self.default_gen_length, self.default_block_length = 256, 32
        self.tokenizer = None
        self._cached: set[str] = set()  # requests with a (pretend) KV cache here
        self._stats: dict[int, ConfidenceStats] = {}  # masked positions left in the block -> their stats

    def new_request(self, request_id: str, prompt_ids: list[int], gen_length: int | None = None,
                    block_length: int | None = None, cache_mode: CacheMode = CacheMode.DUAL) -> RequestState:
        return RequestState(request_id, list(prompt_ids), [self.mask_id] * (gen_length or self.default_gen_length),
                            block_length or self.default_block_length, cache_mode)

    def drop(self, request_id: str) -> None:
        self._cached.discard(request_id)

    def has_cache(self, request_id: str) -> bool:
        return request_id in self._cached

    def step(self, batch: list[tuple[RequestState, float]]) -> list[StepResult]:
        return [self._step(state, tau) for state, tau in batch]

    def _step(self, state: RequestState, threshold: float) -> StepResult:
        canvas, mask = state.canvas, self.mask_id
        block = state.current_block(mask)
        start, end = state.block_bounds(block)
        kind = StepKind.CACHE if (state.cache_mode is not CacheMode.NONE and state.request_id in self._cached
                                  and canvas[start] != mask) else StepKind.RECOMPUTE
        masked = []
        i = canvas.index(mask, start, end)
        while len(masked) < self.tokens_per_step:
            masked.append(i)
            canvas[i] = FILL_ID
            try:
                i = canvas.index(mask, i + 1, end)
            except ValueError:
                break
        state.num_steps += 1
        num_masked = canvas.count(mask)
        state.finished = num_masked == 0
        if state.finished:
            self._cached.discard(state.request_id)
        else:
            self._cached.add(state.request_id)
        left = canvas[start:end].count(mask)
        return StepResult(state.request_id, kind, block, masked, [FILL_ID] * len(masked), state.finished,
                          state.num_steps, num_masked, self._confidence(left), threshold, block_done=left == 0)

    def _confidence(self, num_left: int) -> ConfidenceStats:
        """The stats of ``num_left`` positions at confidence 0.5 (memoised: the same for every request)."""
        stats = self._stats.get(num_left)
        if stats is None:
            stats = self._stats[num_left] = ConfidenceStats.of([0.5] * num_left)
        return stats

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    def encode(self, text: str) -> list[int]:
        raise EngineError("the zero-compute engine has no tokenizer: pass token ids")
