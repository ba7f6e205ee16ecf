"""What every attention backend implements (one file each in this room, chosen in ``select.py``).

All backends compute the same thing over a packed step; only the kernel and its metadata differ. One
backend's object serves one step, for every layer (SGLang's ``init_forward_metadata`` once per batch,
then ``forward`` per layer; vLLM's ``AttentionImpl`` beside its metadata builder):

1. on the host, from the step's :class:`StepLayout`: ``host_arrays()`` names the int64 index arrays it
   needs on the device (the model runner copies them with the step's other arrays, in one transfer);
2. ``bind(views, device)`` derives what every layer shares from their device views (once per step,
   inside a captured CUDA graph where there is one: the views are then its static buffers);
3. ``self(layer, q, k, v)`` attends, with the keys where the step's :class:`KeyLayout` says they are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from services.worker.attention.layout import KeyLayout, StepLayout
from services.worker.kv.pool import KVPool

Arrays = dict[str, np.ndarray]  # name -> int64 host array, copied to the device with the step's others
DeviceArrays = dict[str, torch.Tensor]  # name -> its int64 device view


class AttentionImpl(ABC):
    """One backend's attention over one step, for every layer."""

    def __init__(self, layout: StepLayout, cache: KVPool | None, max_keys: int | None = None) -> None:
        """``max_keys``: an upper bound on any request's keys to pass the varlen kernels (a CUDA graph
        bakes it in); default: the step's longest."""
        self.layout, self.cache = layout, cache
        # the varlen kernels' bounds on any request's rows and keys
        self.max_q = max(layout.q_lengths, default=1)
        self.max_k = max_keys or max((n for _, n in layout.key_ranges()), default=1)
        self.static_bounds = max_keys is not None

    @classmethod
    @abstractmethod
    def runs(cls, device: torch.device, dtype: torch.dtype, head_dim: int, gqa: bool = False) -> bool:
        """Whether this backend's kernel runs here (installed, and made for this device and dtype)."""

    @abstractmethod
    def host_arrays(self) -> Arrays:
        """The index arrays this backend needs on the device (int64; the runner copies them over)."""

    @abstractmethod
    def bind(self, arrays: DeviceArrays, device: torch.device) -> None:
        """Derive what every layer shares (int32 offsets, masks, gather indices) from the device views
        of ``host_arrays``."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` [T, H, D]; ``k``/``v``: the fresh rows [T, H_kv, D] (``FRESH``) or the layer's pool
        slots [S, H_kv, D] (``POOL``); the attention output [T, H, D]."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` [T, H, D], ``k``/``v`` [T, H_kv, D] with RoPE applied (fresh keys already stored where
        the step keeps them); the attention output [T, H, D]."""
        if self.layout.keys is KeyLayout.POOL:
            k, v = self.cache.layer_slots(layer)
        return self.attend(layer, q, k, v)
