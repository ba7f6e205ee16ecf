"""Engine traces for the step predictor: collection, and CSV files validated on read.

A trace row is a request between steps (``step`` steps done; 0 is arrival) with its features (``shared.features``) and
the steps that actually remained, counted apart as the engine reported them (recompute and cache).
The threshold feature is the one used for *all* remaining steps, so a row is written only where the
request's threshold stays the same until it finishes. To teach the model what happens after the
scheduler switches a request's threshold, part of the requests run their first steps at another
candidate threshold and switch once (rows after the switch have ``switched`` = 1; rows before it
have no constant future threshold and are not written).

What is traced is a task problem (``shared.tasks.Problem``, encoded with the engine's tokenizer) or a
``TracePrompt``: token ids as the gateway would send them (``dls calibrate`` traces a user's prompts so),
with a label for the error breakdowns and, optionally, the canvas a request asked for. With
``CollectConfig.every_threshold`` each prompt runs once at every candidate threshold (few prompts, every
threshold seen on each), otherwise once at a threshold drawn for it.
"""

from __future__ import annotations

import csv
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from services.predictor.core.predictor import PredictionQuery
from services.predictor.core.served import LabelledState, labelled_states
from shared.features import FEATURE_NAMES, MODEL_OUTPUT_FEATURE_NAMES
from shared.messages.base import StepKind

if TYPE_CHECKING:
    from services.worker.engine.engine import DLMEngine
    from services.worker.engine.request import RequestState, StepResult
    from shared.tasks import Problem

