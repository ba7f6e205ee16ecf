"""One `dls calibrate` run: its validated inputs (``Setup``) and what it loads once for every stage
(``Session``: the engine on the device, the tokenizer as the gateway wraps it, the prompts as token ids)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from calibrate.bundle import Bundle
from calibrate.progress import Progress
from calibrate.prompts import EncodedPrompt, PromptSpec, encode, load_codec, median_length
from calibrate.scorers import Scorer
from shared.calibration import device_kind, tokenizer_fingerprint, weights_fingerprint

# The bundled model's task families without --prompts: the mix `dls collect-traces` traces
TASK_FAMILY_WEIGHTS = {"add": 0.35, "words": 0.35, "chain": 0.3}
TASK_MAX_SHOTS = 8


@dataclass
class Setup:
    """What the arguments ask, checked (nothing loaded on the device yet)."""

    model_dir: Path
    device: str
    tp: tuple[int, ...]
    stages: tuple[str, ...]
    thresholds: tuple[float, ...]  # ascending
    bundle: Bundle
    bundled: bool  # the bundled model: its task families stand in for --prompts and --eval
    prompt_specs: list[PromptSpec] | None  # --prompts
    prompts_digest: str | None
    eval_specs: list[PromptSpec] | None  # --eval
    eval_digest: str | None
    scorer: Scorer | None
    max_batch: int
    repeats: int
    batch_size: int  # requests decoded together (traces, quality)
    max_prompts: int
    max_eval: int
    heldout_fraction: float
    switch_fraction: float
    seed: int
    cache_modes: tuple[str, ...]
    prompt_tokens: int | None  # the profile's prompt length (None: the prompts' median, else the canvas)
    threads: int
    rounds: int | None
    gen_lengths: tuple[int, ...]  # traces: canvases drawn per request (empty: each prompt's)
    block_lengths: tuple[int, ...]
    trust_remote_code: bool
    command: str
    args: dict = field(default_factory=dict)

    @property
    def prompts_source(self) -> str:
        if self.prompt_specs is not None:
            return f"prompts file {self.prompts_digest}"
        return "task families" if self.bundled else "none"


class Session:
    """Loads what the stages share, once, when the first stage needs it."""

    def __init__(self, setup: Setup, progress: Progress) -> None:
        self.setup = setup
        self.progress = progress

    # --- identity (cheap: no weights loaded) ------------------------------------------------------

    @cached_property
    def identity(self) -> dict:
        """What every stage's key holds: the weights, the tokenizer and the kind of device."""
        return {"weights": weights_fingerprint(self.setup.model_dir),
                "tokenizer": tokenizer_fingerprint(self.setup.model_dir),
                "device": device_kind(self.setup.device)}

    # --- the engine ---------------------------------------------------------------------------------

    @cached_property
    def engine(self):
        from services.worker.engine.engine import DLMEngine

        self.progress.note(f"loading {self.setup.model_dir} on {self.setup.device}")
        engine = DLMEngine.from_pretrained(self.setup.model_dir, device=self.setup.device)
        self.progress.note(f"loaded: {engine.model.dtype}, attention {engine.attention.value}, canvas "
                           f"{engine.default_gen_length} in blocks of {engine.default_block_length}")
        return engine

    def made_for(self) -> dict:
        import torch

        from services.worker.profiling import device_name
        from shared.calibration import made_for

        engine = self.engine
        return made_for(self.setup.model_dir, self.setup.device, device_name(self.setup.device),
                        str(engine.model.dtype).removeprefix("torch."), torch.__version__.split("+")[0],
                        engine.attention.value)

    # --- prompts ------------------------------------------------------------------------------------

    @cached_property
    def codec(self):
        return load_codec(self.setup.model_dir, self.setup.trust_remote_code)

    @cached_property
    def limits(self):
        from shared.generation import read_generation_limits

        return read_generation_limits(self.setup.model_dir)

    def _encode(self, specs: list[PromptSpec], what: str) -> list[EncodedPrompt]:
        kept, left_out = encode(specs, self.codec, self.limits, self.engine.model.config.max_sequence_length)
        if left_out:
            shown = "; ".join(left_out[:3]) + (f" and {len(left_out) - 3} more" if len(left_out) > 3 else "")
            self.progress.say(f"{what}: left out {len(left_out)} of {len(specs)} ({shown})")
        return kept

    @cached_property
    def user_prompts(self) -> list[EncodedPrompt]:
        """The --prompts prompts that fit the model, at most --max-prompts of them (a seeded sample)."""
        specs = list(self.setup.prompt_specs or [])
        if len(specs) > self.setup.max_prompts:
            specs = sorted(random.Random(self.setup.seed).sample(specs, self.setup.max_prompts), key=lambda s: s.line)
        return self._encode(specs, "--prompts")

    def prompt_split(self) -> tuple[list[EncodedPrompt], list[EncodedPrompt]]:
        """(train, held out): --prompts shuffled with the seed and cut, or the task families' two splits."""
        if self.setup.prompt_specs is None:
            return self.task_prompts("train"), self.task_prompts("held_out")
        prompts = list(self.user_prompts)
        random.Random(self.setup.seed).shuffle(prompts)
        num_heldout = max(1, round(len(prompts) * self.setup.heldout_fraction))
        return prompts[num_heldout:], prompts[:num_heldout]

    def task_prompts(self, split: str) -> list[EncodedPrompt]:
        """The bundled model's task problems of one split (the predictor's share of --max-prompts)."""
        count = round(self.setup.max_prompts * (self.setup.heldout_fraction if split == "held_out"
                                                 else 1 - self.setup.heldout_fraction))
        return self._task_problems(count, split, TASK_FAMILY_WEIGHTS, TASK_MAX_SHOTS, self.setup.seed)

    def task_eval(self) -> list[EncodedPrompt]:
        """Labelled held-out task problems (the bundled model without --eval), a seed of their own."""
        return self._task_problems(self.setup.max_eval, "held_out", TASK_FAMILY_WEIGHTS, TASK_MAX_SHOTS,
                                   self.setup.seed + 7919)

    def _task_problems(self, count: int, split: str, weights: dict, max_shots: int, seed: int) -> list[EncodedPrompt]:
        from shared.tasks import Family, Split, TaskGenerator

        generator = TaskGenerator(seed, family_weights={Family(f): w for f, w in weights.items()})
        problems = generator.problems(count, max_shots, split=Split(split))
        canvas = self.limits.gen_length
        return [EncodedPrompt(i, "task", tuple(self.codec.encode(p.prompt)), canvas, None, p.answer, str(p.family), p)
                for i, p in enumerate(problems, 1)]

    @cached_property
    def eval_problems(self) -> list[EncodedPrompt]:
        specs = list(self.setup.eval_specs or [])
        if len(specs) > self.setup.max_eval:
            specs = sorted(random.Random(self.setup.seed).sample(specs, self.setup.max_eval), key=lambda s: s.line)
        return self._encode(specs, "--eval")

    def profile_prompt_tokens(self) -> tuple[int, str]:
        """The prompt length the profile's context is anchored at, and where it comes from."""
        if self.setup.prompt_tokens:
            return self.setup.prompt_tokens, "--prompt-tokens"
        if self.setup.prompt_specs is not None and self.user_prompts:
            return median_length(self.user_prompts), "the median prompt of --prompts"
        if self.setup.bundled:
            train, heldout = self.prompt_split()
            return median_length(train + heldout), "the median task prompt"
        return self.limits.gen_length, "the canvas (no --prompts)"


def is_bundled(model_dir: Path) -> bool:
    """The bundled model (or a copy of it): its config and character tokenizer, and the task prompts
    servable by that tokenizer."""
    from shared.tasks import Split, TaskGenerator
    from shared.tokenizer import TOKENIZER_FILE, CharTokenizer

    try:
        config = json.loads((model_dir / "config.json").read_text())
        if config.get("model_type") != "dls-dlm" or json.loads((model_dir / TOKENIZER_FILE).read_text()).get(
                "type") != "char":
            return False
        tokenizer = CharTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, AttributeError):
        return False
    problems = TaskGenerator(0, family_weights=None).problems(20, TASK_MAX_SHOTS, split=Split.HELD_OUT)
    return all(tokenizer.can_encode(p.prompt + p.answer) for p in problems)
