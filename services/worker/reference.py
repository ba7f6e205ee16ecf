"""The reference decoder: batch 1, a full forward every step, no cache, no padding.

It is deliberately the plainest reading of block-wise threshold decoding, so that every fast path of
the engine can be tested against it token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.worker.model import DLMForMaskedDiffusion


@dataclass
class ReferenceResult:
    tokens: list[int]  # the generation canvas, gen_length ids
    num_steps: int


def commit_positions(confidences: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices (into ``confidences``) to commit: all above ``threshold``, and at least the best one."""
    chosen = confidences > threshold
    chosen[torch.argmax(confidences)] = True
    return torch.nonzero(chosen).flatten()


@torch.no_grad()
def reference_generate(
    model: DLMForMaskedDiffusion,
    prompt_ids: list[int],
    gen_length: int,
    block_length: int,
    threshold: float | Callable[[int], float],
    stop_at_eos: bool = True,
) -> ReferenceResult:
    """Decode block by block; ``threshold`` may be a function of the step number (from 0)."""
    mask_id, eos_id = model.config.mask_token_id, model.config.eos_token_id
    shift = model.config.logits_shift
    prompt_len = len(prompt_ids)
    x = torch.tensor([prompt_ids + [mask_id] * gen_length], device=model.device)
    num_steps = 0
    for start in range(0, gen_length, block_length):
        end = min(start + block_length, gen_length)
        while True:
            block = x[0, prompt_len + start : prompt_len + end]
            masked = torch.nonzero(block == mask_id).flatten()
            if len(masked) == 0:
                break
            logits = model(x).logits[0].float()
            positions = prompt_len + start + masked  # absolute positions still masked in the block
            rows = logits[positions - shift]
            rows[:, mask_id] = float("-inf")  # the mask token is never an answer
            probs = torch.softmax(rows, dim=-1)
            conf, token = probs.max(dim=-1)
            tau = threshold(num_steps) if callable(threshold) else threshold
            chosen = commit_positions(conf, tau)
            x[0, positions[chosen]] = token[chosen]
            num_steps += 1
        if stop_at_eos and bool((x[0, prompt_len : prompt_len + end] == eos_id).any()):
            x[0, prompt_len + end :] = eos_id
            break
    return ReferenceResult(x[0, prompt_len:].tolist(), num_steps)
