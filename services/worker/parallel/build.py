"""The one factory of a model instance: ``make_engine(model_dir, tp)``, a plain ``DLMEngine`` at TP 1 and a
``TensorParallelEngine`` above (what the worker, ``dls calibrate`` and the tests build)."""

from __future__ import annotations

from pathlib import Path

import torch

from services.worker.engine.engine import DLMEngine
from services.worker.model.loading import load_model
from services.worker.model.parallel import ShardingError
from services.worker.parallel.tp_engine import TensorParallelEngine


def make_engine(
    model_dir: str | Path,
    tp: int = 1,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    stop_at_eos: bool = True,
    trust_remote_code: bool = False,
    **tp_options,
) -> DLMEngine:
    """A plain :class:`DLMEngine` for ``tp == 1``, a :class:`TensorParallelEngine` otherwise.

    ``trust_remote_code``: tokenizer code the checkpoint ships may run (the worker's ``DLS_TRUST_REMOTE_CODE``).
    ``tp_options`` (``num_threads``, ``timeout_s``, ``verify``, ``start_timeout_s``) only apply to ``tp > 1``.
    """
    if tp < 1:
        raise ShardingError(f"tensor-parallel degree must be at least 1, got {tp}")
    if tp == 1:
        loaded = load_model(model_dir, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
        return DLMEngine.from_loaded(loaded, stop_at_eos=stop_at_eos)
    return TensorParallelEngine(model_dir, tp, device, dtype, stop_at_eos, trust_remote_code=trust_remote_code,
                                **tp_options)