DEFAULT_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)  # the scheduler's default candidates
META_COLUMNS = ("request_id", "seed", "family", "num_shots", "cache_mode", "step", "switched", "previous_threshold")
LABEL_COLUMNS = ("remaining_steps", "remaining_recompute", "remaining_cache")
COLUMNS = META_COLUMNS + FEATURE_NAMES + LABEL_COLUMNS
_NULLABLE = frozenset(MODEL_OUTPUT_FEATURE_NAMES) | {"previous_threshold"}  # NaN allowed (before any step)
_TEXT = frozenset({"request_id", "family", "cache_mode"})


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file and the problem."""


# --- collection -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CollectConfig:
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS
    switch_fraction: float = 0.5  # requests that run their first steps at another threshold
    max_switch_step: int = 6  # the switch happens after 1..this many steps
    batch_size: int = 48  # requests stepped together (each with its own threshold)
    gen_lengths: tuple[int, ...] = ()  # drawn per request; empty: the engine's default
    block_lengths: tuple[int, ...] = ()
    cache_mode: str = "dual"
    every_threshold: bool = False  # each prompt once per threshold (as the one it ends at), not once at a drawn one


@dataclass(frozen=True)
class TracePrompt:
    """A prompt to trace as token ids (what the gateway sends a worker), with its row labels."""

    prompt_ids: tuple[int, ...]
    family: str  # the trace rows' ``family`` column: a task family, or where a user's prompt came from
    num_shots: int = 0
    gen_length: int | None = None  # the canvas the request asked for (None: drawn as configured, or the default)

    @classmethod
    def of_problem(cls, engine: DLMEngine, problem: Problem) -> TracePrompt:
        return cls(tuple(engine.encode(problem.prompt)), str(problem.family), problem.num_shots)


@dataclass
class _Run:
    """One request being traced."""

    problem: TracePrompt
    state: RequestState
    thresholds: tuple[float, float]  # (first, then)
    switch_after: int  # steps run at the first threshold (0: none)
    queries: list[PredictionQuery] = field(default_factory=list)  # state before each step
    kinds: list[int] = field(default_factory=list)  # StepKind of each step

    def threshold_of_step(self, step_number: int) -> float:
        """Threshold of the ``step_number``-th step (1-based)."""
        return self.thresholds[0] if step_number <= self.switch_after else self.thresholds[1]


def collect_traces(
    engine: DLMEngine,
    problems: Sequence[Problem | TracePrompt],
    seed: int,
    config: CollectConfig | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """Run every problem to completion with continuous batching; return the trace rows. ``on_progress``
    gets (requests finished, requests) after every step."""
    from shared.messages.base import CacheMode

    config = config or CollectConfig()
    rng = random.Random(seed)
    prompts = [p if isinstance(p, TracePrompt) else TracePrompt.of_problem(engine, p) for p in problems]
    jobs = [(p, t) for p in prompts for t in config.thresholds] if config.every_threshold else [(p, None) for p in prompts]
    mode = CacheMode(config.cache_mode)
    pending = [_start(engine, p, f"s{seed}-r{i}", rng, config, mode, then) for i, (p, then) in enumerate(jobs)]
    pending.reverse()
    active: list[_Run] = []
    rows: list[dict] = []
    num_done = 0
    while pending or active:
        while pending and len(active) < config.batch_size:
            active.append(pending.pop())
        results = engine.step([(r.state, r.threshold_of_step(r.state.num_steps + 1)) for r in active])
        for run, result in zip(active, results, strict=True):
            _record(run, result, engine.mask_id)
            if result.finished:
                rows.extend(_rows(run, seed))
                num_done += 1
        active = [r for r in active if not r.state.finished]
        if on_progress is not None:
            on_progress(num_done, len(jobs))
    return rows


def _start(engine, problem: TracePrompt, request_id: str, rng: random.Random, config: CollectConfig, cache_mode,
           then: float | None = None) -> _Run:
    """``then``: the threshold the request ends at (None: drawn)."""
    gen_length = rng.choice(config.gen_lengths) if config.gen_lengths else None
    block_length = rng.choice(config.block_lengths) if config.block_lengths else None
    state = engine.new_request(request_id, list(problem.prompt_ids), problem.gen_length or gen_length, block_length,
                               cache_mode)
    then = rng.choice(config.thresholds) if then is None else then
    first, switch_after = then, 0
    if len(config.thresholds) > 1 and rng.random() < config.switch_fraction:
        first = rng.choice([t for t in config.thresholds if t != then])
        switch_after = rng.randint(1, config.max_switch_step)
    run = _Run(problem, state, (first, then), switch_after)
    run.queries.append(PredictionQuery.arriving(request_id, state.gen_length, len(state.prompt_ids), state.block_length,
                                                str(cache_mode) != "none"))
    return run


def _record(run: _Run, result: StepResult, mask_id: int) -> None:
    run.kinds.append(int(result.kind))
    if not result.finished:
        run.queries.append(PredictionQuery.after_step(run.state, result, mask_id))


def _rows(run: _Run, seed: int) -> list[dict]:
    """Rows for the states whose remaining steps all ran at one threshold (``core/served.py``)."""
    taus = [run.threshold_of_step(j) for j in range(1, len(run.kinds) + 1)]
    states = labelled_states(run.queries, taus, [k == StepKind.RECOMPUTE for k in run.kinds])
    return [trace_row(s, seed, run.problem.family, run.problem.num_shots, str(run.state.cache_mode)) for s in states]


def trace_row(state: LabelledState, seed: int, family: str, num_shots: int, cache_mode: str) -> dict:
    """A labelled state as a trace row (``COLUMNS``)."""
    done = state.query.num_steps_done
    meta = {
        "request_id": state.query.request_id, "seed": seed, "family": family, "num_shots": num_shots,
        "cache_mode": cache_mode, "step": done, "switched": int(state.switched),
        "previous_threshold": state.previous_threshold,
    }
    labels = {"remaining_steps": state.remaining_steps, "remaining_recompute": state.remaining_recompute,
              "remaining_cache": state.remaining_steps - state.remaining_recompute}
    return {**meta, **dict(zip(FEATURE_NAMES, state.features, strict=True)), **labels}


# --- files ------------------------------------------------------------------------------------


def write_traces(path: str | Path, rows: Sequence[dict]) -> Path:
    """Write rows as CSV (atomically: a partial file never replaces a good one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _format(row[k]) for k in COLUMNS})
    os.replace(tmp, path)
    return path


