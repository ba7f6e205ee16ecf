"""Where a worker's ranks run: the device of each (``rank_device``) and which of the machine's GPUs that is
(``rank_gpus``; ``shared.devices`` pins and checks them)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from shared.devices import VISIBLE_DEVICES, DeviceError, is_cuda, visible_list


def rank_device(device: str, rank: int) -> torch.device:
    """Where rank ``rank`` of an instance on ``device`` runs: ``cuda`` or ``cuda:N`` puts rank r on GPU
    N + r (of the GPUs this process sees: a worker the node agent pinned with ``CUDA_VISIBLE_DEVICES``
    sees its slot's GPUs as 0..tp-1); anything else is used as is."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def rank_gpus(device: str, tp: int, env: Mapping[str, str] | None = None) -> list[str]:
    """The machine's GPUs (as CUDA numbers them, or the UUIDs ``CUDA_VISIBLE_DEVICES`` names) that
    ranks 0..tp-1 of an instance on ``device`` run on: the engine's placement (``rank_device``)
    through this environment's ``CUDA_VISIBLE_DEVICES``; ``device`` itself per rank when not CUDA."""
    env = os.environ if env is None else env
    devices = [rank_device(device, rank) for rank in range(tp)]
    if not is_cuda(device):
        return [str(d) for d in devices]
    entries = visible_list(env.get(VISIBLE_DEVICES))
    if entries is None:
        return [str(d.index) for d in devices]
    missing = [d.index for d in devices if d.index >= len(entries)]
    if missing:
        raise DeviceError(f"{device} at TP {tp} needs cuda:{', cuda:'.join(map(str, missing))}, but "
                          f"{VISIBLE_DEVICES}={env.get(VISIBLE_DEVICES)!r} shows {len(entries)} GPUs")
    return [entries[d.index] for d in devices]
