"""Per-request sampling of a denoising step: temperature, top-p and top-k with Gumbel noise (pure).

LLaDA's reference sampler picks each masked position's candidate as ``argmax(logits + T * g)`` where
``g`` is standard Gumbel noise (``generate.py``'s ``add_gumbel_noise``, written there as
``exp(logits) / (-log u) ** T`` in float64, the same argmax): a draw from ``softmax(logits / T)``.
Here top-k and top-p (nucleus) first remove the tokens outside the cut (their logits become -inf),
then the Gumbel-max draw runs over the rest. Temperature 0 is the argmax, untouched by all of this.

What the threshold compares against when sampling: the **model's own probability of the drawn
token**, ``softmax(logits)[x0]`` at temperature 1, before any top-k/top-p cut (the mask token
excluded), as LLaDA does (``p = softmax(logits); x0_p = p[x0]``). At temperature 0 that is the top
probability, the confidence of greedy decoding, so a greedy request is decoded exactly as before.
It is also what ``logprobs`` reports for the token.

The noise is a pure function of the request's noise key and its step index, and covers every
position of the block (masked or not, in position order): a request draws the same noise on any
instance, in any batch, after any migration, so given the same logits it commits the same tokens,
and a request sent twice with the same ``seed`` is answered the same.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # most alternatives per position a request may ask for (OpenAI's limit)


@dataclass(frozen=True)
class SamplingParams:
    """How a request draws its tokens (the defaults: greedy)."""

    temperature: float = 0.0  # 0: argmax (greedy)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens (0 or less: all)
    seed: int | None = None  # the noise key's seed; None: the request id stands in for it

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature {self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p {self.top_p} must be in (0, 1]")


def noise_seed(seed: int | None, request_id: str, step_index: int) -> int:
    """The 63-bit generator seed of one request-step: its ``seed`` (or, without one, its request id)
    and the step index (the request's steps done before this one), hashed."""
    key = f"seed:{seed}" if seed is not None else f"id:{request_id}"
    digest = hashlib.blake2b(f"{key}|step:{step_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def gumbel_noise(seed: int, rows: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``rows x vocab`` standard Gumbel noise in float64 from a generator seeded with ``seed``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    uniform = torch.rand((rows, vocab), generator=generator, dtype=torch.float64, device=device)
    tiny = torch.finfo(torch.float64).tiny
    exponential = -torch.log(uniform.clamp(min=tiny))  # > 0
    return -torch.log(exponential.clamp(min=tiny))


def cut(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` (rows x vocab) with the tokens outside top-k and top-p set to -inf (a copy)."""
    out = logits.clone()
    vocab = out.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out[out < kth] = float("-inf")
    if top_p < 1.0:
        ordered, order = torch.sort(out, dim=-1, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(ordered, dim=-1) >= top_p  # the mass before it already reaches top_p
        drop[:, 0] = False  # the most likely token always stays
        out.scatter_(-1, order, ordered.masked_fill(drop, float("-inf")))
    return out


def sample(logits: torch.Tensor, params: SamplingParams, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` (float, the mask token already at -inf); returns the tokens
    and the model's probability of each (``softmax(logits)`` at temperature 1, before the cut)."""
    logits = logits.double()
    probs = torch.softmax(logits, dim=-1)
    kept = cut(logits, params.top_k, params.top_p)
    noise = gumbel_noise(seed, logits.shape[0], logits.shape[1], logits.device)
    tokens = torch.argmax(kept / params.temperature + noise, dim=-1)
    return probs.gather(-1, tokens[:, None])[:, 0], tokens


def top_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row and their probabilities (temperature 1)."""
    probs = torch.softmax(logits.float(), dim=-1)
    values, ids = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    return ids, values
