"""Tensor parallelism: one model instance spread over ``d`` processes, below the planner (as nano-vllm
and vLLM do it).

Sharding: ``services/worker/model/parallel.py``. Processes: ``services/worker/parallel/ranks.py``.

Rank 0's engine (:class:`TensorParallelEngine`) is an ordinary :class:`DLMEngine`: it plans every step
and owns the KV page table, so every request's state stays on rank 0. Only its runner differs
(:class:`ParallelRunner`): each forward's ``ForwardBatch`` (with the page table's changes for the
pool) goes to ranks 1..d-1, which run it on their shards while rank 0 runs it on its own; a pool
change outside a step (a trim) goes the same way. The ranks' all-reduces keep them in step, and every
rank computes the same logits, so rank 0's commits are every rank's.

``d = 1`` needs none of this: ``make_engine`` (``services/worker/parallel/build.py``) returns a plain
:class:`DLMEngine` then.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.worker.attention.select import AttentionBackend
from services.worker.engine.engine import DLMEngine, loaded_options
from services.worker.engine.request import RequestState, StepResult
from services.worker.kv.pages import PoolChange
from services.worker.model.dlm import DLMForMaskedDiffusion
from services.worker.model.parallel import ShardingError
from services.worker.parallel.ranks import (
    RankGroup,
    RankSpec,
    TensorParallelError,
    forward_logits,
    load_shard,
    step_summary,
)
from services.worker.runner.batch import ForwardBatch, StepOutput
from services.worker.runner.runner import ModelRunner, choose_attention


class ParallelRunner(ModelRunner):
    """Rank 0's runner: every forward and pool change runs on every rank, rank 0's shard here.

    ``verify``: after each forward, check that every rank chose the same tokens and commits (one extra
    collective per step; for tests and debugging)."""

    def __init__(self, model: DLMForMaskedDiffusion, attention: AttentionBackend, page_size: int, ranks: RankGroup,
                 verify: bool = False) -> None:
        super().__init__(model, attention, page_size)  # no CUDA graphs: a shard all-reduces between layers
        self.ranks, self.verify = ranks, verify

    def forward(self, batch: ForwardBatch) -> StepOutput:
        return self.ranks.run(("forward", batch, self.verify), lambda: self._forward_here(batch))

    def _forward_here(self, batch: ForwardBatch) -> StepOutput:
        output = ModelRunner.forward(self, batch)
        if self.verify:
            self.ranks.check_same(step_summary(output))
        return output

    def change_pool(self, changes: tuple[PoolChange, ...]) -> None:
        if changes:
            self.ranks.run(("pool", changes), lambda: ModelRunner.change_pool(self, changes))

    def close(self) -> None:
        self.ranks.close()


class TensorParallelEngine(DLMEngine):
    """A :class:`DLMEngine` whose model is split over ``tp`` processes.

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
    context manager). After a rank fails, every call raises :class:`TensorParallelError`. No CUDA
    graphs: a shard all-reduces between layers.
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
        self.tp, self.verify = tp, verify
        spec = RankSpec(str(model_dir), tp, device, dtype, num_threads, timeout_s, trust_remote_code)
        # Loading (and sharding) here first reports a bad directory or degree before any process starts.
        loaded = load_shard(spec, 0)
        attention, page_size = choose_attention(loaded.model)
        self.ranks = RankGroup(dataclasses.replace(spec, attention=attention.value, page_size=page_size),
                               start_timeout_s)
        runner = ParallelRunner(loaded.model, attention, page_size, self.ranks, verify)
        super().__init__(loaded.model, **loaded_options(loaded), stop_at_eos=stop_at_eos, runner=runner)

    @property
    def processes(self) -> tuple[mp.Process, ...]:
        """The child processes of ranks 1..d-1."""
        return self.ranks.processes

    def step(self, batch: list[tuple[RequestState, float]]) -> list[StepResult]:
        self.ranks.check_usable()  # a closed or broken engine says so before it plans anything
        return super().step(batch)

    def forward_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One plain forward of the sharded model over ``input_ids`` [B, Q]; rank 0's logits [B, Q, V] on the CPU."""
        input_ids = input_ids.cpu()
        attention_mask = None if attention_mask is None else attention_mask.cpu()
        command = ("logits", input_ids, attention_mask)
        return self.ranks.run(command, lambda: forward_logits(self.model, input_ids, attention_mask)).cpu()
