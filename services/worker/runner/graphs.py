"""CUDA graphs of dual-cache steps (as SGLang's ``CudaGraphRunner``): captured per batch-size bucket,
replayed with one host-to-device copy into static buffers.

A step whose requests are all dual-cache steps over windows of one length, on a varlen kernel, is
padded up to a batch-size bucket (padding requests first, with no keys, writing into the pool's
scratch pages) and replayed from the graph captured for that bucket; its inputs are static buffers
the step's one host-to-device copy fills in place. Everything else runs eagerly. The KV pool must not
move while graphs hold its address: the graphs are dropped when the pool is reallocated (it grows, or
is trimmed), and the engine preallocates the pool to its budget on CUDA.

A graph is built from what it needs (the model, the KV pool, the runner's ``to_device``), never from
the runner's insides.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from services.worker.attention.layout import KeyLayout, StepLayout
from services.worker.attention.select import AttentionBackend
from services.worker.attention.step import StepAttention
from services.worker.kv.pool import KVPool
from services.worker.model.dlm import DLMForMaskedDiffusion
from services.worker.runner.batch import Arrays, ForwardBatch, attention_views, pack, step_arrays, unpack

logger = logging.getLogger(__name__)

GRAPH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # batch sizes captured (a batch pads up to the next)
GRAPH_BACKENDS = (AttentionBackend.FLASH, AttentionBackend.TORCH_VARLEN)  # their metadata: a fixed size per batch

ToDevice = Callable[[np.ndarray], torch.Tensor]  # the runner's one host-to-device copy of an int64 array
GraphKey = tuple[int, int, int]  # (bucket, window, block)


class CudaGraphs:
    """The captured steps of one runner, by (bucket, window, block)."""

    def __init__(self, model: DLMForMaskedDiffusion, pool: KVPool, to_device: ToDevice,
                 buckets: tuple[int, ...] = GRAPH_BUCKETS) -> None:
        self.model, self.pool, self.to_device = model, pool, to_device
        self.buckets = tuple(sorted(buckets))
        self._steps: dict[GraphKey, _CapturedStep] = {}  # (bucket, window, block) -> its captured step
        self._memory = None  # the graphs' shared memory pool (CUDA)
        self._pool_address = None  # the KV pool's address when the graphs were captured

    @property
    def captured(self) -> list[GraphKey]:
        return list(self._steps)

    def clear(self) -> None:
        self._steps.clear()

    def key_for(self, batch: ForwardBatch) -> GraphKey | None:
        """The graph a step may replay: every request a dual-cache step over a window of one length with
        blocks of one length, a bucket that holds them (None: the step runs eagerly)."""
        layout = batch.layout
        if not batch.dual_cache or layout.keys is not KeyLayout.POOL:
            return None
        n, window, block = layout.num_requests, layout.q_lengths[0], batch.block_rows.shape[1]
        if any(q != window for q in layout.q_lengths) or len(batch.logit_rows) != n * block \
                or batch.num_block_rows != n * block:
            return None
        bucket = next((b for b in self.buckets if b >= n), None)
        return None if bucket is None else (bucket, window, block)

    def run(self, batch: ForwardBatch, backend: AttentionBackend):
        """(logits of ``batch``'s rows, device views of its commit inputs) from a replay; None where the
        step has no graph."""
        key = self.key_for(batch)
        if key is None:
            return None
        return self._step(backend, key).run(batch, self.pool, self.to_device)

    def capture(self, backend: AttentionBackend, window: int, block: int, max_batch: int) -> int:
        """Capture the graphs of every bucket up to ``max_batch`` for steps of ``window`` rows now (what
        warm-up does); the number held."""
        for bucket in (b for b in self.buckets if b <= max(max_batch, 1)):
            self._step(backend, (bucket, window, block))
        return len(self._steps)

    def _step(self, backend: AttentionBackend, key: GraphKey) -> _CapturedStep:
        self.pool.reserve_scratch(self.model.config.max_sequence_length)  # where padding rows write
        if self._pool_address != self.pool.pool.data_ptr():  # the pool moved: every graph reads the old one
            self._steps.clear()
            self._pool_address = self.pool.pool.data_ptr()
        step = self._steps.get(key)
        if step is None:
            if self._memory is None and self.pool.pool.device.type == "cuda":
                self._memory = torch.cuda.graph_pool_handle()
            step = self._steps[key] = _CapturedStep.capture(self.model, self.pool, backend, *key, memory=self._memory)
        return step


class _CapturedStep:
    """A dual-cache step of ``bucket`` requests x ``window`` rows (``block`` of them block rows), captured.

    Its inputs are views of one static int64 buffer (ids, positions, write slots, the attention
    metadata), filled by the step's single host-to-device copy; its output is a static logits buffer.
    Padding requests come first (no keys; their rows write into the pool's scratch), the step's
    requests after them in pool order.
    """

    def __init__(self, backend: AttentionBackend, bucket: int, window: int, block: int, max_keys: int) -> None:
        self.backend, self.bucket, self.window, self.block, self.max_keys = backend, bucket, window, block, max_keys
        self.graph = None
        self.forward = None  # off CUDA: the static-buffer forward, run without a graph
        self.static: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None

    @classmethod
    def capture(cls, model: DLMForMaskedDiffusion, pool: KVPool, backend: AttentionBackend, bucket: int,
                window: int, block: int, memory=None) -> _CapturedStep:
        max_keys = model.config.max_sequence_length
        step = cls(backend, bucket, window, block, max_keys)
        device = pool.pool.device
        model.rope.reserve(device, max_keys)
        template = step._arrays(_padding(bucket, window, block, pool.scratch_slot), pool)
        step.static = torch.from_numpy(pack(template)).to(device)
        views = unpack(step.static, template)
        layout = StepLayout((window,) * bucket, KeyLayout.POOL, (0,) * bucket, (0,) * bucket, num_pad=bucket)
        attention = StepAttention(backend, layout, pool, max_keys=max_keys)
        attention.host_arrays()  # settles the kernel's bounds (max_k) the graph bakes in
        attention.bind(attention_views(views), device)
        attention.store = pool.store(views["write_slots"])

        def forward() -> torch.Tensor:
            attention.refresh()  # the int32 offsets from this step's static inputs
            return model.forward_packed(views["ids"], views["positions"], attention, views["logit_rows"],
                                        max_position=max_keys - 1)

        if device.type != "cuda":  # static buffers without a graph: the same path, run eagerly (tests)
            step.forward = forward
            return step
        with pool.uncounted():  # capturing stores nothing a request reads
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up runs outside the graph (kernel selection, workspaces)
                    forward()
            torch.cuda.current_stream(device).wait_stream(stream)
            step.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(step.graph, pool=memory):
                step.logits = forward()
        logger.info("captured a CUDA graph: batch %d, window %d", bucket, window)
        return step

    def _arrays(self, padded: ForwardBatch, pool: KVPool, commit: ForwardBatch | None = None) -> Arrays:
        attention = StepAttention(self.backend, padded.layout, pool, max_keys=self.max_keys)
        return step_arrays(padded, attention.host_arrays(), commit)

    def run(self, batch: ForwardBatch, pool: KVPool, to_device: ToDevice):
        """Fill the static inputs from ``batch`` (padded to the bucket) with one copy, replay; the logits
        of ``batch``'s own block rows and the device views of its commit inputs."""
        pads = self.bucket - batch.num_requests
        arrays = self._arrays(_padded(batch, pads, pool.scratch_slot), pool, commit=batch)
        flat = to_device(pack(arrays))
        width = self.static.numel()
        self.static.copy_(flat[:width])
        if self.graph is not None:
            self.graph.replay()
            pool.count_written(self.bucket * self.window)  # padding rows' stores too: they are written
        else:
            self.logits = self.forward()
        views = unpack(flat, arrays)
        return self.logits[pads * self.block :], views


def _padding(bucket: int, window: int, block: int, scratch_slot: int) -> ForwardBatch:
    """A step of ``bucket`` padding requests only (the capture's template)."""
    rows = bucket * window
    layout = StepLayout((window,) * bucket, KeyLayout.POOL, (0,) * bucket, (0,) * bucket, num_pad=bucket)
    return ForwardBatch(
        ids=np.zeros(rows, dtype=np.int64), positions=np.zeros(rows, dtype=np.int64), layout=layout,
        logit_rows=np.concatenate([np.arange(i * window, i * window + block) for i in range(bucket)]),
        num_block_rows=bucket * block, eligible=np.zeros(0, dtype=bool), thresholds=np.zeros(0),
        block_rows=np.zeros((0, 0), dtype=np.int64), max_position=0,
        write_slots=np.full(rows, scratch_slot, dtype=np.int64) + np.tile(np.arange(window), bucket),
    )


def _padded(batch: ForwardBatch, pads: int, scratch_slot: int) -> ForwardBatch:
    """``batch`` with ``pads`` padding requests in front (no keys, rows writing into the scratch)."""
    w = batch.layout.q_lengths[0]
    block = batch.block_rows.shape[1]
    layout = batch.layout
    pad_rows = pads * w
    padded_layout = StepLayout((w,) * pads + layout.q_lengths, KeyLayout.POOL, (0,) * pads + layout.k_starts,
                               (0,) * pads + layout.k_lengths, num_pad=pads)
    return ForwardBatch(
        ids=np.concatenate((np.zeros(pad_rows, dtype=np.int64), batch.ids)),
        positions=np.concatenate((np.zeros(pad_rows, dtype=np.int64), batch.positions)),
        layout=padded_layout,
        logit_rows=np.concatenate((np.concatenate([np.arange(i * w, i * w + block) for i in range(pads)])
                                   if pads else np.zeros(0, dtype=np.int64), batch.logit_rows + pad_rows)),
        num_block_rows=batch.num_block_rows, eligible=batch.eligible, thresholds=batch.thresholds,
        block_rows=batch.block_rows, max_position=batch.max_position,
        write_slots=np.concatenate((scratch_slot + np.tile(np.arange(w), pads), batch.write_slots)),
    )
