"""Tensor-parallel layers: one model's weights split over ``d`` ranks (Megatron-style sharding).

Sharding (:func:`shard_model`), per block:

* attention ``q_proj``/``k_proj``/``v_proj``: column-parallel by heads. Rank ``r`` keeps query heads
  ``[r*h/d, (r+1)*h/d)`` and key/value heads ``[r*h_kv/d, (r+1)*h_kv/d)``; with grouped-query
  attention those are exactly the key/value heads its query heads read, so attention is local.
* ``attn_out``: row-parallel (the rank's slice of the head dimension), then an all-reduce.
* SwiGLU ``ff_proj`` (gate) and ``up_proj``: column-parallel; ``ff_out`` (down): row-parallel, then an
  all-reduce.
* embeddings, norms and the LM head: replicated.

After each all-reduce every rank holds the same activations, so every rank computes the same logits
and commits the same tokens.

``shard_model`` marks every block with its degree (``Block.tp_degree``): a shard's ``ff_out`` sums
partial results across ranks, which a whole model's compiled MLP and CUDA graphs must not assume away.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from services.worker.model.dlm import DLMConfig, DLMForMaskedDiffusion


class ShardingError(ValueError):
    """The model cannot be split over the requested tensor-parallel degree."""


AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the ranks, in place


def _dist_all_reduce(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split over the ranks: ``all_reduce(x_r @ W_r^T) + b``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, all_reduce: AllReduce) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        self.all_reduce(out)
        # NOTE: the bias is added once, after the sum, not on every rank before it.
        return out if self.bias is None else out + self.bias


def check_divisible(config: DLMConfig, degree: int) -> None:
    """Raise :class:`ShardingError` unless ``degree`` divides the heads, key/value heads and MLP width."""
    if degree < 1:
        raise ShardingError(f"tensor-parallel degree must be at least 1, got {degree}")
    sizes = {"n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads, "mlp_hidden_size": config.mlp_hidden_size}
    bad = [f"{name}={value}" for name, value in sizes.items() if value % degree]
    if bad:
        raise ShardingError(
            f"tensor-parallel degree {degree} must divide n_heads, n_kv_heads and mlp_hidden_size; "
            f"not divisible: {', '.join(bad)}"
        )


def _keep_rows(linear: nn.Linear, rows: slice) -> None:
    linear.weight = nn.Parameter(linear.weight.data[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[rows].clone(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _row_parallel(linear: nn.Linear, columns: slice, all_reduce: AllReduce) -> RowParallelLinear:
    bias = None if linear.bias is None else linear.bias.data.clone()
    return RowParallelLinear(linear.weight.data[:, columns].clone(), bias, all_reduce)


def _part(rank: int, size: int) -> slice:
    return slice(rank * size, (rank + 1) * size)


def shard_model(
    model: DLMForMaskedDiffusion, rank: int, degree: int, all_reduce: AllReduce = _dist_all_reduce
) -> DLMForMaskedDiffusion:
    """Keep only rank ``rank``'s shard of every block (in place, each marked ``tp_degree = degree``); the
    config still describes the whole model.

    ``all_reduce`` sums the row-parallel partial outputs over the ranks (``torch.distributed`` by
    default; tests pass an in-process one).
    """
    config = model.config
    check_divisible(config, degree)
    if not 0 <= rank < degree:
        raise ShardingError(f"rank {rank} is outside [0, {degree})")
    head_dim = config.head_dim
    q_width = config.n_heads // degree * head_dim
    kv_width = config.n_kv_heads // degree * head_dim
    mlp_width = config.mlp_hidden_size // degree
    for block in model.model.transformer.blocks:
        _keep_rows(block.q_proj, _part(rank, q_width))
        _keep_rows(block.k_proj, _part(rank, kv_width))
        _keep_rows(block.v_proj, _part(rank, kv_width))
        block.attn_out = _row_parallel(block.attn_out, _part(rank, q_width), all_reduce)
        block.n_heads, block.n_kv_heads = config.n_heads // degree, config.n_kv_heads // degree
        _keep_rows(block.ff_proj, _part(rank, mlp_width))
        _keep_rows(block.up_proj, _part(rank, mlp_width))
        block.ff_out = _row_parallel(block.ff_out, _part(rank, mlp_width), all_reduce)
        block.tp_degree = degree
    return model
