"""Tensor parallelism: one model instance spread over ``d`` processes (Megatron-style sharding).

Sharding: ``services/worker/model/parallel.py``.

The engine (:class:`TensorParallelEngine`) is SPMD: each rank runs the ordinary :class:`DLMEngine`
step logic with its shard, so each rank's KV cache holds its own heads. Rank 0 lives in the caller's
process; ranks 1..d-1 are child processes (``torch.multiprocessing``, spawn). For every step rank 0
rings a doorbell (a pipe per child, which a child can wait on for as long as the worker is idle,
without tripping the process group's timeout) and then broadcasts the step (the request states as
they are on rank 0, their thresholds, and the cache drops since the last step) with
``broadcast_object_list``. Broadcasting the states each step is what keeps the ranks in agreement
when the worker loads a state from the state store at any step.

``d = 1`` needs none of this: ``make_engine`` (``services/worker/parallel/build.py``) returns a plain
:class:`DLMEngine` then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.worker.decoding.sampling import SamplingParams
from services.worker.engine.engine import DLMEngine
from services.worker.engine.request import RequestState, StepResult
from services.worker.kv.cache import KVBudgetExceeded
from services.worker.model.dlm import DLMForMaskedDiffusion
from services.worker.model.loading import load_model
from services.worker.model.parallel import ShardingError, shard_model
from services.worker.parallel.placement import rank_device
from shared.messages.base import CacheMode, StepKind

_HOST = "127.0.0.1"
_START_POLL_S = 0.1  # how often rank 0 checks on children while they start
_IDLE_POLL_S = 1.0  # how often an idle child checks that rank 0 is still there
_JOIN_S = 10.0  # how long close() waits for a child to leave on its own before terminating it


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or is gone; the engine cannot be used any more."""


# --- one rank -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RankSpec:
    """What every rank needs to build its engine (sent to the children, so plain data)."""

    model_dir: str
    degree: int
    device: str
    dtype: torch.dtype | None
    stop_at_eos: bool
    num_threads: int | None
    timeout_s: float
    trust_remote_code: bool = False  # tokenizer code the checkpoint ships may run (DLS_TRUST_REMOTE_CODE)

    @property
    def backend(self) -> str:
        return "nccl" if torch.device(self.device).type == "cuda" else "gloo"

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    def rank_device(self, rank: int) -> torch.device:
        return rank_device(self.device, rank)


def _load_shard(spec: _RankSpec, rank: int) -> tuple[DLMEngine, DLMForMaskedDiffusion]:
    # slice on the CPU, then move
    loaded = load_model(spec.model_dir, device="cpu", dtype=spec.dtype, trust_remote_code=spec.trust_remote_code)
    shard_model(loaded.model, rank, spec.degree)
    loaded.model.to(spec.rank_device(rank))
    return DLMEngine.from_loaded(loaded, stop_at_eos=spec.stop_at_eos), loaded.model


def _init_group(spec: _RankSpec, rank: int, store: dist.Store) -> None:
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.rank_device(rank))
    dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.degree, timeout=spec.timeout)


def _step_summary(results: list[StepResult], batch: list[tuple[RequestState, float]]) -> list:
    """What must be identical on every rank after a step."""
    committed = [(r.request_id, int(r.kind), r.block_index, r.committed_positions, r.committed_token_ids,
                  r.finished, r.num_steps) for r in results]
    return [committed, [(s.canvas, s.num_steps, s.finished) for s, _ in batch]]


