"""The mask predictor: LLaDA's architecture (LLaMA blocks without the causal mask).

RMSNorm, rotary position embeddings at absolute positions, SwiGLU MLP, bidirectional attention.
Parameter names follow the public LLaDA checkpoint layout
(``model.transformer.{wte, blocks.N.{attn_norm, q_proj, k_proj, v_proj, attn_out, ff_norm, ff_proj,
up_proj, ff_out}, ln_f, ff_out}``), so LLaDA weights load without renaming. Options cover the
Dream family too: grouped-query attention, q/k/v biases, and logits shifted by one position.

Two forwards:

* ``forward``: a padded batch ``[B, Q]`` (training, the reference decoder, tensor-parallel
  ``forward_logits``). Beyond ``input_ids``/``attention_mask`` it takes what a plain KV cache needs:
  ``context_kv`` (keys and values of cached positions, per layer, RoPE already applied),
  ``context_valid`` (which cached slots are real) and ``return_kv`` (hand back the fresh keys and
  values, to become the cache).
* ``forward_packed``: the engine's path. The batch's fresh tokens are one sequence ``[T]`` with no
  padding; attention is a callable (``services/worker/attention/step.py``) that knows where each
  request's rows and cached keys lie; logits are computed only for the rows asked for.

RoPE: cos/sin come from a table built once per model and device (rows looked up by position, once
per forward, shared by every layer), so cached keys and fresh ones are rotated by the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import ModelOutput


class DLMConfig(PretrainedConfig):
    model_type = "dls-dlm"

    def __init__(
        self,
        vocab_size: int = 50,
        d_model: int = 192,
        n_layers: int = 6,
        n_heads: int = 6,
        n_kv_heads: int | None = None,
        mlp_hidden_size: int = 512,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-5,
        max_sequence_length: int = 4096,
        qkv_bias: bool = False,
        logits_shift: int = 0,
        rope_full_precision: bool = True,
        decoding_rule: str = "llada",
        mask_token_id: int = 1,
        pad_token_id: int = 0,
        eos_token_id: int = 2,
        tie_word_embeddings: bool = False,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.mlp_hidden_size = mlp_hidden_size
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.max_sequence_length = max_sequence_length
        self.qkv_bias = qkv_bias
        self.logits_shift = logits_shift  # 1 for Dream: position p is predicted by the output at p-1
        # RoPE computed in float32 whatever the model's dtype (LLaDA's config key of the same name; true for
        # LLaDA-8B). Dream (Qwen2) rotates in the model's dtype: its loader sets it false
        self.rope_full_precision = rope_full_precision
        self.decoding_rule = decoding_rule  # the family's decoding rule (services/worker/decoding/rule.py)
        self.mask_token_id = mask_token_id
        self.tie_word_embeddings = tie_word_embeddings  # Dream checkpoints may share wte and the LM head
        super().__init__(pad_token_id=pad_token_id, eos_token_id=eos_token_id, **kwargs)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class DLMOutput(ModelOutput):
    """``logits`` [B, Q, V]; ``kv``: per layer (keys, values) of the fresh tokens, [B, H_kv, Q, Dh]."""

    logits: torch.Tensor | None = None
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LLaDA's and Dream's RMSNorm, precision included: normalised in float32, cast back to the model's
    dtype, *then* scaled by the weight in that dtype (both reference modeling codes do it this way)."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    return torch.cat((freqs, freqs), dim=-1)


class RopeTable:
    """cos/sin of every position up to the longest seen, float32, built once per device (grows on demand)."""

    def __init__(self, head_dim: int, theta: float, length: int) -> None:
        self.head_dim, self.theta, self.length = head_dim, theta, length
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (cos, sin)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype,
               max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[*positions.shape, Dh]`` in ``dtype`` (float32 for RoPE in full precision);
        ``max_position`` (when the caller knows it) spares reading the positions back from the device."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        cos, sin = self._table(positions.device, max_position + 1)
        flat = positions.reshape(-1)
        shape = (*positions.shape, self.head_dim)
        return cos.index_select(0, flat).view(shape).to(dtype), sin.index_select(0, flat).view(shape).to(dtype)

    def reserve(self, device: torch.device, length: int) -> None:
        """Build the table for ``length`` positions now (a captured CUDA graph must never rebuild it)."""
        self._table(device, length)

    def _table(self, device: torch.device, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables.get(device)
        if table is None or table[0].shape[0] < needed:
            self.length = max(self.length, needed)
            angles = rope_angles(torch.arange(self.length, device=device), self.head_dim, self.theta)
            table = self._tables[device] = (angles.cos(), angles.sin())
        return table


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` in the dtype of ``cos``/``sin`` (float32: LLaDA's ``rope_full_precision``; the
    model's dtype: Dream's, as Qwen2 does), returned in ``x``'s dtype."""
    h = x.to(cos.dtype)
    half = h.shape[-1] // 2
    rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
    return (h * cos + rotated * sin).to(x.dtype)


