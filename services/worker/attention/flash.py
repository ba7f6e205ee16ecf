"""``flash``: flash-attn's ``flash_attn_varlen_func`` (CUDA, fp16/bf16, flash-attn installed).

Fresh keys are delimited by ``cu_seqlens_k``; pool keys are read through a block table, one row of
consecutive page ids per request (pages of 256 slots, as its paged kernel requires).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from services.worker.attention.base import Arrays, AttentionImpl, DeviceArrays
from services.worker.attention.layout import KeyLayout

FLASH_PAGE_SIZE = 256  # flash-attn 2's paged kernel needs pages of a multiple of 256 slots


@cache
def flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def flash_attention_2_runs(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a FlashAttention-2 kernel (flash-attn's, or PyTorch's varlen op) runs on ``device``."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and torch.cuda.get_device_capability(device)[0] >= 8)


class FlashAttention(AttentionImpl):
    offsets: DeviceArrays  # name -> int32 device view (bind): cu_q, cu_k and (POOL) block_table

    @classmethod
    def runs(cls, device: torch.device, dtype: torch.dtype, head_dim: int, gqa: bool = False) -> bool:
        return flash_attn_importable() and flash_attention_2_runs(device, dtype, head_dim)

    def host_arrays(self) -> Arrays:
        cu_q, ranges = self.layout.cu_q(), self.layout.key_ranges()
        cu_k = np.concatenate(([0], np.cumsum([n for _, n in ranges]))).astype(np.int64)
        if self.layout.keys is KeyLayout.FRESH:
            return {"cu_q": cu_q, "cu_k": cu_k}
        page = self.cache.page_size
        width = max(-(-self.max_k // page), 1)
        table = np.zeros((len(ranges), width), dtype=np.int64)
        for row, (start, n) in enumerate(ranges):  # one row of consecutive page ids per request
            first = start // page
            table[row, : -(-n // page)] = np.arange(first, first + -(-n // page))
        return {"cu_q": cu_q, "cu_k": cu_k, "block_table": table}

    def bind(self, arrays: DeviceArrays, device: torch.device) -> None:
        self.offsets = {name: a.to(torch.int32) for name, a in arrays.items()}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        offsets = self.offsets
        if self.layout.keys is KeyLayout.FRESH:
            return flash_attn_varlen_func(q, k, v, offsets["cu_q"], offsets["cu_k"], self.max_q, self.max_k,
                                          causal=False)
        keys, values = self.cache.layer_pages(layer)
        return flash_attn_varlen_func(q, keys, values, offsets["cu_q"], offsets["cu_k"], self.max_q, self.max_k,
                                      causal=False, block_table=offsets["block_table"])
