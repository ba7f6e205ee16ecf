"""Which attention backend a worker runs: the names, the registry of implementations, and the choice.

``auto`` takes the first backend that runs here: flash-attn, PyTorch's varlen op, flex_attention on
CUDA, SDPA. On CUDA a kernel is taken only where it computes what SDPA computes, called as the engine
calls it (``kernel_self_test``): a torch whose op lacks what the engine passes, or routes it to a
backend that refuses it, falls through to the next instead of failing the first step.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from functools import cache

import torch

from services.worker.attention import flash, varlen
from services.worker.attention.base import AttentionImpl
from services.worker.attention.flex import FlexAttention
from services.worker.attention.layout import KeyLayout, StepLayout
from services.worker.attention.sdpa import SdpaAttention
from services.worker.kv.pages import KVPages
from services.worker.kv.pool import KVPool

logger = logging.getLogger(__name__)


class AttentionBackend(StrEnum):
    FLASH = "flash"  # flash-attn's varlen kernel (CUDA, fp16/bf16)
    TORCH_VARLEN = "torch_varlen"  # PyTorch's FlashAttention-2 varlen op (CUDA, fp16/bf16)
    FLEX = "flex"  # flex_attention with a block mask over the pool (compiled on CUDA; eager elsewhere)
    SDPA = "sdpa"  # one scaled_dot_product_attention call over a padded batch


# backend -> the class that attends with it (one file each)
BACKEND_IMPLS: dict[AttentionBackend, type[AttentionImpl]] = {
    AttentionBackend.FLASH: flash.FlashAttention,
    AttentionBackend.TORCH_VARLEN: varlen.TorchVarlenAttention,
    AttentionBackend.FLEX: FlexAttention,
    AttentionBackend.SDPA: SdpaAttention,
}


def backend_runs(backend: AttentionBackend, device: torch.device, dtype: torch.dtype, head_dim: int,
                 gqa: bool = False) -> bool:
    return BACKEND_IMPLS[backend].runs(device, dtype, head_dim, gqa)


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                    gqa: bool = False) -> AttentionBackend:
    """``auto``: flash-attn where it runs (CUDA, fp16/bf16, installed), else PyTorch's varlen op, else
    flex_attention on CUDA, else SDPA; on CUDA each kernel must also pass ``kernel_self_test`` (a
    torch whose op lacks what the engine calls, or routes it to a backend that refuses it, falls
    through to the next instead of failing the first step)."""
    if requested == "auto":
        order = [AttentionBackend.FLASH, AttentionBackend.TORCH_VARLEN]
        if device.type == "cuda":
            order.append(AttentionBackend.FLEX)
        order.append(AttentionBackend.SDPA)
        return next(b for b in order if backend_runs(b, device, dtype, head_dim, gqa)
                    and (device.type != "cuda" or kernel_self_test(b, device, dtype, head_dim, gqa)))
    backend = AttentionBackend(requested)
    if not backend_runs(backend, device, dtype, head_dim, gqa):
        raise ValueError(f"attention {backend.value} cannot run here (device {device}, dtype {dtype}, "
                         f"head_dim {head_dim}, grouped-query {gqa}, flash-attn installed: "
                         f"{flash.flash_attn_importable()}, torch varlen op: {varlen.torch_varlen_attn() is not None} "
                         f"{sorted(varlen.varlen_features())})")
    return backend


@cache
def kernel_self_test(backend: AttentionBackend, device: torch.device, dtype: torch.dtype, head_dim: int,
                     gqa: bool = False) -> bool:
    """Whether ``backend`` computes what SDPA computes here, called as the engine calls it: fresh rows
    of three requests, then keys read in place from a pool with other slots between them. False when
    it raises (logged) or differs beyond the dtype's rounding."""
    heads, kv_heads = 4, 2 if gqa else 4
    lengths = (3, 17, 40)
    generator = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    page = flash.FLASH_PAGE_SIZE if backend is AttentionBackend.FLASH else 16
    cache = KVPool(1, kv_heads, head_dim, dtype, device, page_size=page)
    pages = KVPages(page, cache.bytes_per_token)
    extents = []
    for i, n in enumerate((50, 30, 60)):
        extents.append(pages.reserve(f"r{i}", n))
        pages.reserve(f"gap{i}", 20)  # other slots between the requests' extents
    cache.apply(pages.take_changes())
    cache.pool.copy_(randn(*cache.pool.shape))
    q, k, v = randn(sum(lengths), heads, head_dim), randn(sum(lengths), kv_heads, head_dim), randn(
        sum(lengths), kv_heads, head_dim)
    layouts = [StepLayout(lengths, KeyLayout.FRESH),
               StepLayout(lengths, KeyLayout.POOL, tuple(e.first_slot(page) for e in extents),
                          tuple(e.num_tokens for e in extents))]
    tolerance = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    try:
        for layout in layouts:
            outputs = []
            for kind in (backend, AttentionBackend.SDPA):
                impl = BACKEND_IMPLS[kind](layout, cache)
                impl.bind({name: torch.from_numpy(a).to(device) for name, a in impl.host_arrays().items()}, device)
                outputs.append(impl(0, q, k, v).float())
            if not torch.allclose(outputs[0], outputs[1], atol=tolerance, rtol=tolerance):
                logger.warning("attention %s differs from SDPA here (%s): not used", backend.value, layout.keys.value)
                return False
    except Exception as exc:  # noqa: BLE001 (any failure means: do not use this kernel here)
        logger.warning("attention %s fails here (%s: %s): not used", backend.value, type(exc).__name__, exc)
        return False
    return True