class Block(nn.Module):
    """One LLaMA block without the causal mask, named as in LLaDA checkpoints.

    ``tp_degree``: how many ranks share the block's weights (1: the whole block). A tensor-parallel
    shard has ``tp_degree > 1``, set by ``shard_model``; its projections hold a slice of the
    weights and its ``ff_out`` sums partial results across ranks, so the compiled MLP (one local
    graph over whole weights) does not apply to it.
    """

    tp_degree: int = 1

    def __init__(self, config: DLMConfig) -> None:
        super().__init__()
        self.tp_degree = 1
        d, h, kvh, hd = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, kvh, hd
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.q_proj = nn.Linear(d, h * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, kvh * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, kvh * hd, bias=config.qkv_bias)
        self.attn_out = nn.Linear(h * hd, d, bias=False)
        self.ff_norm = RMSNorm(d, config.rms_norm_eps)
        self.ff_proj = nn.Linear(d, config.mlp_hidden_size, bias=False)  # gate
        self.up_proj = nn.Linear(d, config.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(config.mlp_hidden_size, d, bias=False)

    def forward(self, x, cos, sin, key_mask, context_kv=None, replace: tuple[int, int] | None = None):
        batch, q_len, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(batch, q_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(batch, q_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(batch, q_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        fresh_kv = (k, v)
        if context_kv is not None and replace is not None:  # fresh keys take their positions' slots
            k, v = context_kv[0].clone(), context_kv[1].clone()
            k[:, :, replace[0] : replace[1]], v[:, :, replace[0] : replace[1]] = fresh_kv
        elif context_kv is not None:
            k = torch.cat((context_kv[0], k), dim=2)
            v = torch.cat((context_kv[1], v), dim=2)
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=key_mask, enable_gqa=self.n_kv_heads != self.n_heads
        )
        x = x + self.attn_out(attn.transpose(1, 2).reshape(batch, q_len, -1))
        return self._mlp(x), fresh_kv

    def forward_packed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: PackedAttend):
        """``x`` [T, d] (a packed batch); ``cos``/``sin`` [T, 1, Dh]; ``attend(q, k, v)`` -> [T, H, Dh]."""
        tokens = x.shape[0]
        h = self.attn_norm(x)
        q = self.q_proj(h).view(tokens, self.n_heads, self.head_dim)
        k = self.k_proj(h).view(tokens, self.n_kv_heads, self.head_dim)
        v = self.v_proj(h).view(tokens, self.n_kv_heads, self.head_dim)
        attn = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        x = x + self.attn_out(attn.reshape(tokens, -1))
        return self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.compiled_mlp is not None and self.tp_degree == 1:
            return self.compiled_mlp(x, self.ff_norm.weight, self.ff_norm.eps, self.ff_proj.weight,
                                     self.up_proj.weight, self.ff_out.weight)
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))

    compiled_mlp = None  # set by DLMForMaskedDiffusion.compile_mlp


def mlp_residual(x, norm_weight, eps: float, gate_weight, up_weight, down_weight) -> torch.Tensor:
    """``Block._mlp`` as a pure function of its weights, so that one compiled graph serves every layer."""
    h = rms_norm(x, norm_weight, eps)
    return x + F.linear(F.silu(F.linear(h, gate_weight)) * F.linear(h, up_weight), down_weight)


# One layer's attention over a packed batch: (q [T, H, Dh], k, v [T, H_kv, Dh]) -> [T, H, Dh].
PackedAttend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# The same for every layer, given the layer's index first.
PackedAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


_COMPILED: dict[str, Callable] = {}  # name -> the compiled function (compiled once per process)


def _compiled_mlp_residual() -> Callable:
    if "mlp_residual" not in _COMPILED:
        _COMPILED["mlp_residual"] = torch.compile(mlp_residual, dynamic=True)
    return _COMPILED["mlp_residual"]


