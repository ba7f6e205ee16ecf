"""Which of the machine's GPUs a worker's engine runs on (``shared.devices`` pins and checks them)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from shared.devices import VISIBLE_DEVICES, DeviceError, is_cuda, visible_list


def rank_gpus(device: str, tp: int, env: Mapping[str, str] | None = None) -> list[str]:
    """The machine's GPUs (as CUDA numbers them, or the UUIDs ``CUDA_VISIBLE_DEVICES`` names) that
    ranks 0..tp-1 of an instance on ``device`` run on: the engine's placement (``tp.rank_device``)
    through this environment's ``CUDA_VISIBLE_DEVICES``; ``device`` itself per rank when not CUDA."""
    from services.worker.parallel.tp_engine import rank_device

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
