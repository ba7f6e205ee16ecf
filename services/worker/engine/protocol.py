"""What the worker service and the tools need from an engine, said once: :class:`Engine`.

Every engine has all of it, so no caller probes with ``getattr``: the denoising engine
(``DLMEngine``, ``services/worker/engine/engine.py``), its tensor-parallel form
(``TensorParallelEngine``, ``services/worker/parallel/tp_engine.py``: a ``DLMEngine`` whose runner
spreads each forward over its ranks) and the zero-compute fake (``ZeroComputeEngine``,
``services/worker/engine/fake.py``, which holds no KV memory and says so with zeros).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from shared.messages.base import CacheMode, StepKind

if TYPE_CHECKING:
    from services.worker.decoding.sampling import SamplingParams
    from services.worker.engine.request import RequestState, StepResult
    from services.worker.kv.pages import KVMemory
    from shared.generation import Answer


@runtime_checkable
class Engine(Protocol):
    """A model instance that advances batches of requests one denoising step at a time."""

    name: str  # the served model's name
    mask_id: int  # the canvas's not-yet-committed token
    eos_id: int
    default_gen_length: int  # a request's canvas when it names none
    default_block_length: int
    max_gen_length: int | None  # longest canvas the model answers the same at (None: any)
    stop_at_eos: bool  # False: every canvas is decoded whole (tests, benchmarks)
    tokenizer: object | None  # None: token ids only (``encode`` refuses text)
    blocking: bool  # a step takes long enough that the worker runs it off its event loop

    def new_request(self, request_id: str, prompt_ids: list[int], gen_length: int | None = None,
                    block_length: int | None = None, cache_mode: CacheMode = CacheMode.DUAL,
                    ignore_eos: bool = False, sampling: SamplingParams | None = None, num_top_logprobs: int = 0,
                    stop: tuple[str, ...] | list[str] = (), max_tokens: int | None = None) -> RequestState:
        """A request's starting state (``EngineError`` for one this engine cannot run)."""
        ...

    def step(self, batch: list[tuple[RequestState, float]]) -> list[StepResult]:
        """Advance every (state, threshold) by one step; the states are updated in place, the results in
        batch order. ``KVBudgetExceeded`` (nothing changed) when the batch would overflow the KV budget."""
        ...

    def next_step_kind(self, state: RequestState) -> StepKind:
        """What the next step of ``state`` computes here (a recompute without this engine's cache of it)."""
        ...

    def drop(self, request_id: str) -> None:
        """Forget a request's KV cache (it finished, or moved to another instance)."""
        ...

    def has_cache(self, request_id: str) -> bool: ...

    def kv_memory(self) -> KVMemory:
        """The KV pool's memory (plain reads: safe from another thread while a step runs)."""
        ...

    def kv_overflow(self, batch: list[tuple[RequestState, float]]) -> list[str]:
        """Requests of ``batch`` whose next step would take KV memory beyond the budget (batch order: the
        first ones fit); empty without a budget."""
        ...

    def set_kv_budget(self, budget_bytes: int) -> None:
        """Cap the KV pool at ``budget_bytes`` per GPU (0: no cap)."""
        ...

    def trim_kv(self) -> int:
        """Give the KV pool's memory back when no request holds any; the bytes freed."""
        ...

    def warm_up(self, max_batch: int = ...) -> int:
        """The first steps' lazy work done now, before the worker says it is ready; the CUDA graphs held."""
        ...

    def close(self) -> None:
        """Give back what the engine holds beyond its memory (processes, a process group). Idempotent."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str:
        """Answer text, special tokens dropped."""
        ...

    def answer(self, state: RequestState, max_tokens: int | None = None, upto: int | None = None) -> Answer:
        """The answer in ``state``'s canvas (``RequestState.answer``), cut at ``max_tokens`` (default: the
        request's cap); ``upto``: the answer so far in the canvas's first ``upto`` positions."""
        ...