class Transformer(nn.Module):
    def __init__(self, config: DLMConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = RMSNorm(config.d_model, config.rms_norm_eps)
        self.ff_out = nn.Linear(config.d_model, config.vocab_size, bias=False)  # the LM head


class _Body(nn.Module):
    """Holds ``transformer`` so that names read ``model.transformer...`` as in LLaDA."""

    def __init__(self, config: DLMConfig) -> None:
        super().__init__()
        self.transformer = Transformer(config)


class DLMForMaskedDiffusion(PreTrainedModel):
    config_class = DLMConfig
    base_model_prefix = "model"
    _supports_sdpa = True
    _no_split_modules = ["Block"]

    def __init__(self, config: DLMConfig) -> None:
        super().__init__(config)
        self.model = _Body(config)
        self.rope = RopeTable(config.head_dim, config.rope_theta, config.max_sequence_length)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        context_valid: torch.Tensor | None = None,
        return_kv: bool = False,
        replace: tuple[int, int] | None = None,
        **_: object,
    ) -> DLMOutput:
        """``attention_mask`` [B, Q]: 1 for real tokens (0 for left padding, never attended to).

        ``position_ids`` default to counting real tokens from 0. With ``context_kv``, queries also
        attend to the cached slots where ``context_valid`` [B, C] is true; with ``replace`` (a range of
        cached slots as long as the input), the fresh keys and values take those slots instead of
        following the cached ones (Fast-dLLM's dual cache: keys stay in position order).
        """
        batch, q_len = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        attention_mask = attention_mask.bool()
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if context_valid is None:
            key_valid = attention_mask
        else:
            key_valid = context_valid.bool() if replace is not None else torch.cat((context_valid.bool(), attention_mask), 1)
        # no mask where every key is real: the kernel the reference's modeling code runs
        key_mask = None if bool(key_valid.all()) else key_valid[:, None, None, :]
        transformer = self.model.transformer
        x = transformer.wte(input_ids)
        cos, sin = self.rope.lookup(position_ids[:, None], self.rope_dtype)  # [B, 1, Q, Dh]: once, for every layer
        fresh = []
        for i, block in enumerate(transformer.blocks):
            x, kv = block(x, cos, sin, key_mask, None if context_kv is None else context_kv[i], replace)
            if return_kv:
                fresh.append(kv)
        logits = transformer.ff_out(transformer.ln_f(x))
        return DLMOutput(logits=logits, kv=fresh if return_kv else None)

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: PackedAttention,
        logit_rows: torch.Tensor,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """Logits ``[R, V]`` of the packed rows ``logit_rows`` [R].

        ``input_ids``/``positions`` [T]: every request's fresh tokens one after another, at their
        absolute positions. ``attention(layer, q, k, v)`` does each layer's attention (and any
        cache writes). The LM head runs only on ``logit_rows``: a step reads the logits of its
        current block, not of the whole sequence.
        """
        transformer = self.model.transformer
        x = transformer.wte(input_ids)
        cos, sin = self.rope.lookup(positions[:, None], self.rope_dtype, max_position)  # [T, 1, Dh]: once, every layer
        for i, block in enumerate(transformer.blocks):
            x = block.forward_packed(x, cos, sin, lambda q, k, v, i=i: attention(i, q, k, v))
        return transformer.ff_out(transformer.ln_f(x.index_select(0, logit_rows)))

    @property
    def tp_degree(self) -> int:
        """How many tensor-parallel ranks share the blocks' weights (1: a whole model)."""
        return self.model.transformer.blocks[0].tp_degree

    @property
    def rope_dtype(self) -> torch.dtype:
        """The dtype RoPE is computed in (``DLMConfig.rope_full_precision``)."""
        if getattr(self.config, "rope_full_precision", True) and self.dtype in (torch.float16, torch.bfloat16):
            return torch.float32
        return self.dtype

    def compile_mlp(self, enabled: bool = True) -> None:
        """Run every block's RMSNorm + SwiGLU through one ``torch.compile``d graph (dynamic shapes: one
        compile for every batch); off by default, see docs/performance.md for where it was measured."""
        compiled = _compiled_mlp_residual() if enabled else None
        for block in self.model.transformer.blocks:
            block.compiled_mlp = compiled

    def num_parameters_excluding_embeddings(self) -> int:
        return sum(p.numel() for n, p in self.named_parameters() if "wte" not in n)
