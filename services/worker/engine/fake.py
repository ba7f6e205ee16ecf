"""A FAKE engine of zero compute, for control-plane benchmarks and infrastructure tests.

It has the engine interface the worker service uses (``services/worker/engine/protocol.py``) but runs
no model: each step commits a fixed number of the current block's masked positions (token ``FILL_ID``),
so a request of gen length L finishes after L / tokens_per_step steps. Everything the worker does around a step (state loads,
versioned writes, events, results) is real, so what a benchmark measures is the control plane.
"""

from __future__ import annotations

from services.worker.decoding.sampling import SamplingParams
from services.worker.engine.request import ConfidenceStats, EngineError, RequestState, StepResult
from services.worker.kv.pages import KVMemory
from shared.generation import Answer
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
        self.max_gen_length: int | None = None
        self.stop_at_eos = True  # it never commits an EOS: its answers are whole canvases
        self.tokenizer = None
        self._cached: set[str] = set()  # requests with a (pretend) KV cache here
        self._stats: dict[int, ConfidenceStats] = {}  # masked positions left in the block -> their stats

    def new_request(self, request_id: str, prompt_ids: list[int], gen_length: int | None = None,
                    block_length: int | None = None, cache_mode: CacheMode = CacheMode.DUAL,
                    ignore_eos: bool = False, sampling: SamplingParams | None = None, num_top_logprobs: int = 0,
                    stop: tuple[str, ...] | list[str] = (), max_tokens: int | None = None) -> RequestState:
        """The request's state; sampling, logprobs and stop strings are kept on it but change nothing here."""
        return RequestState(request_id, list(prompt_ids), [self.mask_id] * (gen_length or self.default_gen_length),
                            block_length or self.default_block_length, cache_mode, ignore_eos=ignore_eos,
                            sampling=sampling or SamplingParams(), num_top_logprobs=num_top_logprobs,
                            stop=tuple(stop), max_tokens=max_tokens)

    def drop(self, request_id: str) -> None:
        self._cached.discard(request_id)

    def has_cache(self, request_id: str) -> bool:
        return request_id in self._cached

    def next_step_kind(self, state: RequestState) -> StepKind:
        """A cache step where it holds the request's (pretend) cache and the block is under way."""
        start, _ = state.block_bounds(state.current_block(self.mask_id))
        cached = state.cache_mode is not CacheMode.NONE and state.request_id in self._cached
        return StepKind.CACHE if cached and state.canvas[start] != self.mask_id else StepKind.RECOMPUTE

    def step(self, batch: list[tuple[RequestState, float]]) -> list[StepResult]:
        return [self._step(state, tau) for state, tau in batch]

    def _step(self, state: RequestState, threshold: float) -> StepResult:
        canvas, mask = state.canvas, self.mask_id
        kind = self.next_step_kind(state)
        block = state.current_block(mask)
        start, end = state.block_bounds(block)
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

    # --- KV memory: none -------------------------------------------------------------------------

    def kv_memory(self) -> KVMemory:
        return KVMemory(budget_bytes=0, pool_bytes=0, used_bytes=0, used_tokens=0, bytes_per_token=0,
                        page_tokens=1, num_requests=len(self._cached))

    def kv_overflow(self, batch: list[tuple[RequestState, float]]) -> list[str]:
        return []

    def set_kv_budget(self, budget_bytes: int) -> None:
        """Nothing to cap: the fake holds no KV memory."""

    def trim_kv(self) -> int:
        return 0

    # --- the rest of the engine's interface -------------------------------------------------------

    def warm_up(self, max_batch: int = 0) -> int:
        return 0

    def close(self) -> None:
        """Nothing to give back."""

    def answer(self, state: RequestState, max_tokens: int | None = None, upto: int | None = None) -> Answer:
        return state.answer(self.eos_id, self.stop_at_eos, max_tokens, upto)

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    def encode(self, text: str) -> list[int]:
        raise EngineError("the zero-compute engine has no tokenizer: pass token ids")
