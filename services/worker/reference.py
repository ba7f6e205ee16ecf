"""The reference decoder: batch 1, no padding, the model's plain (padded-batch) forward.

It is deliberately the plainest reading of block-wise threshold decoding, so that every fast path of
the engine can be tested against it token for token. ``cache`` gives Fast-dLLM's approximate KV cache
in its plainest form: a full forward at each block start keeps every position's keys and values;
the block's later steps run the fresh window (the block for ``dual``, the block and everything after
it for ``prefix``) and attend to the kept keys and values with the window's fresh ones in their slots.
Confidences are the engine's (``services/worker/decoding/rule.py``, ``greedy_candidates``: the softmax at the
likeliest token, as LLaDA's and Fast-dLLM's decoders compute it).

``rule`` picks the decoding rule (``services/worker/decoding/rule.py``): ``llada``, the default whatever
the model's config says (DiLaServe's rule: the threshold at every step; a shifted model's windows start
one position before the block), or ``dream``, Fast-dLLM's Dream rule written from its published decoder
(``dream/model/generation_utils_block.py``): a block's first forward commits the block's first position
alone, later steps commit at or above the threshold, and cache windows start at the block. Pass
``decoding_rule(model.config)`` to decode as the engine does for that model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.worker.decoding.rule import (
    DecodingRule,
    cache_window_start,
    greedy_candidates,
    parse_rule,
    select_commits,
)
from services.worker.model.dlm import DLMForMaskedDiffusion


@dataclass
class ReferenceResult:
    tokens: list[int]  # the generation canvas, gen_length ids
    num_steps: int
    committed: list[list[int]] = field(default_factory=list)  # step -> the canvas positions it committed


def commit_positions(confidences: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices (into ``confidences``) to commit: all above ``threshold``, and at least the best one."""
    return select_commits(DecodingRule.LLADA, confidences, threshold, block_start_masked=False)


@torch.no_grad()
def reference_generate(
    model: DLMForMaskedDiffusion,
    prompt_ids: list[int],
    gen_length: int,
    block_length: int,
    threshold: float | Callable[[int], float],
    stop_at_eos: bool = True,
    cache: str = "none",
    rule: DecodingRule | str = DecodingRule.LLADA,
) -> ReferenceResult:
    """Decode block by block; ``threshold`` may be a function of the step number (from 0);
    ``cache``: ``none``, ``prefix`` or ``dual``; ``rule``: ``llada`` or ``dream`` (module docstring)."""
    rule = parse_rule(rule)
    mask_id, eos_id = model.config.mask_token_id, model.config.eos_token_id
    shift = model.config.logits_shift
    prompt_len = len(prompt_ids)
    x = torch.tensor([prompt_ids + [mask_id] * gen_length], device=model.device)
    num_steps, committed = 0, []
    for start in range(0, gen_length, block_length):
        end = min(start + block_length, gen_length)
        kept = None  # every position's (keys, values) per layer, from this block's first forward
        while True:
            block = x[0, prompt_len + start : prompt_len + end]
            masked = torch.nonzero(block == mask_id).flatten()
            if len(masked) == 0:
                break
            block_start = prompt_len + start  # absolute position of the block's first position
            window_start = cache_window_start(rule, block_start, shift)
            window_end = prompt_len + end if cache == "dual" else x.shape[1]
            if cache == "none" or kept is None:
                out = model(x, return_kv=cache != "none")
                kept, first = out.kv, 0
            else:
                out = _cache_step(model, x, kept, window_start, window_end)
                first = window_start  # the window's first output is that of position window_start
            logits = out.logits[0]
            positions = block_start + masked  # absolute positions still masked in the block
            outputs = positions - shift - first  # the output predicting each (its row in this forward)
            if int(outputs.min()) < 0:
                raise AssertionError(f"a cache step's window starts after the output predicting position "
                                     f"{int(positions[outputs.argmin()])}")
            conf, token = greedy_candidates(logits[outputs], mask_id)  # the mask token is never an answer
            tau = threshold(num_steps) if callable(threshold) else threshold
            chosen = select_commits(rule, conf, tau, block_start_masked=bool(masked[0] == 0))
            x[0, positions[chosen]] = token[chosen]
            committed.append(positions[chosen].sub(prompt_len).tolist())
            num_steps += 1
        if stop_at_eos and bool((x[0, prompt_len : prompt_len + end] == eos_id).any()):
            x[0, prompt_len + end :] = eos_id
            break
    return ReferenceResult(x[0, prompt_len:].tolist(), num_steps, committed)


def _cache_step(model: DLMForMaskedDiffusion, x: torch.Tensor, kept, window_start: int, window_end: int):
    """Run ``x[window_start:window_end]`` against the kept keys/values, the window's fresh ones in their
    own positions' slots (keys in position order, as Fast-dLLM's dual cache keeps them)."""
    positions = torch.arange(window_start, window_end, device=x.device)[None]
    valid = torch.ones((1, x.shape[1]), dtype=torch.bool, device=x.device)
    return model(x[:, window_start:window_end], position_ids=positions, context_kv=kept, context_valid=valid,
                 replace=(window_start, window_end))
