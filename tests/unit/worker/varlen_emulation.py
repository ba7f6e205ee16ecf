"""CPU stand-ins for the CUDA varlen kernels, written from their documented contracts.

They let the CPU tests check what the engine passes to the kernels (offsets, block tables, lengths,
pool order) token for token; the tests marked ``gpu`` check the real kernels against SDPA.
"""

import torch
import torch.nn.functional as F


def _check_offsets(cu: torch.Tensor, batch: int) -> list[int]:
    assert cu.dtype == torch.int32 and cu.shape == (batch + 1,)
    offsets = cu.tolist()
    assert offsets == sorted(offsets), "cumulative offsets must not decrease"
    return offsets


def _attend(q, keys, values):
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], enable_gqa=keys.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, block_table=None):
    """flash-attn 2's varlen forward: sequence i's keys are rows cu_k[i]..cu_k[i+1] of k, or, with a
    block table, the first cu_k[i+1]-cu_k[i] slots of its pages (k: [pages, page_size, H_kv, D])."""
    assert not causal and dropout_p == 0.0 and softmax_scale is None
    batch = cu_seqlens_q.numel() - 1
    cu_q, cu_k = _check_offsets(cu_seqlens_q, batch), _check_offsets(cu_seqlens_k, batch)
    if block_table is not None:
        assert block_table.dtype == torch.int32 and k.shape[1] % 256 == 0, "paged KV needs pages of 256k slots"
    out = torch.empty_like(q)
    for i in range(batch):
        q_len, k_len = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        assert q_len <= max_seqlen_q and k_len <= max_seqlen_k
        if block_table is None:
            keys, values = k[cu_k[i] : cu_k[i + 1]], v[cu_k[i] : cu_k[i + 1]]
        else:
            pages = block_table[i, : -(-k_len // k.shape[1])].long()
            keys, values = k[pages].flatten(0, 1)[:k_len], v[pages].flatten(0, 1)[:k_len]
        out[cu_q[i] : cu_q[i + 1]] = _attend(q[cu_q[i] : cu_q[i + 1]], keys, values)
    return out


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, enable_gqa=False, seqused_k=None):
    """PyTorch's varlen_attn (FlashAttention-2): sequence i's keys start at cu_seq_k[i]; with
    seqused_k, only its first seqused_k[i] keys are read."""
    batch = cu_seq_q.numel() - 1
    cu_q, cu_k = _check_offsets(cu_seq_q, batch), _check_offsets(cu_seq_k, batch)
    assert enable_gqa == (key.shape[1] != query.shape[1])
    used = seqused_k.tolist() if seqused_k is not None else [cu_k[i + 1] - cu_k[i] for i in range(batch)]
    out = torch.empty_like(query)
    for i in range(batch):
        assert cu_q[i + 1] - cu_q[i] <= max_q and used[i] <= max_k and cu_k[i] + used[i] <= cu_k[i + 1]
        keys, values = key[cu_k[i] : cu_k[i] + used[i]], value[cu_k[i] : cu_k[i] + used[i]]
        out[cu_q[i] : cu_q[i + 1]] = _attend(query[cu_q[i] : cu_q[i + 1]], keys, values)
    return out


def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1)):
    """torch 2.11's varlen_attn: no ``seqused_k`` and no ``enable_gqa``: sequence i's keys are exactly
    rows cu_seq_k[i]..cu_seq_k[i+1], with as many heads as the queries; a sequence may have no queries."""
    assert return_aux is None and scale is None and tuple(window_size) == (-1, -1)
    assert key.shape[1] == query.shape[1], "torch 2.11's varlen_attn has no grouped-query attention"
    batch = cu_seq_q.numel() - 1
    cu_q, cu_k = _check_offsets(cu_seq_q, batch), _check_offsets(cu_seq_k, batch)
    out = torch.empty_like(query)
    for i in range(batch):
        assert cu_q[i + 1] - cu_q[i] <= max_q and cu_k[i + 1] - cu_k[i] <= max_k
        if cu_q[i + 1] > cu_q[i]:
            out[cu_q[i] : cu_q[i + 1]] = _attend(query[cu_q[i] : cu_q[i + 1]], key[cu_k[i] : cu_k[i + 1]],
                                                 value[cu_k[i] : cu_k[i + 1]])
    return out
