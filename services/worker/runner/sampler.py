"""From a step's logits to what it commits, on the device, for the whole batch: candidates (greedy, or
drawn where a request samples), the commit rule (``services/worker/decoding/rule.py``), the top
candidates where a request asks for logprobs, all in **one** float64 packet that the runner copies
back in one transfer (each block row's probability, token and commit flag; tokens of the lookahead
rows; top candidates where asked).
"""

from __future__ import annotations

import numpy as np
import torch

from services.worker.decoding.rule import commit_mask, greedy_candidates
from services.worker.decoding.sampling import sample, top_candidates
from services.worker.runner.batch import ForwardBatch, StepOutput


def step_packet(logits: torch.Tensor, batch: ForwardBatch, arrays: dict[str, torch.Tensor],
                mask_id: int) -> torch.Tensor:
    """The step's results as one float64 tensor on the device (``arrays``: its commit inputs' device
    views); :func:`read_packet` reads it back."""
    rb = batch.num_block_rows
    confidence, tokens = greedy_candidates(logits, mask_id)
    block_logits = logits[:rb]
    for s in batch.sampled:  # requests that draw: their rows' candidates replaced by the draws
        rows = block_logits[s.start : s.end].double()
        rows[:, mask_id] = float("-inf")
        drawn_conf, drawn = sample(rows, s.params, s.seed)
        confidence[s.start : s.end] = drawn_conf
        tokens[s.start : s.end] = drawn
    eligible = arrays["eligible"].bool()
    thresholds = arrays["thresholds"].view(torch.float64)
    commit = commit_mask(confidence[:rb], eligible, thresholds, arrays["block_rows"], batch.rule.inclusive)
    parts = [confidence[:rb], tokens.double(), commit.double()]
    k = max((t.k for t in batch.top), default=0)
    if k:
        masked = block_logits.index_select(0, arrays["top_rows"]).double()
        masked[:, mask_id] = float("-inf")
        ids, probs = top_candidates(masked, k)
        parts += [ids.double().reshape(-1), probs.double().reshape(-1)]
    return torch.cat(parts)


def read_packet(packet: np.ndarray, batch: ForwardBatch) -> StepOutput:
    """The host's :class:`StepOutput` of a packet :func:`step_packet` made for ``batch``."""
    rb, r = batch.num_block_rows, len(batch.logit_rows)
    out = StepOutput(packet[:rb].tolist(), packet[rb : rb + r].astype(np.int64).tolist(),
                     (packet[rb + r : rb + r + rb] > 0.5).tolist())
    k = max((t.k for t in batch.top), default=0)
    if k:
        top_rows = [row for t in batch.top for row in range(t.start, t.end)]
        width = len(top_rows) * k
        ids = packet[2 * rb + r : 2 * rb + r + width].astype(np.int64).reshape(len(top_rows), k)
        probs = packet[2 * rb + r + width : 2 * rb + r + 2 * width].reshape(len(top_rows), k)
        keep = {row: t.k for t in batch.top for row in range(t.start, t.end)}
        out.top = {row: (ids[i, : keep[row]].tolist(), probs[i, : keep[row]].tolist())
                   for i, row in enumerate(top_rows)}
    return out
