"""The decoding rule of a model family: which block positions a denoising step commits, and where a
cache step's fresh window starts.

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
"""

from __future__ import annotations

from enum import StrEnum

import torch


class DecodingRule(StrEnum):
    LLADA = "llada"  # threshold at every step; a shifted model's windows start one position early
    DREAM = "dream"  # the block's first position alone at its first forward; windows start at the block


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


def select_commits(rule: DecodingRule, confidences: torch.Tensor, threshold: float,
                   block_start_masked: bool) -> torch.Tensor:
    """Indices into ``confidences`` (one per masked block position, in position order) that a step
    commits; ``block_start_masked``: the block's first position is among them (then it is the first)."""
    if rule is DecodingRule.DREAM and block_start_masked:
        return torch.zeros(1, dtype=torch.long)
    chosen = confidences >= threshold if rule is DecodingRule.DREAM else confidences > threshold
    chosen[torch.argmax(confidences)] = True
    return torch.nonzero(chosen).flatten()
