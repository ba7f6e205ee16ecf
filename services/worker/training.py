"""Training the bundled model with the masked-diffusion objective, on CPU, resumably.

Per example: t ~ U(eps, 1); every answer position is masked with probability t (the prompt never);
loss = cross-entropy on the masked positions, weighted by 1/t, averaged over the answer positions of
the batch (LLaDA's objective). Batches share one few-shot count, so they carry little padding.
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

from services.worker.model import DLMConfig, DLMForMaskedDiffusion
from services.worker.reference import reference_generate
from services.worker.tokenizer import CharTokenizer
from shared.tasks import Family, Problem, Split, TaskGenerator, check_answer

MASK_EPS = 1e-3
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
    gen_length: int = 16
    block_length: int = 8
    max_shots: int = 8
    add_share: float = 0.5  # share of arithmetic queries (the rest: the word task)
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


def target_ids(problem: Problem, tokenizer: CharTokenizer) -> list[int]:
    """What the model learns to write on the canvas for ``problem``: the answer, then EOS."""
    ids = tokenizer.encode(problem.answer)
    if problem.family is Family.ADD:
        ids = [tokenizer.pad_token_id] * (ADD_ANSWER_WIDTH - len(ids)) + ids
    return ids + [tokenizer.eos_token_id]


def encode_batch(problems: list[Problem], tokenizer: CharTokenizer, gen_length: int):
    """Left-padded ids [B, L], attention mask, and the answer region mask (answer + EOS padding)."""
    rows = []
    for p in problems:
        answer = target_ids(p, tokenizer)
        if len(answer) > gen_length:
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


def diffusion_loss(model, ids, attention, answer_region, mask_id: int, generator: torch.Generator):
    t = torch.rand(ids.shape[0], 1, generator=generator) * (1 - MASK_EPS) + MASK_EPS
    masked = (torch.rand(ids.shape, generator=generator) < t) & answer_region
    noisy = torch.where(masked, torch.full_like(ids, mask_id), ids)
    logits = model(noisy, attention_mask=attention).logits
    token_loss = F.cross_entropy(logits[masked].float(), ids[masked], reduction="none")
    weights = (1.0 / t).expand_as(ids)[masked]
    return (token_loss * weights).sum() / answer_region.sum()


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def evaluate(model, tokenizer, cfg: TrainConfig, threshold: float = 0.9, seed: int = 12345) -> dict:
    """Exact match / validity and mean steps on held-out problems, reference decoder."""
    model.eval()
    problems = TaskGenerator(seed=seed).problems(cfg.eval_problems, max_shots=5, split=Split.HELD_OUT)
    correct, steps = 0, 0
    for p in problems:
        result = reference_generate(model, tokenizer.encode(p.prompt), cfg.gen_length, cfg.block_length, threshold)
        correct += check_answer(p, tokenizer.decode(result.tokens))
        steps += result.num_steps
    model.train()
    return {"accuracy": correct / len(problems), "mean_steps": steps / len(problems), "threshold": threshold}


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
            return DLMForMaskedDiffusion.from_pretrained(self.cfg.init_from)
        return DLMForMaskedDiffusion(self._model_config())

    def _task_generator(self, seed: int) -> TaskGenerator:
        share = self.cfg.add_share
        return TaskGenerator(seed=seed, family_weights={Family.ADD: share, Family.WORDS: 1 - share})

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
        problems = [self.tasks.problem(num_shots, Split.TRAIN) for _ in range(self.cfg.batch_size)]
        return encode_batch(problems, self.tokenizer, self.cfg.gen_length)

    def train_step(self) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, self.cfg)
        ids, attention, region = self._batch()
        loss = diffusion_loss(self.model, ids, attention, region, self.tokenizer.mask_token_id, self.generator)
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
