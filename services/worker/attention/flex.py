"""``flex``: ``flex_attention`` with a block mask over the keys (compiled on CUDA; eager elsewhere, for tests).

A query row of request ``i`` sees the keys of ``i``'s range only (its fresh rows, or its extent of
the pool); the mask is built once per step, for every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np
import torch

from services.worker.attention.base import Arrays, AttentionImpl, DeviceArrays
from services.worker.attention.layout import KeyLayout


@cache
def flex_attention_fn(compiled: bool) -> Callable | None:
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=True) if compiled else flex_attention


class FlexAttention(AttentionImpl):
    block_mask: object  # the step's BlockMask (bind)

    @classmethod
    def runs(cls, device: torch.device, dtype: torch.dtype, head_dim: int, gqa: bool = False) -> bool:
        return flex_attention_fn(False) is not None

    def host_arrays(self) -> Arrays:
        layout = self.layout
        ranges = np.array(layout.key_ranges(), dtype=np.int64).reshape(-1, 2)
        doc = np.repeat(np.arange(layout.num_requests), layout.q_lengths)
        return {"doc": doc, "k_lo": ranges[:, 0], "k_hi": ranges[:, 0] + ranges[:, 1]}

    def bind(self, arrays: DeviceArrays, device: torch.device) -> None:
        from torch.nn.attention.flex_attention import create_block_mask

        doc, lo, hi = arrays["doc"], arrays["k_lo"], arrays["k_hi"]

        def same_request(b, h, q_idx, kv_idx):
            d = doc[q_idx]
            return (kv_idx >= lo[d]) & (kv_idx < hi[d])

        num_keys = self.layout.total if self.layout.keys is KeyLayout.FRESH else self.cache.num_slots
        self.block_mask = create_block_mask(same_request, None, None, self.layout.total, num_keys, device=device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        flex = flex_attention_fn(q.device.type == "cuda")
        out = flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                   block_mask=self.block_mask, enable_gqa=k.shape[1] != q.shape[1])
        return out[0].transpose(0, 1)
