"""The threshold commit rule, written once for the engine (the whole batch on the device) and the
reference decoder (one request).

A step's candidates: at each position, the likeliest token (the mask token excluded: it is never an
answer) and its probability, the float32 softmax of the logits at that token whatever the model's
dtype (LLaDA's and Fast-dLLM's decoders take ``F.softmax(logits.to(torch.float64))``, which agrees with
it to about 1e-7: a threshold decision could differ only for a probability that close to it).
A sampled request draws its candidates instead (``services/worker/decoding/sampling.py``).

The rule (``services/worker/decoding/rule.py`` has each model family's, and ``select_commits``, its
one-request form): commit every still-masked position of the block whose candidate's probability is
above the request's threshold (at least the threshold, under Dream's rule), and at least the most
confident one (the first, on a tie). Which positions may be committed at all (``eligible``) is the
rule's too: Dream's commits a block's first position alone at the block's first forward.
"""

from __future__ import annotations

import torch


def greedy_candidates(logits: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(probability float64, token) of each row's likeliest token, the mask token excluded."""
    rows = logits.float()  # a copy: the mask column is overwritten
    rows[:, mask_id] = float("-inf")
    # float32 softmax (one fused kernel): of bf16/fp16 logits, within about 1e-7 of the reference decoders'
    # float64 softmax, far below the logits' own precision; a float64 pass costs several times more on a CPU
    confidence, tokens = torch.softmax(rows, dim=-1).max(dim=-1)
    return confidence.double(), tokens


def commit_mask(confidence: torch.Tensor, eligible: torch.Tensor, thresholds: torch.Tensor,
                grid: torch.Tensor, inclusive: bool = False) -> torch.Tensor:
    """The rule for a whole batch at once, no loop over requests and no read-back.

    ``confidence`` [R] float64 and ``eligible`` [R] bool (the position is masked) for every block row of
    the batch; ``thresholds`` [R] each row's request's threshold; ``grid`` [B, L] the block rows of each
    request in position order (``R`` where a request has fewer than ``L``); ``inclusive``: a probability
    equal to the threshold passes. Returns [R] bool.
    """
    scored = torch.where(eligible, confidence, torch.full_like(confidence, -1.0))
    padded = torch.cat((scored, scored.new_full((1,), -2.0)))[grid]  # [B, L]: -2 past a request's rows
    best = grid.gather(1, padded.argmax(dim=1, keepdim=True))[:, 0]  # the first most confident row
    passes = confidence >= thresholds if inclusive else confidence > thresholds
    commit = torch.cat((eligible & passes, eligible.new_zeros(1)))
    commit[best] = commit[best] | (padded.max(dim=1).values >= 0)  # a request with no masked row: none
    return commit[:-1]
