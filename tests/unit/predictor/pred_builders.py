"""Builders for predictor tests: a deterministic fake engine, traces collected from it, tiny models."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

from services.predictor.core.model import StepModel
from services.predictor.core.training import TrainParams
from services.predictor.traces import CollectConfig, TraceSet, collect_traces, read_traces, write_traces
from services.predictor.training import fit
from services.worker.engine.request import ConfidenceStats, RequestState, StepResult
from shared.messages.base import CacheMode, StepKind
from shared.tasks import Split, TaskGenerator

FAST = TrainParams(num_rounds=20, min_data_in_leaf=3)


class FakeEngine:
    """Block-wise threshold decoding with made-up confidences, deterministic per (request, step).

    Confidences of a request's positions are drawn around a level set by its prompt length, so
    requests differ in how many steps they need and the confidence features carry information.
    """

    mask_id = 1
    eos_id = 2
    default_gen_length = 16
    default_block_length = 8

    def __init__(self) -> None:
        self.num_step_calls = 0
        self._started_blocks: dict[str, int] = {}  # request id -> last block that had its recompute step

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % 40 for c in text]

    def new_request(self, request_id, prompt_ids, gen_length=None, block_length=None, cache_mode=CacheMode.DUAL):
        gen_length = gen_length or self.default_gen_length
        block_length = block_length or self.default_block_length
        return RequestState(request_id, list(prompt_ids), [self.mask_id] * gen_length, block_length, cache_mode)

    def step(self, batch: list[tuple[RequestState, float]]) -> list[StepResult]:
        self.num_step_calls += 1
        return [self._step(state, tau) for state, tau in batch]

    def _step(self, state: RequestState, tau: float) -> StepResult:
        block = state.canvas.index(self.mask_id) // state.block_length
        start, end = state.block_bounds(block)
        fresh_block = self._started_blocks.get(state.request_id) != block
        kind = StepKind.RECOMPUTE if fresh_block or state.cache_mode == CacheMode.NONE else StepKind.CACHE
        self._started_blocks[state.request_id] = block
        masked = [i for i in range(start, end) if state.canvas[i] == self.mask_id]
        rng = random.Random(zlib.crc32(f"{state.request_id}/{state.num_steps}".encode()))
        level = 0.5 + (len(state.prompt_ids) % 7) / 16
        conf = [min(0.999, max(0.05, rng.gauss(level, 0.2))) for _ in masked]
        best = max(range(len(masked)), key=conf.__getitem__)
        chosen = [j for j in range(len(masked)) if conf[j] > tau or j == best]
        for j in chosen:
            state.canvas[masked[j]] = 5
        state.num_steps += 1
        state.finished = self.mask_id not in state.canvas
        remaining = [conf[j] for j in range(len(masked)) if j not in chosen]
        return StepResult(
            state.request_id, kind, block, [masked[j] for j in chosen], [5] * len(chosen), state.finished,
            state.num_steps, state.canvas.count(self.mask_id), ConfidenceStats.of(remaining), tau,
        )


def fake_rows(num_requests: int = 60, seed: int = 3, split: Split = Split.TRAIN, **config) -> list[dict]:
    problems = TaskGenerator(seed).problems(num_requests, 8, split=split)
    return collect_traces(FakeEngine(), problems, seed, CollectConfig(batch_size=16, **config))


def fake_traces(tmp_path: Path, name: str = "train.csv", num_requests: int = 60, seed: int = 3,
                split: Split = Split.TRAIN) -> TraceSet:
    path = write_traces(tmp_path / name, fake_rows(num_requests, seed, split))
    return read_traces(path)


def tiny_model(tmp_path: Path, feature_set: str = "progress_confidence") -> StepModel:
    return fit(fake_traces(tmp_path, f"model-{feature_set}.csv"), feature_set, FAST)
