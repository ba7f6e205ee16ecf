"""The model runner: owns the device side of a step (as SGLang's ``ModelRunner`` / ``ForwardBatch`` and
vLLM's GPU model runner do), apart from the engine's request bookkeeping.

The engine describes a step as a :class:`ForwardBatch` (``services/worker/runner/batch.py``); the
runner turns it into one forward and returns one :class:`StepOutput`:

1. applies the KV page table's changes to its pool (grow, compaction), then packs every index array
   into one int64 host buffer and copies it to a persistent device buffer in **one** host-to-device
   transfer (pinned memory on CUDA); nothing in the step turns a Python list into a device tensor per
   request, and attention metadata is built once per step, not per layer;
2. runs **one** forward for the whole batch, recompute and cache requests together, with one
   attention call per layer (``services/worker/attention/step.py``), replayed from a CUDA graph where
   the step has one (``services/worker/runner/graphs.py``);
3. applies the commit rule on the device for the whole batch (``services/worker/runner/sampler.py``,
   ``services/worker/decoding/rule.py``), with sampled requests' draws and top-logprob candidates
   computed there too;
4. brings back **one** small float64 tensor: one device-to-host transfer.

Both transfers go through ``_to_device`` / ``_to_host``, which count them (``transfers``,
``last_step_transfers``).
"""

from __future__ import annotations

import numpy as np
import torch

from services.worker.attention.flash import FLASH_PAGE_SIZE
from services.worker.attention.select import AttentionBackend, resolve_backend
from services.worker.attention.step import StepAttention
from services.worker.kv.pages import PoolChange
from services.worker.kv.pool import KVPool
from services.worker.model.dlm import DLMForMaskedDiffusion
from services.worker.runner.batch import ForwardBatch, StepOutput, attention_views, pack, step_arrays, unpack
from services.worker.runner.graphs import GRAPH_BACKENDS, GRAPH_BUCKETS, CudaGraphs
from services.worker.runner.sampler import read_packet, step_packet


def choose_attention(model: DLMForMaskedDiffusion, attention: str = "auto",
                     kv_page_size: int | None = None) -> tuple[AttentionBackend, int]:
    """The attention backend (``auto``: flash-attn where it runs, else PyTorch's varlen op on CUDA, else
    flex_attention on CUDA, else SDPA) and KV page size (flash-attn needs 256; SDPA defaults to 16) of a
    model's runner; ``ValueError`` for pages flash-attn cannot read."""
    block = model.model.transformer.blocks[0]  # a tensor-parallel shard holds only its own heads
    backend = resolve_backend(attention, model.device, model.dtype, block.head_dim,
                              gqa=block.n_kv_heads != block.n_heads)
    page_size = kv_page_size or (FLASH_PAGE_SIZE if backend is AttentionBackend.FLASH else 16)
    if backend is AttentionBackend.FLASH and page_size % FLASH_PAGE_SIZE:
        raise ValueError(f"flash-attn needs KV pages of a multiple of {FLASH_PAGE_SIZE} slots, got {page_size}")
    return backend, page_size


