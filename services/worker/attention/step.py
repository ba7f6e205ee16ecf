"""What a step's forward calls per layer: one attention kernel call for the whole batch, on every backend.

:class:`StepAttention` is built once per step from the step's :class:`StepLayout` (``layout.py``) and
the backend chosen for the worker (``select.py``; one file per backend: ``flash.py``, ``varlen.py``,
``flex.py``, ``sdpa.py``). It holds what every layer needs, built from a few index arrays that the
model runner copies to the device together (``host_arrays`` then ``bind``); calling it with a layer's
``q``/``k``/``v`` stores the fresh keys and values (``store``, set by the runner) and returns the
attention output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.attention.base import Arrays, DeviceArrays
from services.worker.attention.layout import StepLayout
from services.worker.attention.select import BACKEND_IMPLS, AttentionBackend
from services.worker.kv.pool import KVPool


class StepAttention:
    """One step's attention for every layer: ``self(layer, q, k, v)`` stores the fresh keys and values
    (``store``) and attends. Built from ``host_arrays`` (on the host) and ``bind`` (device views)."""

    def __init__(self, backend: AttentionBackend, layout: StepLayout, cache: KVPool | None,
                 max_keys: int | None = None) -> None:
        """``max_keys``: an upper bound on any request's keys to pass the varlen kernels (a CUDA graph
        bakes it in); default: the step's longest."""
        self.backend, self.layout = backend, layout
        self.impl = BACKEND_IMPLS[backend](layout, cache, max_keys)
        self.store: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        self._views: DeviceArrays = {}
        self._bound_device: torch.device | None = None

    def host_arrays(self) -> Arrays:
        """The index arrays this backend needs on the device (int64; the runner copies them over)."""
        return self.impl.host_arrays()

    def bind(self, arrays: DeviceArrays, device: torch.device) -> None:
        """Take the device views of ``host_arrays`` (a CUDA graph's static buffers: their contents change
        from step to step, the views stay) and build what every layer shares."""
        self._views, self._bound_device = arrays, device
        self.refresh()

    def refresh(self) -> None:
        """Derive what every layer shares from the bound views (int32 offsets, masks): once per step,
        inside a captured graph where there is one."""
        self.impl.bind(self._views, self._bound_device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` [T, H, D], ``k``/``v`` [T, H_kv, D] with RoPE applied; the attention output [T, H, D]."""
        if self.store is not None:
            self.store(layer, k, v)
        return self.impl(layer, q, k, v)
