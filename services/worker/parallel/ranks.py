"""The processes of a tensor-parallel instance: ranks 1..d-1, and rank 0's handle on them (:class:`RankGroup`).

Rank 0 lives in the caller's process and plans every step; ranks 1..d-1 are child processes
(``torch.multiprocessing``, spawn) that hold their model shard and their KV pool tensor and run only
the model runner: for every step rank 0 rings a doorbell (a pipe per child, which a child can wait on
for as long as the worker is idle, without tripping the process group's timeout) and then broadcasts
the command with ``broadcast_object_list``: the step's ``ForwardBatch`` (small host arrays, with the KV
page table's changes for the pool), a pool change outside a step (a trim), or the order to stop. Each
rank runs the same forward on its shard (its all-reduces are the collectives that keep the ranks in
step), so every rank's pool holds the same pages, each for its own heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.worker.attention.select import AttentionBackend
from services.worker.model.dlm import DLMForMaskedDiffusion
from services.worker.model.loading import LoadedModel, load_model
from services.worker.model.parallel import shard_model
from services.worker.parallel.placement import rank_device
from services.worker.runner.batch import StepOutput
from services.worker.runner.runner import ModelRunner

_HOST = "127.0.0.1"
_START_POLL_S = 0.1  # how often rank 0 checks on children while they start
_IDLE_POLL_S = 1.0  # how often an idle child checks that rank 0 is still there
_JOIN_S = 10.0  # how long close() waits for a child to leave on its own before terminating it


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or is gone; the engine cannot be used any more."""


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its shard and runner (sent to the children, so plain data)."""

    model_dir: str
    degree: int
    device: str
    dtype: torch.dtype | None
    num_threads: int | None
    timeout_s: float
    trust_remote_code: bool = False  # tokenizer code the checkpoint ships may run (DLS_TRUST_REMOTE_CODE)
    attention: str = "auto"  # rank 0's backend, once chosen: every rank's pool is laid out alike
    page_size: int | None = None  # rank 0's KV page size, once chosen

    @property
    def backend(self) -> str:
        return "nccl" if torch.device(self.device).type == "cuda" else "gloo"

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    def rank_device(self, rank: int) -> torch.device:
        return rank_device(self.device, rank)


def load_shard(spec: RankSpec, rank: int) -> LoadedModel:
    """The model with only rank ``rank``'s shard of every block, on the rank's device."""
    # slice on the CPU, then move
    loaded = load_model(spec.model_dir, device="cpu", dtype=spec.dtype, trust_remote_code=spec.trust_remote_code)
    shard_model(loaded.model, rank, spec.degree)
    loaded.model.to(spec.rank_device(rank))
    return loaded


def step_summary(output: StepOutput) -> tuple[list[int], list[bool]]:
    """What must be identical on every rank after a forward: the candidates and what the rule commits."""
    return output.tokens, output.commit


@torch.no_grad()
def forward_logits(model: DLMForMaskedDiffusion, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """The model's plain (padded-batch) forward: its logits."""
    mask = None if attention_mask is None else attention_mask.to(model.device)
    return model(input_ids.to(model.device), attention_mask=mask).logits


def _init_group(spec: RankSpec, rank: int, store: dist.Store) -> None:
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.rank_device(rank))
    dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.degree, timeout=spec.timeout)


# --- ranks 1..d-1 ---------------------------------------------------------------------------------


def _rank_main(rank: int, spec: RankSpec, port: int, conn: Connection) -> None:
    """Entry point of ranks 1..d-1: start, then follow rank 0's commands until told to stop."""
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    try:
        conn.send(("hello",))
        store = dist.TCPStore(_HOST, port, spec.degree, is_master=False, timeout=spec.timeout)
        _init_group(spec, rank, store)
        runner = ModelRunner(load_shard(spec, rank).model.eval(), AttentionBackend(spec.attention), spec.page_size)
    except Exception as exc:  # noqa: BLE001 - any start-up failure is reported to rank 0
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    conn.send(("ready",))
    try:
        _serve(runner, conn)
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


def _serve(runner: ModelRunner, conn: Connection) -> None:
    while _wait_for_doorbell(conn):
        box = [None]
        dist.broadcast_object_list(box, src=0)
        command, *args = box[0]
        if command == "shutdown":
            return
        if command == "forward":
            batch, verify = args
            output = runner.forward(batch)
            if verify:
                dist.all_gather_object([None] * dist.get_world_size(), step_summary(output))
        elif command == "pool":  # the page table's changes outside a step (a trim)
            runner.change_pool(*args)
        elif command == "logits":
            forward_logits(runner.model, *args)
        else:
            raise TensorParallelError(f"unknown command {command!r}")


# --- rank 0's handle on the others ----------------------------------------------------------------


class RankGroup:
    """Rank 0's side: starts ranks 1..d-1 and the process group, runs a command on every rank, stops them.

    A process has at most one default ``torch.distributed`` process group, so at most one group runs
    per process at a time; :meth:`close` releases it. After a rank fails, every command raises
    :class:`TensorParallelError`.
    """

    def __init__(self, spec: RankSpec, start_timeout_s: float) -> None:
        self.spec, self.degree = spec, spec.degree
        self._start_timeout_s = start_timeout_s
        self._children: list[tuple[mp.Process, Connection]] = []  # rank - 1 -> (process, rank 0's pipe end)
        self._failure: str | None = None  # why the group is unusable
        self._closed = False
        self._owns_group = False
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        # Port 0: the OS picks a free port, and the store owns it from then on (no race for it).
        self._store = dist.TCPStore(_HOST, 0, self.degree, is_master=True, wait_for_workers=False,
                                    timeout=self.spec.timeout)
        for rank in range(1, self.degree):
            parent_end, child_end = ctx.Pipe()
            process = ctx.Process(target=_rank_main, args=(rank, self.spec, self._store.port, child_end),
                                  name=f"dls-tp-rank{rank}", daemon=True)
            process.start()
            child_end.close()
            self._children.append((process, parent_end))
        self._await_children("hello")
        _init_group(self.spec, 0, self._store)
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

    @property
    def processes(self) -> tuple[mp.Process, ...]:
        """The child processes of ranks 1..d-1."""
        return tuple(process for process, _ in self._children)

    def run(self, command: tuple, local: Callable):
        """Broadcast ``command`` to ranks 1..d-1, then run rank 0's part (``local``); its result."""
        self.check_usable()
        try:
            self._ring_doorbells()
            dist.broadcast_object_list([command], src=0)
            return local()
        except TensorParallelError as exc:
            self._failure = str(exc)
            raise
        except BaseException as exc:
            # The other ranks may be anywhere in the command now: the group cannot go on.
            self._failure = f"{command[0]} failed on rank 0 ({type(exc).__name__}: {exc}){self._dead_ranks_note()}"
            if isinstance(exc, Exception):
                raise TensorParallelError(self._failure) from exc
            raise  # KeyboardInterrupt and the like pass through as they are

    def check_same(self, summary) -> None:
        """Every rank's ``summary`` of the command just run equals rank 0's (``TensorParallelError`` if not)."""
        summaries = [None] * self.degree
        dist.all_gather_object(summaries, summary)
        for rank, other in enumerate(summaries):
            if other != summaries[0]:
                raise TensorParallelError(f"rank {rank} committed different tokens from rank 0")

    def check_usable(self) -> None:
        if self._closed:
            raise TensorParallelError("the tensor-parallel engine is closed")
        if self._failure is not None:
            raise TensorParallelError(f"the tensor-parallel engine is unusable: {self._failure}; close it")

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
