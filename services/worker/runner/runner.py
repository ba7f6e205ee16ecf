"""The model runner: owns the device side of a step (as SGLang's ``ModelRunner`` / ``ForwardBatch`` and
vLLM's GPU model runner do), apart from the engine's request bookkeeping.

The engine describes a step as a :class:`ForwardBatch` (host arrays: token ids, positions, where
every fresh key goes in the KV pool and where each request's keys are, which rows need logits, which
block positions are still masked and each request's threshold). The runner:

1. packs every index array into one int64 host buffer and copies it to a persistent device buffer in
   **one** host-to-device transfer (pinned memory on CUDA); nothing in the step turns a Python list
   into a device tensor per request, and attention metadata is built once per step, not per layer;
2. runs **one** forward for the whole batch, recompute and cache requests together, with one
   attention call per layer (``services/worker/attention/step.py``);
3. applies the commit rule on the device for the whole batch (``services/worker/decoding/rule.py``), with
   sampled requests' draws and top-logprob candidates computed there too;
4. brings back **one** small float64 tensor (each block row's probability, token and commit flag;
   tokens of the lookahead rows; top candidates where asked): one device-to-host transfer.

Both transfers go through ``_to_device`` / ``_to_host``, which count them (``transfers``,
``last_step_transfers``).

CUDA graphs (``cuda_graphs``): a step whose requests are all dual-cache steps over windows of one
length, on a varlen kernel, is padded up to a batch-size bucket (padding requests first, with no keys,
writing into a scratch page) and replayed from a graph captured for that bucket; its inputs are
static buffers the step's one host-to-device copy fills in place. Everything else runs eagerly. The
KV pool must not move while graphs hold its address: the runner drops its graphs when the pool is
reallocated (it grows, or is trimmed), and the engine preallocates the pool to its budget on CUDA.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from services.worker.attention.layout import KeyLayout, StepLayout
from services.worker.attention.select import AttentionBackend
from services.worker.attention.step import StepAttention
from services.worker.decoding.rule import commit_mask, greedy_candidates
from services.worker.decoding.sampling import SamplingParams, sample, top_candidates
from services.worker.kv.cache import PagedKVCache
from services.worker.model.dlm import DLMForMaskedDiffusion

logger = logging.getLogger(__name__)

GRAPH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # batch sizes captured (a batch pads up to the next)
_PAD_KEY = "<graph-padding>"  # the transient extent padding rows write into


@dataclass(frozen=True)
class SampledRows:
    """Block rows ``[start, end)`` of a request that draws its tokens (temperature > 0)."""

    start: int
    end: int
    params: SamplingParams
    seed: int


@dataclass(frozen=True)
class TopRows:
    """Block rows ``[start, end)`` of a request that wants its ``k`` likeliest tokens (logprobs)."""

    start: int
    end: int
    k: int


@dataclass
class ForwardBatch:
    """One step's forward, host side (built by the engine, run by :class:`ModelRunner`)."""

    ids: np.ndarray  # [T] fresh token ids, every request's one after another
    positions: np.ndarray  # [T] their absolute positions
    layout: StepLayout  # each request's rows and where its keys are
    logit_rows: np.ndarray  # [R] rows that get logits: every request's block rows, then lookahead rows
    num_block_rows: int  # the first Rb of them are block rows (the commit rule's)
    eligible: np.ndarray  # [Rb] the position is still masked
    thresholds: np.ndarray  # [Rb] float64, each row's request's threshold
    grid: np.ndarray  # [B, L] each request's block rows in position order (Rb: none)
    max_position: int
    write_slots: np.ndarray | None = None  # [W] slots the fresh keys/values go to (None: none stored)
    write_rows: np.ndarray | None = None  # [W] which rows (None: every row, in order)
    sampled: list[SampledRows] = field(default_factory=list)
    top: list[TopRows] = field(default_factory=list)
    # a CUDA graph may run it: every request a dual-cache step of ``graph_window`` rows, block rows first
    graph_window: int = 0
    block_length: int = 0  # block rows per request, when graph_window is set
    inclusive: bool = False  # a probability equal to the threshold passes (Dream's rule)


