"""What ``max_tokens`` means for a diffusion model, in one place for the gateway, the engine and the worker.

A DLM decodes a canvas of mask tokens block by block, left to right, and stops at the first block
that completes an EOS (the rest of the canvas is EOS padding, never decoded). ``max_tokens`` is a cap
on the answer, never a change of it:

* the canvas is ``max_tokens`` rounded up to the block length (a block is decoded whole), and at
  most the model's longest canvas (``max_canvas``: what its model card promises to answer the same
  at; a longer request gets that canvas and, without an EOS in it, ``finish_reason: "length"``);
* the answer is the canvas up to its first EOS, cut at ``max_tokens``: ``finish_reason`` is
  ``"stop"`` when an EOS came within the cap, ``"length"`` otherwise;
* ``ignore_eos`` (benchmark clients send it) decodes the whole canvas; the answer is then the first
  ``max_tokens`` positions, EOS padding included (it renders as nothing), and always ``"length"``;
* ``stop`` strings end the answer before the first of them (``"stop"``), as soon as the committed
  prefix holds one: the engine finishes the request there and records the answer's length in tokens
  (``stop_length``), the longest prefix of the answer whose text ends before the stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

STOP = "stop"
LENGTH = "length"


class Answer(NamedTuple):
    """The tokens a finished canvas answers with, and why it ended."""

    token_ids: list[int]
    finish_reason: str  # STOP (EOS within the cap) or LENGTH (the cap, or ignore_eos)


def canvas_length(max_tokens: int, block_length: int, max_canvas: int) -> int:
    """The canvas for a ``max_tokens`` cap: rounded up to whole blocks, at most ``max_canvas``."""
    if max_tokens < 1 or block_length < 1 or max_canvas < 1:
        raise ValueError(f"max_tokens ({max_tokens}), block_length ({block_length}) and max_canvas "
                         f"({max_canvas}) must be positive")
    return min(-(-max_tokens // block_length) * block_length, max_canvas)


def answer_of(canvas: Sequence[int], eos_id: int | None, max_tokens: int | None = None,
              ignore_eos: bool = False, stop_length: int | None = None) -> Answer:
    """The answer of a finished canvas (``max_tokens`` None: the whole canvas is allowed;
    ``stop_length``: a stop string ended the answer after that many tokens)."""
    cap = len(canvas) if max_tokens is None else min(max_tokens, len(canvas))
    if stop_length is not None and stop_length <= cap:
        return Answer(list(canvas[:stop_length]), STOP)
    tokens = list(canvas[:cap])
    if ignore_eos:
        return Answer(tokens, LENGTH)
    if eos_id is not None and eos_id in tokens:
        return Answer(tokens[: tokens.index(eos_id)], STOP)
    return Answer(tokens, LENGTH)


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first of ``stops`` (empty strings ignored) begins in ``text``; None when none occurs."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


def stop_length(token_ids: Sequence[int], decode: Callable[[list[int]], str], stops: Sequence[str]) -> int | None:
    """The number of leading tokens of an answer that a stop string ends: the longest prefix whose text
    ends before the first stop string begins; None when the text holds none."""
    if not stops:
        return None
    tokens = list(token_ids)
    at = find_stop(decode(tokens), stops)
    if at is None:
        return None
    lo, hi = 0, len(tokens)  # the longest prefix whose text is at most `at` characters
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(decode(tokens[:mid])) <= at:
            lo = mid
        else:
            hi = mid - 1
    return lo


def stream_release(answer_so_far: int, stops: Sequence[str], finished: bool) -> int:
    """How many answer tokens a stream may show: all once finished; before that, all but the last
    ``longest stop - 1`` (each at least one character), which a stop string completed later could
    still take back."""
    if finished or not stops:
        return answer_so_far
    return max(answer_so_far - (max((len(s) for s in stops), default=1) - 1), 0)


# --- a model's generation limits -----------------------------------------------------------------

GENERATION_FILE = "training_info.json"  # its ``train_config`` holds the bundled model's lengths
FALLBACK_GEN_LENGTH = 256  # LLaDA's evaluation setting: the canvas of a request without max_tokens
FALLBACK_BLOCK_LENGTH = 32


class GenerationLimits(NamedTuple):
    """How a model is meant to be decoded: its default canvas and block, and its longest canvas."""

    gen_length: int  # canvas of a request that sets no max_tokens
    block_length: int  # block length of a request that sets none
    max_gen_length: int | None  # longest canvas the model answers the same at; None: the context's bound

    def canvas(self, max_tokens: int | None, block_length: int, operator_cap: int | None = None) -> int:
        """The canvas of a request (``max_tokens`` None: the default), within every bound that applies."""
        bounds = [b for b in (self.max_gen_length, operator_cap) if b is not None]
        top = min(bounds) if bounds else 1 << 30
        return canvas_length(self.gen_length if max_tokens is None else max_tokens, block_length, top)


def read_generation_limits(directory, fallback: GenerationLimits | None = None) -> GenerationLimits:
    """The limits in ``directory``'s ``training_info.json`` (``train_config``), else ``fallback``.

    The bundled model records ``gen_length``, ``block_length`` and ``max_gen_length`` there; public
    checkpoints have no such file and get LLaDA's setting (256 in blocks of 32, bounded by the
    context). Raises ``ValueError`` naming the file when the lengths are unusable.
    """
    import json
    from pathlib import Path

    fallback = fallback or GenerationLimits(FALLBACK_GEN_LENGTH, FALLBACK_BLOCK_LENGTH, None)
    path = Path(directory) / GENERATION_FILE
    try:
        train = json.loads(path.read_text()).get("train_config", {})
    except FileNotFoundError:
        return fallback
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a JSON object with a train_config ({exc})") from None
    try:
        gen_length = int(train.get("gen_length", fallback.gen_length))
        block_length = int(train.get("block_length", fallback.block_length))
        # a model trained on one canvas only (no max_gen_length recorded) promises nothing longer
        max_gen_length = int(train.get("max_gen_length", gen_length))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: bad train_config lengths ({exc})") from None
    if min(gen_length, block_length, max_gen_length) < 1:
        raise ValueError(f"{path}: train_config lengths must be positive")
    return GenerationLimits(min(gen_length, max_gen_length), block_length, max_gen_length)
