"""GPU pinning and the CUDA check, shared by the node agent, the worker and ``dls up``.

A worker the node agent starts is pinned to its slot's GPUs with ``CUDA_VISIBLE_DEVICES`` (``pin``:
the agent's GPU ids are positions in the ``CUDA_VISIBLE_DEVICES`` the agent itself was given, if
any), so it sees them as ``cuda:0 .. cuda:tp-1``, and ``DLS_WORKER_DEVICE=cuda`` puts rank r on
``cuda:r`` (the engine's placement: ``services.worker.parallel.placement.rank_device``). ``cuda_problem`` says why a
CUDA device cannot be had, before anything is started on it.
"""

from __future__ import annotations

import os

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


class DeviceError(ValueError):
    """The devices a worker (or ``dls up``) was asked to use are not there."""


def is_cuda(device: str) -> bool:
    return device.split(":", 1)[0] == "cuda"


def visible_list(value: str | None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list (None: unset, every GPU is visible)."""
    if value is None:
        return None
    return [entry.strip() for entry in value.split(",") if entry.strip()]


def pin(gpu_ids, inherited: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a process on ``gpu_ids``: the ids themselves, or, when the parent was
    given ``inherited`` (a list of ids or UUIDs), the entries at those positions of it (an empty one:
    the parent sees no GPU, nor will the child)."""
    entries = visible_list(inherited)
    if entries is None:
        return ",".join(str(gpu) for gpu in gpu_ids)
    outside = [gpu for gpu in gpu_ids if not 0 <= gpu < len(entries)]
    if entries and outside:
        raise DeviceError(f"GPUs {outside} are not among the {len(entries)} devices "
                          f"{VISIBLE_DEVICES}={inherited!r} shows this process")
    return ",".join(entries[gpu] for gpu in gpu_ids) if entries else ""


def cuda_problem(device: str, num_gpus: int) -> str | None:
    """Why an instance on ``device`` spanning ``num_gpus`` GPUs cannot run in this process, or None
    (always None for a device that is not CUDA). Asks torch; allocates nothing on a GPU."""
    if not is_cuda(device):
        return None
    import torch

    visible = os.environ.get(VISIBLE_DEVICES)
    shown = f"{VISIBLE_DEVICES}={visible!r}" if visible is not None else f"{VISIBLE_DEVICES} unset"
    if not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"torch {torch.__version__} ({build}) sees no CUDA device ({shown})"
    first = torch.device(device).index or 0
    count = torch.cuda.device_count()
    if first + num_gpus > count:
        return f"needs GPUs cuda:{first}..cuda:{first + num_gpus - 1} but this process sees {count} ({shown})"
    return None