@dataclass
class StepOutput:
    """What the step brings back (host lists)."""

    confidence: list[float]  # [Rb] the candidate's probability at each block row
    tokens: list[int]  # [R] the candidate at each logit row (block rows, then lookahead rows)
    commit: list[bool]  # [Rb]
    top: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)  # block row -> its candidates


class ModelRunner:
    """Runs packed forwards of one model on its device, with the KV pool it owns."""

    def __init__(self, model: DLMForMaskedDiffusion, attention: AttentionBackend, kv_cache: PagedKVCache,
                 cuda_graphs: bool = False, graph_buckets: tuple[int, ...] = GRAPH_BUCKETS) -> None:
        self.model, self.attention, self.kv_cache = model, attention, kv_cache
        self.device = model.device
        self.mask_id = model.config.mask_token_id
        self.graphs_enabled = cuda_graphs and _graphs_possible(model, attention)
        self.graph_buckets = tuple(sorted(graph_buckets))
        self._graphs: dict[tuple[int, int, int], _CapturedStep] = {}  # (bucket, window, block) -> its graph
        self._graph_pool = None  # the graphs' shared memory pool
        self._pool_ptr = None  # the KV pool's address when the graphs were captured
        self._staging = torch.empty(0, dtype=torch.int64, device=self.device)
        self._host = torch.empty(0, dtype=torch.int64)
        self._results = torch.empty(0, dtype=torch.float64)
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None  # the results are on the host
        self.transfers = 0  # host<->device copies the runner made, every step
        self.last_step_transfers = 0
        self.last_step_graph = False  # whether the last step replayed a CUDA graph
        self.num_graph_steps = 0

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
        self.last_step_transfers = 0
        self.last_step_graph = False
        graph = self._graph_for(batch)
        if graph is not None:
            logits, device_arrays = graph.run(self, batch)
            self.last_step_graph = True
            self.num_graph_steps += 1
        else:
            logits, device_arrays = self._eager(batch)
        return self._commit(batch, logits, device_arrays)

    def _eager(self, batch: ForwardBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        attention = StepAttention(self.attention, batch.layout, self.kv_cache)
        arrays = _step_arrays(batch) | {f"attn.{k}": v for k, v in attention.host_arrays().items()}
        device_arrays = _unpack(self._to_device(_pack(arrays)), arrays)
        attention.bind({k[5:]: v for k, v in device_arrays.items() if k.startswith("attn.")}, self.device)
        attention.store = self._store(device_arrays)
        logits = self.model.forward_packed(device_arrays["ids"], device_arrays["positions"], attention,
                                           device_arrays["logit_rows"], max_position=batch.max_position)
        return logits, device_arrays

    def _store(self, arrays: dict[str, torch.Tensor]):
        """Where the fresh keys and values go (None: nowhere)."""
        if "write_slots" not in arrays:
            return None
        cache, slots, rows = self.kv_cache, arrays["write_slots"], arrays.get("write_rows")

        def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            if rows is not None:
                k, v = k.index_select(0, rows), v.index_select(0, rows)
            cache.write(layer, k, v, slots)

        return store

    def _commit(self, batch: ForwardBatch, logits: torch.Tensor, arrays: dict[str, torch.Tensor]) -> StepOutput:
        """Candidates and the commit rule on the device; one read-back."""
        rb = batch.num_block_rows
        confidence, tokens = greedy_candidates(logits, self.mask_id)
        block_logits = logits[:rb]
        for s in batch.sampled:  # requests that draw: their rows' candidates replaced by the draws
            rows = block_logits[s.start : s.end].double()
            rows[:, self.mask_id] = float("-inf")
            drawn_conf, drawn = sample(rows, s.params, s.seed)
            confidence[s.start : s.end] = drawn_conf
            tokens[s.start : s.end] = drawn
        eligible = arrays["eligible"].bool()
        thresholds = arrays["thresholds"].view(torch.float64)
        commit = commit_mask(confidence[:rb], eligible, thresholds, arrays["grid"], batch.inclusive)
        parts = [confidence[:rb], tokens.double(), commit.double()]
        k = max((t.k for t in batch.top), default=0)
        if k:
            masked = block_logits.index_select(0, arrays["top_rows"]).double()
            masked[:, self.mask_id] = float("-inf")
            ids, probs = top_candidates(masked, k)
            parts += [ids.double().reshape(-1), probs.double().reshape(-1)]
        packet = self._to_host(torch.cat(parts))
        r = len(batch.logit_rows)
        out = StepOutput(packet[:rb].tolist(), packet[rb : rb + r].astype(np.int64).tolist(),
                         (packet[rb + r : rb + r + rb] > 0.5).tolist())
        if k:
            top_rows = [row for t in batch.top for row in range(t.start, t.end)]
            width = len(top_rows) * k
            ids = packet[2 * rb + r : 2 * rb + r + width].astype(np.int64).reshape(len(top_rows), k)
            probs = packet[2 * rb + r + width : 2 * rb + r + 2 * width].reshape(len(top_rows), k)
            keep = {row: t.k for t in batch.top for row in range(t.start, t.end)}
            out.top = {row: (ids[i, : keep[row]].tolist(), probs[i, : keep[row]].tolist())
                       for i, row in enumerate(top_rows)}
        return out

    # --- CUDA graphs ----------------------------------------------------------------------------

    def _graph_for(self, batch: ForwardBatch) -> _CapturedStep | None:
        if not self.graphs_enabled or not batch.graph_window or batch.layout.keys is not KeyLayout.POOL:
            return None
        n = batch.layout.num_requests
        bucket = next((b for b in self.graph_buckets if b >= n), None)
        if bucket is None or len(batch.logit_rows) != n * batch.block_length:
            return None
        if self._pool_ptr != self.kv_cache.pool.data_ptr():  # the pool moved: every graph reads the old one
            self._graphs.clear()
            self._pool_ptr = self.kv_cache.pool.data_ptr()
        key = (bucket, batch.graph_window, batch.block_length)
        if key not in self._graphs:
            self._graphs[key] = _CapturedStep.capture(self, *key)
        return self._graphs[key]

    def prepare(self) -> None:
        """Before the engine places a step's requests in the pool: where graphs may run, the scratch
        extent their padding rows write into (reserved now, so that it never moves a placed request)."""
        if self.graphs_enabled and _PAD_KEY not in self.kv_cache:
            self.kv_cache.reserve_transient(_PAD_KEY, self.model.config.max_sequence_length)

    def capture(self, window: int, block_length: int, max_batch: int) -> int:
        """Capture the graphs of every bucket up to ``max_batch`` for steps of ``window`` rows now (what
        warm-up does); the number captured (0 where graphs are off)."""
        if not self.graphs_enabled:
            return 0
        self.prepare()
        self._pool_ptr = self.kv_cache.pool.data_ptr()
        for bucket in (b for b in self.graph_buckets if b <= max(max_batch, 1)):
            key = (bucket, window, block_length)
            if key not in self._graphs:
                self._graphs[key] = _CapturedStep.capture(self, *key)
        return len(self._graphs)

    def drop_graphs(self) -> None:
        self._graphs.clear()


def _graphs_possible(model: DLMForMaskedDiffusion, attention: AttentionBackend) -> bool:
    """Graphs need CUDA, a varlen kernel (its metadata has a fixed size per batch) and a whole model on
    one device (a tensor-parallel shard all-reduces between layers)."""
    return (model.device.type == "cuda" and model.tp_degree == 1
            and attention in (AttentionBackend.FLASH, AttentionBackend.TORCH_VARLEN))


# --- packing the step's arrays ------------------------------------------------------------------


def _step_arrays(batch: ForwardBatch) -> dict[str, np.ndarray]:
    """The forward's inputs and the commit rule's, as the step's one copy carries them."""
    arrays = {"ids": batch.ids, "positions": batch.positions, "logit_rows": batch.logit_rows}
    if batch.write_slots is not None:
        arrays["write_slots"] = batch.write_slots
        if batch.write_rows is not None:
            arrays["write_rows"] = batch.write_rows
    return arrays | _commit_arrays(batch)


def _commit_arrays(batch: ForwardBatch) -> dict[str, np.ndarray]:
    """What the commit rule reads on the device (thresholds as the bits of their float64)."""
    arrays = {"eligible": batch.eligible.astype(np.int64),
              "thresholds": batch.thresholds.astype(np.float64).view(np.int64), "grid": batch.grid}
    if batch.top:
        arrays["top_rows"] = np.concatenate([np.arange(t.start, t.end) for t in batch.top])
    return arrays


def _pack(arrays: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays.values()]) if arrays else \
        np.zeros(0, dtype=np.int64)


