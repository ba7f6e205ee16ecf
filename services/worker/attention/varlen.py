"""``torch_varlen``: PyTorch's FlashAttention-2 varlen op (``torch.nn.attention.varlen``; CUDA, fp16/bf16).

Its signature is feature-detected. Where it takes ``seqused_k`` (torch 2.13), request ``i``'s keys
start at ``cu_seq_k[i]`` and ``seqused_k[i]`` are read; where it does not (torch 2.11), keys between
two requests' extents become a sequence of their own with no queries ("gap" sequences), so
``cu_seq_k`` still delimits each request's keys exactly. Both need the step's requests in pool order
(the engine sorts them). Without ``enable_gqa`` (2.11) it takes as many key heads as query heads only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache

import numpy as np
import torch

from services.worker.attention.base import Arrays, AttentionImpl, DeviceArrays
from services.worker.attention.flash import flash_attention_2_runs
from services.worker.attention.layout import KeyLayout


@cache
def torch_varlen_attn() -> Callable | None:
    """PyTorch's ``varlen_attn`` where this torch has one (any signature: see ``varlen_features``)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@cache
def varlen_features() -> frozenset[str]:
    """Which of ``seqused_k`` and ``enable_gqa`` this torch's ``varlen_attn`` takes (2.11: neither)."""
    fn = torch_varlen_attn()
    if fn is None:
        return frozenset()
    return frozenset(inspect.signature(fn).parameters) & {"seqused_k", "enable_gqa"}


class TorchVarlenAttention(AttentionImpl):
    offsets: DeviceArrays  # name -> int32 device view (bind): cu_q, cu_k and (with seqused_k) used_k

    @classmethod
    def runs(cls, device: torch.device, dtype: torch.dtype, head_dim: int, gqa: bool = False) -> bool:
        # the op without enable_gqa runs only where query and key heads are as many
        return (torch_varlen_attn() is not None and (not gqa or "enable_gqa" in varlen_features())
                and flash_attention_2_runs(device, dtype, head_dim))

    def host_arrays(self) -> Arrays:
        cu_q, ranges = self.layout.cu_q(), self.layout.key_ranges()
        starts = [s for s, _ in ranges]
        if starts != sorted(starts):
            raise ValueError("torch_varlen steps need their requests in pool order")
        if "seqused_k" in varlen_features() or self.layout.keys is KeyLayout.FRESH:
            last = ranges[-1][0] + ranges[-1][1] if ranges else 0
            cu_k = np.array([*starts, last], dtype=np.int64)
            return {"cu_q": cu_q, "cu_k": cu_k, "used_k": np.array([n for _, n in ranges], dtype=np.int64)}
        # no seqused_k: every stretch of slots between two requests' keys is a sequence with no queries
        q_bounds, k_bounds = [0], [0]
        for (start, n), q_len in zip(ranges, self.layout.q_lengths, strict=True):
            q_bounds += [q_bounds[-1], q_bounds[-1] + q_len]  # the gap's (no queries), then the request's
            k_bounds += [start, start + n]
        cu_k = np.array(k_bounds, dtype=np.int64)
        # a gap may be the longest sequence; a CUDA graph (max_keys given) bakes in a bound for any step
        gaps = self.cache.num_slots if self.static_bounds else int(np.diff(cu_k).max(initial=1))
        self.max_k = max(self.max_k, gaps)
        return {"cu_q": np.array(q_bounds, dtype=np.int64), "cu_k": cu_k}

    def bind(self, arrays: DeviceArrays, device: torch.device) -> None:
        self.offsets = {name: a.to(torch.int32) for name, a in arrays.items()}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        offsets, options = self.offsets, {}
        if "enable_gqa" in varlen_features():
            options["enable_gqa"] = k.shape[1] != q.shape[1]
        if "used_k" in offsets and self.layout.keys is KeyLayout.POOL:
            options["seqused_k"] = offsets["used_k"]
        return torch_varlen_attn()(q, k, v, offsets["cu_q"], offsets["cu_k"], self.max_q, self.max_k, **options)