class ModelRunner:
    """Runs packed forwards of one model on its device, with the KV pool it owns."""

    def __init__(self, model: DLMForMaskedDiffusion, attention: AttentionBackend, page_size: int,
                 cuda_graphs: bool = False, graph_buckets: tuple[int, ...] = GRAPH_BUCKETS) -> None:
        """``cuda_graphs``: replay dual-cache steps from CUDA graphs where they can run (CUDA, a varlen
        kernel, a whole model)."""
        self.model = model
        self.device = model.device
        self.mask_id = model.config.mask_token_id
        self._attention = attention
        self.graphs_enabled = cuda_graphs and _graphs_possible(model, attention)
        block = model.model.transformer.blocks[0]
        scratch = model.config.max_sequence_length if self.graphs_enabled else 0  # graphs' padding rows
        self.kv_pool = KVPool(len(model.model.transformer.blocks), block.n_kv_heads, block.head_dim, model.dtype,
                              model.device, page_size, scratch_tokens=scratch)
        self.graphs = CudaGraphs(model, self.kv_pool, self._to_device, graph_buckets)
        self._staging = torch.empty(0, dtype=torch.int64, device=self.device)
        self._host = torch.empty(0, dtype=torch.int64)
        self._results = torch.empty(0, dtype=torch.float64)
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None  # the results are on the host
        self.transfers = 0  # host<->device copies the runner made, every step
        self.last_step_transfers = 0
        self.last_step_graph = False  # whether the last step replayed a CUDA graph
        self.num_graph_steps = 0

    @property
    def attention(self) -> AttentionBackend:
        """The attention backend every step runs on."""
        return self._attention

    @attention.setter
    def attention(self, backend: AttentionBackend) -> None:
        """Another backend from the next step on (graphs only where it is a varlen kernel)."""
        self._attention = backend
        self.graphs_enabled = self.graphs_enabled and backend in GRAPH_BACKENDS
        self.graphs.clear()

    # --- the seam every transfer goes through ---------------------------------------------------

    def _to_device(self, host: np.ndarray) -> torch.Tensor:
        """One host-to-device copy of ``host`` (int64) into the persistent staging buffer."""
        self.transfers += 1
        self.last_step_transfers += 1
        n = host.size
        if self.device.type != "cuda":
            return torch.from_numpy(host)
        if self._host.numel() < n:
            self._host = torch.empty(max(n, 2 * self._host.numel()), dtype=torch.int64, pin_memory=True)
        if self._staging.numel() < n:
            self._staging = torch.empty(max(n, 2 * self._staging.numel()), dtype=torch.int64, device=self.device)
        self._host[:n].numpy()[:] = host
        self._staging[:n].copy_(self._host[:n], non_blocking=True)
        return self._staging[:n]

    def _to_host(self, packet: torch.Tensor) -> np.ndarray:
        """One device-to-host copy of the step's results (float64), waited for."""
        self.transfers += 1
        self.last_step_transfers += 1
        if packet.device.type != "cuda":
            return packet.numpy()
        n = packet.numel()
        if self._results.numel() < n:  # pinned once, reused (pinning memory every step would cost more)
            self._results = torch.empty(max(n, 2 * self._results.numel()), dtype=torch.float64, pin_memory=True)
        self._results[:n].copy_(packet, non_blocking=True)
        self._copied.record()
        self._copied.synchronize()
        return self._results[:n].numpy().copy()

    # --- a step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> StepOutput:
        self.kv_pool.apply(batch.pool_changes)
        self.last_step_transfers = 0
        replayed = self.graphs.run(batch, self._attention) if self.graphs_enabled else None
        self.last_step_graph = replayed is not None
        if replayed is not None:
            logits, arrays = replayed
            self.num_graph_steps += 1
        else:
            logits, arrays = self._eager(batch)
        return read_packet(self._to_host(step_packet(logits, batch, arrays, self.mask_id)), batch)

    def _eager(self, batch: ForwardBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        attention = StepAttention(self._attention, batch.layout, self.kv_pool)
        arrays = step_arrays(batch, attention.host_arrays(), batch)
        views = unpack(self._to_device(pack(arrays)), arrays)
        attention.bind(attention_views(views), self.device)
        if "write_slots" in views:
            attention.store = self.kv_pool.store(views["write_slots"], views.get("write_rows"))
        logits = self.model.forward_packed(views["ids"], views["positions"], attention, views["logit_rows"],
                                           max_position=batch.max_position)
        return logits, views

    def change_pool(self, changes: tuple[PoolChange, ...]) -> None:
        """Apply the KV page table's changes outside a step (a trim, a preallocated budget)."""
        self.kv_pool.apply(changes)

    def capture(self, window: int, block_length: int, max_batch: int) -> int:
        """Capture the graphs of every bucket up to ``max_batch`` for steps of ``window`` rows now (what
        warm-up does); the number held (0 where graphs are off)."""
        if not self.graphs_enabled:
            return 0
        return self.graphs.capture(self._attention, window, block_length, max_batch)

    def close(self) -> None:
        """Nothing beyond memory to give back here (a tensor-parallel runner stops its ranks)."""


def _graphs_possible(model: DLMForMaskedDiffusion, attention: AttentionBackend) -> bool:
    """Graphs need CUDA, a varlen kernel (its metadata has a fixed size per batch) and a whole model on
    one device (a tensor-parallel shard all-reduces between layers)."""
    return model.device.type == "cuda" and model.tp_degree == 1 and attention in GRAPH_BACKENDS