def _unpack(flat: torch.Tensor, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Views of ``flat`` shaped as ``arrays`` (the order ``_pack`` used)."""
    out, offset = {}, 0
    for name, a in arrays.items():
        n = int(np.asarray(a).size)
        out[name] = flat[offset : offset + n].view(np.asarray(a).shape)
        offset += n
    return out


# --- one captured step ----------------------------------------------------------------------------


class _CapturedStep:
    """A dual-cache step of ``bucket`` requests x ``window`` rows (``block`` of them block rows), captured.

    Its inputs are views of one static int64 buffer (ids, positions, write slots, the attention
    metadata), filled by the step's single host-to-device copy; its output is a static logits buffer.
    Padding requests come first (no keys; their rows write into a scratch extent), the step's
    requests after them in pool order.
    """

    def __init__(self, bucket: int, window: int, block: int) -> None:
        self.bucket, self.window, self.block = bucket, window, block
        self.graph = None
        self.forward = None  # off CUDA: the static-buffer forward, run without a graph
        self.static: torch.Tensor | None = None
        self.names: dict[str, np.ndarray] = {}  # name -> a host array of its shape (the packing template)
        self.logits: torch.Tensor | None = None
        self.attention: StepAttention | None = None
        self.bytes_per_replay = 0  # KV bytes a replay stores (the pool's counter does not see a replay)

    @classmethod
    def capture(cls, runner: ModelRunner, bucket: int, window: int, block: int) -> _CapturedStep:
        step = cls(bucket, window, block)
        cache = runner.kv_cache
        pad = cache.extent(_PAD_KEY)  # reserved by prepare()
        max_keys = runner.model.config.max_sequence_length
        runner.model.rope.reserve(runner.device, max_keys)
        template = step._host_arrays(runner, _dummy_batch(bucket, window, block, pad.first_slot(cache.page_size)),
                                     max_keys)
        step.names = template
        step.static = torch.zeros(sum(int(a.size) for a in template.values()), dtype=torch.int64,
                                  device=runner.device)
        views = _unpack(step.static, template)
        step.static.copy_(torch.from_numpy(_pack(template)).to(runner.device))
        layout = StepLayout((window,) * bucket, KeyLayout.POOL, (0,) * bucket, (0,) * bucket, num_pad=bucket)
        step.attention = StepAttention(runner.attention, layout, cache, max_keys=max_keys)
        step.attention.host_arrays()  # settles the kernel's bounds (max_k) the graph bakes in
        step.attention.bind({k[5:]: v for k, v in views.items() if k.startswith("attn.")}, runner.device)
        step.attention.store = runner._store(views)

        def forward() -> torch.Tensor:
            step.attention.refresh()  # the int32 offsets from this step's static inputs
            return runner.model.forward_packed(views["ids"], views["positions"], step.attention, views["logit_rows"],
                                               max_position=max_keys - 1)

        if runner.device.type != "cuda":  # static buffers without a graph: the same path, run eagerly (tests)
            step.forward = forward
            return step
        stream = torch.cuda.Stream(runner.device)
        stream.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up runs outside the graph (kernel selection, workspaces)
                forward()
        torch.cuda.current_stream(runner.device).wait_stream(stream)
        if runner._graph_pool is None:
            runner._graph_pool = torch.cuda.graph_pool_handle()
        step.graph = torch.cuda.CUDAGraph()
        written = cache.bytes_written
        with torch.cuda.graph(step.graph, pool=runner._graph_pool):
            step.logits = forward()
        step.bytes_per_replay = cache.bytes_written - written
        cache.bytes_written = written  # capturing stores nothing
        logger.info("captured a CUDA graph: batch %d, window %d", bucket, window)
        return step

    def _host_arrays(self, runner: ModelRunner, batch: ForwardBatch, max_keys: int) -> dict[str, np.ndarray]:
        attention = StepAttention(runner.attention, batch.layout, runner.kv_cache, max_keys=max_keys)
        arrays = {"ids": batch.ids, "positions": batch.positions, "logit_rows": batch.logit_rows,
                  "write_slots": batch.write_slots}
        return arrays | {f"attn.{k}": v for k, v in attention.host_arrays().items()}

    def run(self, runner: ModelRunner, batch: ForwardBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Fill the static inputs from ``batch`` (padded to the bucket) with one copy, replay; the logits
        of ``batch``'s own block rows and the device views of its commit inputs."""
        n = batch.layout.num_requests
        pads = self.bucket - n
        cache = runner.kv_cache
        pad_slot = cache.extent(_PAD_KEY).first_slot(cache.page_size)
        padded = _padded(batch, pads, pad_slot)
        inputs = self._host_arrays(runner, padded, runner.model.config.max_sequence_length)
        commit_inputs = _commit_arrays(batch)
        flat = runner._to_device(_pack(inputs | commit_inputs))
        width = self.static.numel()
        self.static.copy_(flat[:width])
        if self.graph is not None:
            self.graph.replay()
            cache.bytes_written += self.bytes_per_replay  # padding rows' stores too: they are written
        else:
            self.logits = self.forward()
        commit_views = _unpack(flat[width:], commit_inputs)
        return self.logits[pads * self.block :], commit_views


def _dummy_batch(bucket: int, window: int, block: int, pad_slot: int) -> ForwardBatch:
    rows = bucket * window
    layout = StepLayout((window,) * bucket, KeyLayout.POOL, (0,) * bucket, (0,) * bucket, num_pad=bucket)
    return ForwardBatch(
        ids=np.zeros(rows, dtype=np.int64), positions=np.zeros(rows, dtype=np.int64), layout=layout,
        logit_rows=np.concatenate([np.arange(i * window, i * window + block) for i in range(bucket)]),
        num_block_rows=bucket * block, eligible=np.zeros(0, dtype=np.int64), thresholds=np.zeros(0),
        grid=np.zeros((0, 0), dtype=np.int64), max_position=0,
        write_slots=np.full(rows, pad_slot, dtype=np.int64) + np.tile(np.arange(window), bucket),
    )


def _padded(batch: ForwardBatch, pads: int, pad_slot: int) -> ForwardBatch:
    """``batch`` with ``pads`` padding requests in front (no keys, rows writing into the scratch extent)."""
    w = batch.graph_window
    layout = batch.layout
    pad_rows = pads * w
    padded_layout = StepLayout((w,) * pads + layout.q_lengths, KeyLayout.POOL, (0,) * pads + layout.k_starts,
                               (0,) * pads + layout.k_lengths, num_pad=pads)
    return ForwardBatch(
        ids=np.concatenate((np.zeros(pad_rows, dtype=np.int64), batch.ids)),
        positions=np.concatenate((np.zeros(pad_rows, dtype=np.int64), batch.positions)),
        layout=padded_layout,
        logit_rows=np.concatenate((np.concatenate([np.arange(i * w, i * w + batch.block_length) for i in range(pads)])
                                   if pads else np.zeros(0, dtype=np.int64), batch.logit_rows + pad_rows)),
        num_block_rows=batch.num_block_rows, eligible=batch.eligible, thresholds=batch.thresholds, grid=batch.grid,
        max_position=batch.max_position,
        write_slots=np.concatenate((pad_slot + np.tile(np.arange(w), pads), batch.write_slots)),
    )