def _format(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    return str(value)


@dataclass
class TraceSet:
    """Trace rows as arrays, grouped by request in step order."""

    path: str
    request_ids: list[str]  # per row
    steps: np.ndarray  # steps done when the features were taken
    switched: np.ndarray  # bool: the request ran earlier steps at another threshold
    features: np.ndarray  # (rows, 11), FEATURE_NAMES order
    remaining_steps: np.ndarray
    remaining_recompute: np.ndarray
    remaining_cache: np.ndarray
    seeds: tuple[int, ...] = ()
    families: list[str] = field(default_factory=list)  # per row: the task family (for error breakdowns)

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def num_requests(self) -> int:
        return len(set(self.request_ids))

    @property
    def thresholds(self) -> np.ndarray:
        return self.features[:, FEATURE_NAMES.index("threshold")]

    @property
    def progress(self) -> np.ndarray:
        return self.features[:, FEATURE_NAMES.index("full_progress")]

    def take(self, mask: np.ndarray) -> TraceSet:
        index = np.flatnonzero(mask)
        return TraceSet(
            self.path, [self.request_ids[i] for i in index], self.steps[index], self.switched[index],
            self.features[index], self.remaining_steps[index], self.remaining_recompute[index],
            self.remaining_cache[index], self.seeds, [self.families[i] for i in index] if self.families else [],
        )

    def first_requests(self, count: int) -> TraceSet:
        """The rows of the first ``count`` requests (in file order)."""
        keep = set(list(dict.fromkeys(self.request_ids))[:count])
        return self.take(np.array([r in keep for r in self.request_ids], dtype=bool))


def read_traces(path: str | Path) -> TraceSet:
    """Read and validate a trace CSV; any problem raises :class:`TraceError` naming the file."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            return _parse(path, csv.reader(f))
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file (collect one with `dls collect-traces`)") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, not a trace file") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not a text CSV file ({exc.reason} at byte {exc.start})") from None
    except csv.Error as exc:
        raise TraceError(f"{path}: corrupt CSV ({exc})") from None


def _parse(path: Path, reader) -> TraceSet:
    header = next(reader, None)
    if header is None:
        raise TraceError(f"{path}: file is empty (no header, no rows)")
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise TraceError(f"{path}: not a trace file: missing columns {', '.join(missing)}")
    index = {c: header.index(c) for c in COLUMNS}
    records = [_parse_row(path, reader.line_num, fields, header, index) for fields in reader if fields]
    if not records:
        raise TraceError(f"{path}: has a header but no trace rows")
    return _assemble(path, records)


def _parse_row(path: Path, line: int, fields: list[str], header: list[str], index: dict[str, int]) -> dict:
    if len(fields) != len(header):
        raise TraceError(f"{path}: line {line}: expected {len(header)} fields, got {len(fields)} (truncated or corrupt)")
    row: dict = {}
    for name, i in index.items():
        row[name] = fields[i] if name in _TEXT else _number(path, line, name, fields[i])
    problem = _row_problem(row)
    if problem:
        raise TraceError(f"{path}: line {line}: {problem}")
    return row


def _number(path: Path, line: int, name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{path}: line {line}: column {name}: not a number: {text!r}") from None
    if math.isinf(value) or (math.isnan(value) and name not in _NULLABLE):
        raise TraceError(f"{path}: line {line}: column {name}: missing or infinite value {text!r}")
    return value


def _row_problem(row: dict) -> str | None:
    if not row["request_id"]:
        return "empty request_id"
    if not 0.0 <= row["threshold"] <= 1.0:
        return f"threshold {row['threshold']} outside [0, 1]"
    if min(row["output_length"], row["prompt_length"], row["block_length"]) < 1:
        return "lengths must be positive"
    if row["remaining_steps"] < 1 or row["remaining_recompute"] < 0 or row["remaining_cache"] < 0:
        return "remaining steps must be >= 1 and their recompute/cache parts >= 0"
    if row["remaining_recompute"] + row["remaining_cache"] != row["remaining_steps"]:
        return "remaining_recompute + remaining_cache != remaining_steps"
    if not (0.0 <= row["full_progress"] <= 1.0 and 0.0 <= row["block_progress"] <= 1.0):
        return "progress outside [0, 1]"
    return None


def _assemble(path: Path, records: list[dict]) -> TraceSet:
    order = {rid: i for i, rid in enumerate(dict.fromkeys(r["request_id"] for r in records))}
    records.sort(key=lambda r: (order[r["request_id"]], r["step"]))

    def column(name: str, dtype=float) -> np.ndarray:
        return np.array([r[name] for r in records], dtype=dtype)

    return TraceSet(
        str(path),
        [r["request_id"] for r in records],
        column("step", int),
        column("switched", bool),
        np.array([[r[name] for name in FEATURE_NAMES] for r in records], dtype=float),
        column("remaining_steps"),
        column("remaining_recompute"),
        column("remaining_cache"),
        tuple(sorted({int(r["seed"]) for r in records})),
        [r["family"] for r in records],
    )
