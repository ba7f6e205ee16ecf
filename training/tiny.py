"""Training the bundled model with the masked-diffusion objective, on CPU, resumably.

The answer is padded with EOS to a canvas whose length is drawn per batch (from one block to
``max_gen_length``), as LLaDA's SFT pads its answers: the model learns to write the same answer,
then EOS, whatever room the canvas leaves, which is what lets a server turn any ``max_tokens`` into a
canvas without changing the answer. A share of the canvases (``truncate_share``) is shorter than some
answers, which are then cut to the canvas with no EOS: a client's cap below the answer's length gets
the answer's first tokens, not a different, shorter answer.

Each row is masked one of two ways:

* *uniform* (LLaDA's objective): t ~ U(eps, 1); every canvas position is masked with probability t
  (the prompt never); its masked positions' cross-entropy is weighted by 1/t;
* *semi-autoregressive* (``semi_ar_share`` of the rows): a block length and a block are drawn; the
  canvas before the block is clean, the block is masked with probability t (weighted 1/t), and
  everything after it is masked (weight 1): the states that block-wise decoding actually visits,
  a clean prefix and a fully masked suffix, which uniform masking of a long canvas almost never shows.
  A share of those rows (``confidence_mask_share``) masks the block in the order a threshold step
  commits it: a forward without gradients on the fully masked block gives the model's confidence at
  each position; those above a threshold drawn from [0.5, 0.95] are shown (with their true tokens),
  and the rest are masked with probability t. Random masking of a long block almost never shows
  "everything the model is sure of is there, the uncertain positions are not", which is the state a
  low threshold reaches after one step, and where a model trained only on random masks is
  over-confident about positions that depend on still-masked ones. With ``probe_weight``, the probe
  state itself (the block fully masked: where a threshold step starts, and where a low threshold
  commits its mistakes) is trained too, its over-confident errors (the argmax wrong at a confidence
  above the lowest threshold served, 0.5) weighted ``1 + overconfident_boost`` times: what a low
  threshold commits on the first step of a block is what must be right.

The loss is averaged over the canvas positions of the batch. Batches share one few-shot count and one
canvas length, so they carry little padding; ``chain_share`` of the batches hold the long family.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from services.worker.model.dlm import DLMConfig, DLMForMaskedDiffusion
from shared.tasks import (
    CHAIN_MIN_ITEMS,
    Family,
    Problem,
    Split,
    TaskGenerator,
    chain_answer_length,
    check_answer,
)
from shared.tokenizer import CharTokenizer

MASK_EPS = 1e-3
SEMI_AR_BLOCK_LENGTHS = (4, 8, 16, 32)  # block lengths drawn for semi-autoregressive rows
CONFIDENCE_MASK_THRESHOLDS = (0.5, 0.95)  # the threshold a confidence-ordered row is shown at: uniform
# Sums of two 3-digit numbers have at most 4 digits. The model writes them right-aligned in a field
# of this width, filled on the left with <pad> (which the tokenizer renders as nothing): every digit
# then has a fixed place relative to "=" whatever the carry out of the top digit, instead of its place
# depending on the answer's length, which is decided by the whole carry chain.
ADD_ANSWER_WIDTH = 4


@dataclass
class TrainConfig:
    output_dir: str = "models/dls-tiny"
    checkpoint_dir: str = "runs/train-dls-tiny"
    steps: int = 6000
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 200
    weight_decay: float = 0.01
    gen_length: int = 128  # the default canvas of requests that set no max_tokens (exported)
    block_length: int = 8  # the default block length (exported)
    max_gen_length: int = 128  # the longest canvas trained on: what the model card promises
    max_shots: int = 8
    add_share: float = 0.5  # share of arithmetic queries in short batches (the rest: the word task)
    chain_share: float = 0.4  # share of batches holding the long family (chain)
    semi_ar_share: float = 0.5  # share of rows masked semi-autoregressively (clean prefix, masked suffix)
    # short batches' canvas: at most 32 with this probability, else up to max_gen_length (uniform)
    short_canvas_share: float = 0.5
    # short batches' canvas: the longest answer rounded up to the block with this probability (before
    # short_canvas_share's draw): the tight canvas a max_tokens of 16 gives, where the answer fills it
    tight_canvas_share: float = 0.0
    truncate_share: float = 0.1  # batches whose canvas may be shorter than answers (cut, no EOS)
    # few-shot count k is drawn with weight shot_weights[k]: mostly short prompts (cheap), all seen
    shot_weights: list[float] = field(default_factory=lambda: [8, 4, 2, 1, 1, 1, 1, 1, 1])
    d_model: int = 192
    n_layers: int = 6
    n_heads: int = 6
    mlp_hidden_size: int = 512
    seed: int = 0
    eval_every: int = 500
    eval_problems: int = 64
    save_every: int = 250
    threads: int = 0  # 0: torch's default
    # start from these weights (a model directory) with a fresh optimizer and schedule, when there is
    # no checkpoint to resume: how a later session continues from the shipped model alone
    init_from: str = ""
    chain_length_bias: float = 0.0  # chains of n items drawn with weight n ** bias (TaskGenerator)
    # block lengths of semi-AR rows in chain batches (short batches: SEMI_AR_BLOCK_LENGTHS)
    chain_block_lengths: list[int] = field(default_factory=lambda: list(SEMI_AR_BLOCK_LENGTHS))
    confidence_mask_share: float = 0.0  # share of semi-AR rows masked in confidence order (docstring)
    # those rows' probe state (block fully masked) trained with this weight, its over-confident errors
    # with 1 + overconfident_boost of it (diffusion_loss)
    probe_weight: float = 0.0
    overconfident_boost: float = 0.0


# share of semi-autoregressive rows that decode the first block: the one state where nothing of the
# answer is on the canvas and everything must come from the prompt; uniform masking never shows it on
# a long canvas, and a uniform draw of the block shows it rarely (a chain model then read its length
# off visible EOS padding instead of the query)
FIRST_BLOCK_SHARE = 0.3
# and the block that holds the answer's end, where the model must decide to stop (a chain ends at the
# item the query's letter names): a uniform draw over a long answer's blocks shows it rarely too
END_BLOCK_SHARE = 0.3


def target_ids(problem: Problem, tokenizer: CharTokenizer) -> list[int]:
    """What the model learns to write on the canvas for ``problem``: the answer, then EOS."""
    ids = tokenizer.encode(problem.answer)
    if problem.family is Family.ADD:
        ids = [tokenizer.pad_token_id] * (ADD_ANSWER_WIDTH - len(ids)) + ids
    return ids + [tokenizer.eos_token_id]


def encode_batch(problems: list[Problem], tokenizer: CharTokenizer, gen_length: int, truncate: bool = False):
    """Left-padded ids [B, L], attention mask, and the answer region mask (answer + EOS padding).

    ``truncate``: an answer longer than the canvas is cut to it (no EOS); otherwise it is an error.
    """
    rows = []
    for p in problems:
        answer = target_ids(p, tokenizer)
        if len(answer) > gen_length and truncate:
            answer = answer[:gen_length]
        elif len(answer) > gen_length:
            raise ValueError(f"answer {p.answer!r} does not fit generation length {gen_length}")
        rows.append((tokenizer.encode(p.prompt), answer + [tokenizer.eos_token_id] * (gen_length - len(answer))))
    width = max(len(prompt) for prompt, _ in rows) + gen_length
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (prompt, answer) in enumerate(rows):
        seq = prompt + answer
        ids[i, width - len(seq) :] = torch.tensor(seq)
        attention[i, width - len(seq) :] = True
    answer_region = torch.zeros_like(attention)
    answer_region[:, width - gen_length :] = True
    return ids, attention, answer_region


def diffusion_loss(model, ids, attention, answer_region, mask_id: int, generator: torch.Generator,
                   semi_ar_share: float = 0.0, answer_lengths: list[int] | None = None,
                   block_lengths: tuple[int, ...] = SEMI_AR_BLOCK_LENGTHS, confidence_mask_share: float = 0.0,
                   probe_weight: float = 0.0, overconfident_boost: float = 0.0):
    """The masked-diffusion loss of one batch (see the module docstring for the masking modes).

    ``answer_lengths``: tokens of each row's answer before its EOS padding (semi-AR rows draw their
    block among those holding the answer and the one after it); default: the whole canvas.
    ``block_lengths``: the block lengths semi-AR rows draw from.
    ``probe_weight``: the confidence-ordered rows' probe state (their block fully masked, the state a
    threshold step starts from) is trained too, with this weight, and its over-confident errors (argmax
    wrong at a confidence above the lowest threshold served) with ``1 + overconfident_boost`` of it.
    """
    batch, width = ids.shape
    t = torch.rand(batch, 1, generator=generator) * (1 - MASK_EPS) + MASK_EPS
    draws = torch.rand(ids.shape, generator=generator)
    masked = (draws < t) & answer_region
    weights = (1.0 / t).expand_as(ids).clone()
    gen_length = int(answer_region[0].sum())
    canvas_start = width - gen_length
    semi_ar = torch.rand(batch, generator=generator) < semi_ar_share
    ordered: list[tuple[int, int, int]] = []  # (row, first, end) columns of confidence-ordered blocks
    for row in torch.nonzero(semi_ar).flatten().tolist():
        length = gen_length if answer_lengths is None else answer_lengths[row]
        block_start, block_end = _semi_ar_block(gen_length, length, generator, block_lengths)
        masked[row, canvas_start : canvas_start + block_start] = False
        masked[row, canvas_start + block_end :] = True
        weights[row, canvas_start + block_end :] = 1.0
        if confidence_mask_share and float(torch.rand(1, generator=generator)) < confidence_mask_share:
            ordered.append((row, canvas_start + block_start, canvas_start + block_end))
    probe_loss = torch.zeros(())
    if ordered:
        probe_loss = _mask_in_confidence_order(model, ids, attention, masked, t, ordered, mask_id, generator,
                                               probe_weight, overconfident_boost)
    noisy = torch.where(masked, torch.full_like(ids, mask_id), ids)
    logits = model(noisy, attention_mask=attention).logits
    token_loss = F.cross_entropy(logits[masked].float(), ids[masked], reduction="none")
    return ((token_loss * weights[masked]).sum() + probe_loss) / answer_region.sum()


def _mask_in_confidence_order(model, ids, attention, masked, t, ordered, mask_id: int,
                              generator: torch.Generator, probe_weight: float = 0.0,
                              overconfident_boost: float = 0.0) -> torch.Tensor:
    """Re-mask each ``ordered`` block as a threshold step leaves it (module docstring): positions the
    model is sure of on the fully masked block shown, the rest masked with probability t. Returns the
    probe state's summed, weighted loss (``diffusion_loss``'s ``probe_weight``; zero without it)."""
    rows = [row for row, _, _ in ordered]
    probe = torch.where(masked[rows], torch.full_like(ids[rows], mask_id), ids[rows])
    for i, (_, first, end) in enumerate(ordered):
        probe[i, first:end] = mask_id
    with torch.set_grad_enabled(probe_weight > 0 and torch.is_grad_enabled()):
        logits = model(probe, attention_mask=attention[rows]).logits.float()
    probabilities = logits.detach().softmax(-1)
    confidence, guess = probabilities.max(-1)
    low, high = CONFIDENCE_MASK_THRESHOLDS
    probe_loss = torch.zeros(())
    for i, (row, first, end) in enumerate(ordered):
        if probe_weight > 0:
            truth = ids[row, first:end]
            wrong = (guess[i, first:end] != truth) & (confidence[i, first:end] > low)
            weight = probe_weight * (1.0 + overconfident_boost * wrong.float())
            probe_loss = probe_loss + (F.cross_entropy(logits[i, first:end], truth, reduction="none") * weight).sum()
        threshold = low + (high - low) * float(torch.rand(1, generator=generator))
        sure = confidence[i, first:end] > threshold
        remasked = torch.rand(end - first, generator=generator) < float(t[row])
        masked[row, first:end] = ~sure & remasked
    return probe_loss


def _semi_ar_block(gen_length: int, answer_length: int, generator: torch.Generator,
                   block_lengths: tuple[int, ...] = SEMI_AR_BLOCK_LENGTHS) -> tuple[int, int]:
    """Canvas bounds of the block a semi-AR row decodes: one holding the answer, or the one after it."""
    block_length = block_lengths[int(torch.randint(len(block_lengths), (1,), generator=generator))]
    num_blocks = -(-gen_length // block_length)
    last = min(num_blocks - 1, answer_length // block_length + 1)
    draw = float(torch.rand(1, generator=generator))
    if draw < FIRST_BLOCK_SHARE:
        block = 0
    elif draw < FIRST_BLOCK_SHARE + END_BLOCK_SHARE:
        block = min(num_blocks - 1, max(answer_length - 1, 0) // block_length)  # the block with the EOS
    else:
        block = int(torch.randint(last + 1, (1,), generator=generator))
    return block * block_length, min(gen_length, (block + 1) * block_length)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# (name, family, canvas, block length, threshold or None for evaluate's, cache mode) evaluated during
# training: the short families at the old canvas and at the longest one (the answer must not change),
# the long family at blocks of 16 and 32, at the threshold given and, served as it is (dual cache),
# at 0.7, where its accuracy must stay that of 0.9, and at 0.6 in blocks of 32, where it falls off its
# cliff; and the word lists on the tight 16-token canvas at 0.7, where coupled categories broke before
# stage 7
EVAL_SETTINGS: tuple[tuple[str, Family, int, int, float | None, str], ...] = (
    ("add@16", Family.ADD, 16, 8, None, "none"), ("add@128", Family.ADD, 128, 8, None, "none"),
    ("words@16", Family.WORDS, 16, 8, None, "none"), ("words@128", Family.WORDS, 128, 8, None, "none"),
    ("words@16 0.7", Family.WORDS, 16, 8, 0.7, "none"),
    ("chain@128", Family.CHAIN, 128, 16, None, "none"), ("chain@128/32", Family.CHAIN, 128, 32, None, "none"),
    ("chain@128/16 0.7 dual", Family.CHAIN, 128, 16, 0.7, "dual"),
    ("chain@128/32 0.7 dual", Family.CHAIN, 128, 32, 0.7, "dual"),
    ("chain@128/32 0.6 dual", Family.CHAIN, 128, 32, 0.6, "dual"),
)


def evaluate(model, tokenizer, cfg: TrainConfig, threshold: float = 0.9, seed: int = 12345) -> dict:
    """Validity / exact match and mean steps on held-out problems per setting (``EVAL_SETTINGS``;
    without a cache, batched: the reference path's tokens, which tests hold it to, unless a setting
    names the dual cache)."""
    from services.worker.engine.engine import CacheMode, DLMEngine

    model.eval()
    engine = DLMEngine(model, tokenizer)
    per_setting = {}
    count = max(1, cfg.eval_problems // len(EVAL_SETTINGS))
    for name, family, gen_length, block_length, tau, cache in EVAL_SETTINGS:
        tasks = TaskGenerator(seed=seed)
        problems = [tasks.problem(i % 6, Split.HELD_OUT, family) for i in range(count)]
        mode = CacheMode.DUAL if cache == "dual" else CacheMode.NONE
        states = [engine.new_request(f"e{i}", tokenizer.encode(p.prompt), gen_length, block_length, mode)
                  for i, p in enumerate(problems)]
        engine.run_to_completion([(s, tau or threshold) for s in states])
        correct = sum(check_answer(p, tokenizer.decode(s.canvas)) for p, s in zip(problems, states, strict=True))
        steps = sum(s.num_steps for s in states)
        per_setting[name] = {"accuracy": round(correct / count, 4), "mean_steps": round(steps / count, 2)}
    model.train()
    accuracy = sum(v["accuracy"] for v in per_setting.values()) / len(per_setting)
    return {"accuracy": round(accuracy, 4), "threshold": threshold, "settings": per_setting}


class Trainer:
    """Owns model, optimizer and data stream; ``run`` resumes from the checkpoint if there is one."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.tokenizer = CharTokenizer()
        self.model = self._initial_model()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98)
        )
        self.step = 0
        self.elapsed_s = 0.0
        self.history: list[dict] = []
        self.rng = random.Random(cfg.seed)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.tasks = self._task_generator(cfg.seed)

    def _initial_model(self) -> DLMForMaskedDiffusion:
        if self.cfg.init_from and not self.checkpoint_path.exists():
            source = DLMForMaskedDiffusion.from_pretrained(self.cfg.init_from)
            if self.cfg.n_layers >= source.config.n_layers:
                return source  # the source's shape, as it always was
            return self._first_layers_of(source)
        return DLMForMaskedDiffusion(self._model_config())

    def _first_layers_of(self, source: DLMForMaskedDiffusion) -> DLMForMaskedDiffusion:
        """A smaller model (``n_layers`` below the source's) that starts from the source's embedding,
        its first ``n_layers`` blocks, its final norm and its head: a shallower sibling of a trained
        model, another size (another profile) to serve beside it."""
        config = self._model_config()
        mine, theirs = (config.d_model, config.n_heads, config.mlp_hidden_size), (
            source.config.d_model, source.config.n_heads, source.config.mlp_hidden_size)
        if mine != theirs:
            raise ValueError(f"init_from: {self.cfg.init_from} has d_model, n_heads, mlp_hidden_size {theirs}; "
                             f"keeping its first {self.cfg.n_layers} layers needs the same, got {mine}")
        model = DLMForMaskedDiffusion(config)
        wanted = model.state_dict()
        model.load_state_dict({k: v for k, v in source.state_dict().items() if k in wanted})  # strict
        return model

    def _task_generator(self, seed: int) -> TaskGenerator:
        share = self.cfg.add_share
        return TaskGenerator(seed=seed, family_weights={Family.ADD: share, Family.WORDS: 1 - share},
                             chain_length_bias=self.cfg.chain_length_bias)

    def _long_batch(self) -> bool:
        """Whether the next batch holds the long family (``chain_share`` of them)."""
        return self.rng.random() < self.cfg.chain_share

    def _short_canvas(self, longest_answer: int, truncating: bool) -> int:
        """A canvas for short answers: the longest answer rounded up to the block for
        ``tight_canvas_share`` of them, else at most 32 for ``short_canvas_share`` of them, else up to
        the max; when ``truncating``, one shorter than the longest answer."""
        if truncating:
            return self.rng.randint(1, max(1, longest_answer - 1))
        if self.rng.random() < self.cfg.tight_canvas_share:
            block = self.cfg.block_length
            return min(self.cfg.max_gen_length, -(-longest_answer // block) * block)
        top = self.cfg.max_gen_length
        if self.rng.random() < self.cfg.short_canvas_share:
            top = min(top, 32)
        return self.rng.randint(longest_answer, top)

    def _model_config(self) -> DLMConfig:
        c, t = self.cfg, CharTokenizer()
        return DLMConfig(
            vocab_size=t.vocab_size, d_model=c.d_model, n_layers=c.n_layers, n_heads=c.n_heads,
            mlp_hidden_size=c.mlp_hidden_size, mask_token_id=t.mask_token_id,
            pad_token_id=t.pad_token_id, eos_token_id=t.eos_token_id, max_sequence_length=512,
        )

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.cfg.checkpoint_dir, "checkpoint.pt")

    def resume(self) -> bool:
        if not self.checkpoint_path.exists():
            return False
        state = torch.load(self.checkpoint_path, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.elapsed_s, self.history = state["step"], state["elapsed_s"], state["history"]
        self.rng.setstate(state["rng"])
        self.generator.set_state(state["generator"])
        self.tasks = self._task_generator(self.cfg.seed + self.step)  # a fresh stream after resuming
        return True

    def save_checkpoint(self) -> None:
        self.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
            "elapsed_s": self.elapsed_s, "history": self.history, "rng": self.rng.getstate(),
            "generator": self.generator.get_state(), "config": asdict(self.cfg),
        }
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.checkpoint_path)  # atomic: an interrupted save never corrupts the checkpoint

    def export(self) -> None:
        out = Path(self.cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        info = {
            "train_config": asdict(self.cfg), "steps_done": self.step, "wall_time_s": round(self.elapsed_s, 1),
            "parameters": sum(p.numel() for p in self.model.parameters()), "eval_history": self.history,
            "device": "cpu", "torch_threads": torch.get_num_threads(), "init_from": self.cfg.init_from or None,
        }
        Path(out, "training_info.json").write_text(json.dumps(info, indent=2))

    def _batch(self):
        num_shots = self.rng.choices(range(self.cfg.max_shots + 1), weights=self.cfg.shot_weights)[0]
        truncating = self.rng.random() < self.cfg.truncate_share
        if self._long_batch():
            # the canvas first, then chains that fit it (any chain when truncating): long answers at
            # every canvas length they fit
            # half of them on the longest canvas: a chain fits only a canvas at least its length, so
            # a uniform canvas alone would leave the longest chains (up to 125 tokens) nearly unseen
            low = 8 if truncating else chain_answer_length(CHAIN_MIN_ITEMS) + 1
            longest = self.rng.random() < 0.5
            gen_length = self.cfg.max_gen_length if longest else self.rng.randint(low, self.cfg.max_gen_length)
            problems = []
            while len(problems) < self.cfg.batch_size:
                problem = self.tasks.problem(num_shots, Split.TRAIN, Family.CHAIN)
                if truncating or len(target_ids(problem, self.tokenizer)) <= gen_length:
                    problems.append(problem)
        else:
            problems = [self.tasks.problem(num_shots, Split.TRAIN) for _ in range(self.cfg.batch_size)]
            gen_length = self._short_canvas(max(len(target_ids(p, self.tokenizer)) for p in problems), truncating)
        answer_lengths = [min(len(target_ids(p, self.tokenizer)), gen_length) for p in problems]
        long = problems[0].family is Family.CHAIN
        return (*encode_batch(problems, self.tokenizer, gen_length, truncate=truncating), answer_lengths, long)

    def train_step(self) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, self.cfg)
        ids, attention, region, answer_lengths, long = self._batch()
        blocks = tuple(self.cfg.chain_block_lengths) if long else SEMI_AR_BLOCK_LENGTHS
        loss = diffusion_loss(self.model, ids, attention, region, self.tokenizer.mask_token_id, self.generator,
                              self.cfg.semi_ar_share, answer_lengths, blocks, self.cfg.confidence_mask_share,
                              self.cfg.probe_weight, self.cfg.overconfident_boost)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        return loss.item()

    def run(self, log=print) -> None:
        if self.resume():
            log(f"resumed from {self.checkpoint_path} at step {self.step}")
        self.model.train()
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc="train", mininterval=5)
        while self.step < self.cfg.steps:
            started = time.perf_counter()
            loss = self.train_step()
            self.elapsed_s += time.perf_counter() - started
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps:
                result = {"step": self.step, "loss": round(loss, 4), **evaluate(self.model, self.tokenizer, self.cfg)}
                self.history.append(result)
                log(f"eval {json.dumps(result)}")
            if self.step % self.cfg.save_every == 0 or self.step == self.cfg.steps:
                self.save_checkpoint()
                self.export()
        bar.close()
        self.export()
