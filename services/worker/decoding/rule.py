"""The decoding rule of a model family: which block positions a denoising step commits, and where a
cache step's fresh window starts; written once for the engine (the whole batch on the device:
``commit_mask``) and the reference decoder (one request: ``select_commits``), side by side.

A model's rule is ``config.decoding_rule`` (:data:`CONFIG_KEY`): the loader sets each family's default
(LLaDA and the bundled model ``llada``, Dream ``dream``), and a checkpoint's ``config.json`` may name
another. A config without the attribute has the ``llada`` rule.

``llada``: Fast-dLLM's rule for LLaDA, DiLaServe's own. Every step, a block's first forward included,
commits the block's masked positions whose confidence is above the threshold, and at least the most
confident one. A cache step's window starts at the output that predicts the block's first position:
the block's first position itself, or for a model with shifted logits (Dream: position ``p`` is
predicted by the output at ``p - 1``) the position before it.

``dream``: Fast-dLLM's rule for Dream (``dream/model/generation_utils_block.py`` in NVlabs/Fast-dLLM,
threshold decoding with its prefix and dual caches):

* a step at which the block's first position is still masked (the block's first forward, always a
  full forward) commits that position only, whatever the threshold: its token is the prediction of the
  output at the position before it (for the first block, the prompt's last position);
* every other step of the block commits the block's masked positions whose confidence is *at least*
  the threshold, and at least the most confident one;
* a cache step's window starts at the block's first position (prefix cache: the block and everything
  after it, against the cached keys and values before the block; dual cache: the block, against the
  cached rest), so the window's output at position ``p`` predicts position ``p + 1``; the block's first
  position, committed at the block's first forward, needs no prediction, and the window's last output
  predicts nothing in the block.

Without a cache every step is a full forward, and the same two commit cases apply. Candidates and
confidences are the engine's in both rules (the mask token never an answer; sampling as
``services/worker/decoding/sampling.py`` draws). Fast-dLLM's own loop also runs one cache forward after the
block's first forward when a block of one position is already complete; that forward commits nothing,
and neither the reference nor the engine runs it.

A step's candidates (``greedy_candidates``): at each position, the likeliest token (the mask token
excluded: it is never an answer) and its probability, the float32 softmax of the logits at that token
whatever the model's dtype (LLaDA's and Fast-dLLM's decoders take ``F.softmax(logits.to(torch.float64))``,
which agrees with it to about 1e-7: a threshold decision could differ only for a probability that close
to it). A sampled request draws its candidates instead (``services/worker/decoding/sampling.py``).

In both forms the rule commits every still-masked position of the block whose candidate's probability
is above the request's threshold (at least the threshold, under Dream's rule: ``DecodingRule.inclusive``),
and at least the most confident one (the first, on a tie). Which positions may be committed at all is
the rule's too (``commit_eligible``): Dream's commits a block's first position alone at the block's
first forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

import numpy as np
import torch


class DecodingRule(StrEnum):
    LLADA = "llada"  # threshold at every step; a shifted model's windows start one position early
    DREAM = "dream"  # the block's first position alone at its first forward; windows start at the block

    @property
    def inclusive(self) -> bool:
        """A probability equal to the threshold passes (Dream's rule); otherwise it must be above it."""
        return self is DecodingRule.DREAM


CONFIG_KEY = "decoding_rule"  # the model config's attribute (and config.json's field)
DEFAULT_RULE = DecodingRule.LLADA  # a config without the attribute


def decoding_rule(config) -> DecodingRule:
    """The rule of a model config (``DEFAULT_RULE`` when it names none); ``ValueError`` naming the field
    when it names an unknown one."""
    return parse_rule(getattr(config, CONFIG_KEY, None) or DEFAULT_RULE)


def parse_rule(value) -> DecodingRule:
    """A rule by name; ``ValueError`` naming the field and the rules there are."""
    try:
        return DecodingRule(value)
    except ValueError:
        known = ", ".join(repr(r.value) for r in DecodingRule)
        raise ValueError(f"field '{CONFIG_KEY}' is {value!r}; expected one of {known}") from None


def cache_window_start(rule: DecodingRule, block_start: int, logits_shift: int) -> int:
    """Absolute position of a cache step's first fresh token, for a block starting at absolute position
    ``block_start``."""
    return block_start if rule is DecodingRule.DREAM else block_start - logits_shift


def greedy_candidates(logits: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(probability float64, token) of each row's likeliest token, the mask token excluded."""
    rows = logits.float()  # a copy: the mask column is overwritten
    rows[:, mask_id] = float("-inf")
    # float32 softmax (one fused kernel): of bf16/fp16 logits, within about 1e-7 of the reference decoders'
    # float64 softmax, far below the logits' own precision; a float64 pass costs several times more on a CPU
    confidence, tokens = torch.softmax(rows, dim=-1).max(dim=-1)
    return confidence.double(), tokens


def commit_eligible(rule: DecodingRule, masked: np.ndarray, row_starts: Sequence[int],
                    block_sizes: Sequence[int]) -> np.ndarray:
    """Which block rows of a batch the rule may commit, from ``masked`` [R] (the position is still masked;
    changed in place): each request's rows ``[row_starts[i], row_starts[i] + block_sizes[i])``. Under
    Dream's rule a block whose first position is still masked commits that position alone."""
    if rule is DecodingRule.DREAM:
        for start, size in zip(row_starts, block_sizes, strict=True):
            if masked[start]:
                masked[start + 1 : start + size] = False
    return masked


def commit_mask(confidence: torch.Tensor, eligible: torch.Tensor, thresholds: torch.Tensor,
                block_rows: torch.Tensor, inclusive: bool = False) -> torch.Tensor:
    """The rule for a whole batch at once, no loop over requests and no read-back.

    ``confidence`` [R] float64 and ``eligible`` [R] bool (``commit_eligible``) for every block row of the
    batch; ``thresholds`` [R] each row's request's threshold; ``block_rows`` [B, L] the block rows of each
    request in position order (``R`` where a request has fewer than ``L``); ``inclusive``: a probability
    equal to the threshold passes (``DecodingRule.inclusive``). Returns [R] bool.
    """
    scored = torch.where(eligible, confidence, torch.full_like(confidence, -1.0))
    padded = torch.cat((scored, scored.new_full((1,), -2.0)))[block_rows]  # [B, L]: -2 past a request's rows
    best = block_rows.gather(1, padded.argmax(dim=1, keepdim=True))[:, 0]  # the first most confident row
    passes = confidence >= thresholds if inclusive else confidence > thresholds
    commit = torch.cat((eligible & passes, eligible.new_zeros(1)))
    commit[best] = commit[best] | (padded.max(dim=1).values >= 0)  # a request with no masked row: none
    return commit[:-1]


def select_commits(rule: DecodingRule, confidences: torch.Tensor, threshold: float,
                   block_start_masked: bool) -> torch.Tensor:
    """The rule for one request (the reference decoder's form of ``commit_mask``): indices into
    ``confidences`` (one per masked block position, in position order) that a step commits;
    ``block_start_masked``: the block's first position is among them (then it is the first)."""
    if rule is DecodingRule.DREAM and block_start_masked:
        return torch.zeros(1, dtype=torch.long)
    chosen = confidences >= threshold if rule.inclusive else confidences > threshold
    chosen[torch.argmax(confidences)] = True
    return torch.nonzero(chosen).flatten()