@torch.no_grad()
def _forward(model: DLMForMaskedDiffusion, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    mask = None if attention_mask is None else attention_mask.to(model.device)
    return model(input_ids.to(model.device), attention_mask=mask).logits


def _rank_main(rank: int, spec: _RankSpec, port: int, conn: Connection) -> None:
    """Entry point of ranks 1..d-1: start, then follow rank 0's commands until told to stop."""
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    try:
        conn.send(("hello",))
        store = dist.TCPStore(_HOST, port, spec.degree, is_master=False, timeout=spec.timeout)
        _init_group(spec, rank, store)
        engine, model = _load_shard(spec, rank)
    except Exception as exc:  # noqa: BLE001 - any start-up failure is reported to rank 0
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    conn.send(("ready",))
    try:
        _serve(engine, model, conn)
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait_for_doorbell(conn: Connection) -> bool:
    """True when rank 0 is about to broadcast a command; False when it said to leave or is gone."""
    while True:
        try:
            if conn.poll(_IDLE_POLL_S):
                return conn.recv() == "go"
        except (EOFError, OSError):  # rank 0's end of the pipe closed: its process is gone
            return False
        parent = mp.parent_process()
        if parent is not None and not parent.is_alive():
            return False


def _serve(engine: DLMEngine, model: DLMForMaskedDiffusion, conn: Connection) -> None:
    while _wait_for_doorbell(conn):
        box = [None]
        dist.broadcast_object_list(box, src=0)
        command, *args = box[0]
        if command == "shutdown":
            return
        if command == "step":
            drop_ids, batch, verify = args
            for request_id in drop_ids:
                engine.drop(request_id)
            results = engine.step(batch)
            if verify:
                dist.all_gather_object([None] * dist.get_world_size(), _step_summary(results, batch))
        elif command == "forward":
            _forward(model, *args)
        elif command == "kv":  # the KV pool's budget or trim, the same on every rank
            method, *kv_args = args
            getattr(engine, method)(*kv_args)
        else:
            raise TensorParallelError(f"unknown command {command!r}")


# --- rank 0: the engine ---------------------------------------------------------------------------


class TensorParallelEngine:
    """A :class:`DLMEngine` whose model is split over ``tp`` processes; same public API.

    ``device``: ``cpu`` (backend gloo) or ``cuda``/``cuda:N`` (backend nccl, rank r on GPU N + r;
    rank 0 makes GPU N the caller's current device).
    ``num_threads``: torch threads of each child rank (rank 0 keeps the caller's setting; None leaves
    the children's default). ``timeout_s``: the process group's timeout, after which a rank that
    stopped answering makes the call fail instead of hang (idle time between calls does not count).
    ``verify``: after each step, check that every rank committed the same tokens (one extra
    collective per step; for tests and debugging). ``start_timeout_s``: how long the child ranks may
    take to start.

    A process has at most one default ``torch.distributed`` process group, so at most one
    tensor-parallel engine runs per process at a time; :meth:`close` releases it (also usable as a
    context manager). After a rank fails, every call raises :class:`TensorParallelError`.
    """

    def __init__(
        self,
        model_dir: str | Path,
        tp: int,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        stop_at_eos: bool = True,
        num_threads: int | None = 1,
        timeout_s: float = 60.0,
        verify: bool = False,
        start_timeout_s: float = 180.0,
        trust_remote_code: bool = False,
    ) -> None:
        if tp < 2:
            raise ShardingError(f"TensorParallelEngine needs tp >= 2, got {tp} (use make_engine for tp=1)")
        if dist.is_initialized():
            raise TensorParallelError(
                "this process already has a torch.distributed process group; close the other "
                "tensor-parallel engine first"
            )
        self.tp = tp
        self.verify = verify
        self._start_timeout_s = start_timeout_s
        self._spec = _RankSpec(str(model_dir), tp, device, dtype, stop_at_eos, num_threads, timeout_s, trust_remote_code)
        self._children: list[tuple[mp.Process, Connection]] = []  # rank - 1 -> (process, rank 0's pipe end)
        self._drop_ids: list[str] = []  # dropped on rank 0 since the last step; the others drop them next
        self._failure: str | None = None  # why the engine is unusable
        self._closed = False
        self._owns_group = False
        # Loading (and sharding) here first reports a bad directory or degree before any process starts.
        self._engine, self.model = _load_shard(self._spec, 0)
        try:
            self._start_ranks()
        except BaseException:
            self.close()
            raise

    def _start_ranks(self) -> None:
        ctx = mp.get_context("spawn")
        # Port 0: the OS picks a free port, and the store owns it from then on (no race for it).
        self._store = dist.TCPStore(_HOST, 0, self.tp, is_master=True, wait_for_workers=False,
                                    timeout=self._spec.timeout)
        for rank in range(1, self.tp):
            parent_end, child_end = ctx.Pipe()
            process = ctx.Process(target=_rank_main, args=(rank, self._spec, self._store.port, child_end),
                                  name=f"dls-tp-rank{rank}", daemon=True)
            process.start()
            child_end.close()
            self._children.append((process, parent_end))
        self._await_children("hello")
        _init_group(self._spec, 0, self._store)
        self._owns_group = True
        self._await_children("ready")

    def _await_children(self, expected: str) -> None:
        for rank, (process, conn) in enumerate(self._children, start=1):
            waited = 0.0
            while not conn.poll(_START_POLL_S):
                waited += _START_POLL_S
                if not process.is_alive():
                    raise TensorParallelError(f"rank {rank} exited with code {process.exitcode} while starting")
                if waited > self._start_timeout_s:
                    raise TensorParallelError(f"rank {rank} did not start within {self._start_timeout_s} s")
            try:
                message = conn.recv()
            except EOFError:  # the child closed its end: it is exiting
                process.join(_JOIN_S)
                raise TensorParallelError(f"rank {rank} exited with code {process.exitcode} while starting") from None
            if message[0] == "error":
                raise TensorParallelError(f"rank {rank} failed to start: {message[1]}")
            if message[0] != expected:
                raise TensorParallelError(f"rank {rank} sent {message!r} while starting, expected {expected!r}")

    # --- the calls that every rank makes --------------------------------------------------------

    def step(self, batch: list[tuple[RequestState, float]]) -> list[StepResult]:
        """Advance every (state, threshold) by one step on all ranks; states are updated in place."""
        self._check_usable()
        for state, threshold in batch:
            # Validate here, before any rank is involved: a bad request must not leave the ranks
            # half-way through a collective. Planning has no side effects.
            self._engine._plan(state, threshold)
        over = self._engine.kv_overflow(batch)  # every rank's pool holds the same pages: rank 0 answers
        if over:  # refused here, before any rank is involved (a rank raising mid-command would be lost)
            needed = sum(self._engine.kv_cache.pages_for(len(s.prompt_ids) + s.gen_length)
                         for s, _ in batch if s.request_id in over)
            raise KVBudgetExceeded(over, needed, self._engine.kv_cache.budget_pages_left or 0,
                                   self._engine.kv_cache.page_bytes)
        drop_ids, self._drop_ids = self._drop_ids, []
        return self._on_all_ranks(("step", drop_ids, batch, self.verify), lambda: self._local_step(batch))

    def _local_step(self, batch: list[tuple[RequestState, float]]) -> list[StepResult]:
        results = self._engine.step(batch)
        if self.verify:
            summaries = [None] * self.tp
            dist.all_gather_object(summaries, _step_summary(results, batch))
            for rank, summary in enumerate(summaries):
                if summary != summaries[0]:
                    raise TensorParallelError(f"rank {rank} committed different tokens from rank 0")
        return results

    def forward_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One forward of the sharded model over ``input_ids`` [B, Q]; rank 0's logits [B, Q, V] on the CPU."""
        self._check_usable()
        input_ids = input_ids.cpu()
        attention_mask = None if attention_mask is None else attention_mask.cpu()
        command = ("forward", input_ids, attention_mask)
        return self._on_all_ranks(command, lambda: _forward(self.model, input_ids, attention_mask)).cpu()

    def _on_all_ranks(self, command: tuple, local: Callable):
        try:
            self._ring_doorbells()
            dist.broadcast_object_list([command], src=0)
            return local()
        except TensorParallelError as exc:
            self._failure = str(exc)
            raise
        except BaseException as exc:
            # The other ranks may be anywhere in the step now: the engine cannot go on.
            self._failure = f"{command[0]} failed on rank 0 ({type(exc).__name__}: {exc}){self._dead_ranks_note()}"
            if isinstance(exc, Exception):
                raise TensorParallelError(self._failure) from exc
            raise  # KeyboardInterrupt and the like pass through as they are

    def _ring_doorbells(self) -> None:
        dead = self._dead_ranks_note()
        if dead:
            raise TensorParallelError(dead.removeprefix("; "))
        for rank, (_, conn) in enumerate(self._children, start=1):
            try:
                conn.send("go")
            except OSError as exc:
                raise TensorParallelError(f"rank {rank} is unreachable ({exc})") from None

    def _dead_ranks_note(self) -> str:
        dead = [f"rank {rank} exited with code {process.exitcode}"
                for rank, (process, _) in enumerate(self._children, start=1) if not process.is_alive()]
        return "; " + ", ".join(dead) if dead else ""

    def _check_usable(self) -> None:
        if self._closed:
            raise TensorParallelError("the tensor-parallel engine is closed")
        if self._failure is not None:
            raise TensorParallelError(f"the tensor-parallel engine is unusable: {self._failure}; close it")

    # --- local calls (every rank holds the same caches, so rank 0 answers) -----------------------

    def drop(self, request_id: str) -> None:
        """Forget a request's cache (it finished, or moved to another instance)."""
        self._engine.drop(request_id)
        self._drop_ids.append(request_id)

    def has_cache(self, request_id: str) -> bool:
        return self._engine.has_cache(request_id)

    def next_step_kind(self, state: RequestState) -> StepKind:
        return self._engine.next_step_kind(state)

    def new_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        gen_length: int | None = None,
        block_length: int | None = None,
        cache_mode: CacheMode = CacheMode.DUAL,
        ignore_eos: bool = False,
        sampling: SamplingParams | None = None,
        num_top_logprobs: int = 0,
        stop: tuple[str, ...] | list[str] = (),
        max_tokens: int | None = None,
    ) -> RequestState:
        return self._engine.new_request(request_id, prompt_ids, gen_length, block_length, cache_mode, ignore_eos,
                                        sampling, num_top_logprobs, stop, max_tokens)

    def encode(self, text: str) -> list[int]:
        return self._engine.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._engine.decode(ids)

    # These only call step/new_request/encode/decode, so DLMEngine's own versions run on all ranks here.
    run_to_completion = DLMEngine.run_to_completion
    warm_steps = DLMEngine.warm_steps

    def warm_up(self, max_batch: int = 0) -> int:
        """One short request through every rank; no CUDA graphs (a shard all-reduces between layers)."""
        self.warm_steps()
        return 0
    generate = DLMEngine.generate
    answer = DLMEngine.answer

    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def mask_id(self) -> int:
        return self._engine.mask_id

    @property
    def eos_id(self) -> int:
        return self._engine.eos_id

    @property
    def default_gen_length(self) -> int:
        return self._engine.default_gen_length

    @property
    def default_block_length(self) -> int:
        return self._engine.default_block_length

    @property
    def stop_at_eos(self) -> bool:
        return self._engine.stop_at_eos

    @property
    def max_gen_length(self) -> int | None:
        return self._engine.max_gen_length

    @property
    def last_step_traffic(self):
        """Rank 0's KV bytes moved in the last step (each rank moves the same for its own heads)."""
        return self._engine.last_step_traffic

    @property
    def kv_cache_bytes(self) -> int:
        """Rank 0's KV pages held by requests (each rank holds as much for its own heads)."""
        return self._engine.kv_cache_bytes

    def kv_memory(self):
        """Rank 0's KV pool (every rank's pool holds the same pages, each for its own heads)."""
        return self._engine.kv_memory()

    def kv_overflow(self, batch: list[tuple[RequestState, float]]) -> list[str]:
        return self._engine.kv_overflow(batch)

    def set_kv_budget(self, budget_bytes: int) -> None:
        """The same byte budget for every rank's pool (one GPU each)."""
        self._check_usable()
        self._on_all_ranks(("kv", "set_kv_budget", budget_bytes), lambda: self._engine.set_kv_budget(budget_bytes))

    def trim_kv(self) -> int:
        """Every rank gives its pool's memory back when no request holds pages; rank 0's bytes freed."""
        self._check_usable()
        if self._engine.kv_cache.num_pages == 0 or self._engine.kv_cache.held_pages:
            return 0
        return self._on_all_ranks(("kv", "trim_kv"), self._engine.trim_kv)

    @property
    def name(self) -> str:
        return self._engine.name

    @property
    def processes(self) -> tuple[mp.Process, ...]:
        """The child processes of ranks 1..d-1."""
        return tuple(process for process, _ in self._children)

    # --- shutting down --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop ranks 1..d-1 (no process is left behind) and destroy the process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_group and self._failure is None:
            try:
                self._ring_doorbells()
                dist.broadcast_object_list([("shutdown",)], src=0)
            except Exception:  # noqa: BLE001 - a failing rank is stopped below all the same
                pass
        for _, conn in self._children:
            try:
                conn.send("exit")  # for a child still waiting at its doorbell
            except OSError:
                pass
        for process, conn in self._children:
            process.join(_JOIN_S)
            if process.is_alive():
                process.terminate()
                process.join(_JOIN_S)
            if process.is_alive():
                process.kill()
                process.join()
            conn.close()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False
        self._store = None

    def __enter__(self) -> TensorParallelEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
