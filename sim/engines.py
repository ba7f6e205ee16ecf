"""Step engines behind one interface: the real engine in the loop, or replay of recorded traces.

Both decide *what* a step does (tokens committed, block ends, completions, answer correctness); the
time a step takes is the ``StepTimer``'s business (``sim/timing.py``). Each instance keeps its own
KV caches: a request that runs on an instance without its cache (after a migration at a cache step)
gets a recompute step, as in the real worker.

- ``model``: one ``DLMEngine`` per instance, all sharing the bundled model's weights; each batched
  step of the simulation is one real ``DLMEngine.step`` call.
- ``replay``: per-step commit counts sampled from a ``ReplayTrace`` recorded with the real engine at
  every candidate threshold (``calibrate``, at the workload's canvas and block length and for its task
  families), keyed by task family, block, masked positions left in the block and threshold; the
  number of blocks a request runs (where its answer ends, early stop at EOS) comes from the recorded
  problem it follows; correctness is a Bernoulli draw with the recorded accuracy at the thresholds
  its tokens were committed at (token-weighted).
"""

from __future__ import annotations

import bisect
import gzip
import hashlib
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from services.reconfigurator.core.latency import MeasuredSteps
from services.reconfigurator.core.spec import StepCounts
from services.scheduler.core import CacheMode
from shared.tasks import SHORT_FAMILIES, Family, Split, TaskGenerator, check_answer
from sim.registry import Registry
from sim.workload import RequestSpec

DEFAULT_MODEL_DIR = "models/dls-tiny"
DEFAULT_TRACE_DIR = "runs/sim/replay"
SHIPPED_TRACE_DIR = "replay"  # inside the model directory: the presets' traces, committed with the weights
CALIBRATION_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


@dataclass(frozen=True, slots=True)
class EngineOutcome:
    """One request's part of a batched step."""

    request_id: str
    num_committed: int
    block_done: bool
    finished: bool
    recompute: bool  # the step was a full forward (block start, lost cache, or no cache)
    threshold: float
    num_masked: int = 0  # masked output positions left (predictor feature)
    confidences: tuple[float, ...] = ()  # min, q25, median, mean, q75 of the still-masked block
    predicted_end: int | None = None  # canvas position where the engine expects the EOS (a predictor feature)


class SimEngine(Protocol):
    """What the simulator needs from an engine.

    A step is started (``start``: its kind per request is known then, which the step's duration
    needs) and finished (``finish``: its outcomes). Between the two the engine may compute it at any
    time: the model engine defers forwards and runs every step in flight across the cluster in one
    batched call (they touch disjoint requests whose inputs were fixed at their start).
    """

    name: str

    def prompt_len(self, spec: RequestSpec) -> int: ...

    def admit(self, spec: RequestSpec, cache_mode: CacheMode) -> None: ...

    def start(self, instance_id: str, batch: list[tuple[str, float]]) -> tuple[int, list[bool]]:
        """(step token, recompute flag per request)."""
        ...

    def finish(self, token: int) -> list[EngineOutcome]: ...

    def correct(self, request_id: str) -> bool: ...

    def release(self, request_id: str) -> None: ...

    def drop_cache(self, request_id: str, instance_id: str) -> None:
        """``instance_id`` drops the request's KV cache if it holds it (a drop command: the request moved
        or yielded its memory); its next step there is a recompute."""
        ...


def _char_tokenizer(model_dir: str | Path):
    from shared.tokenizer import CharTokenizer

    return CharTokenizer.from_pretrained(Path(model_dir))


# --- model in the loop -------------------------------------------------------------------------


class ModelEngine:
    """The real engine of the bundled model decides every step.

    One ``DLMEngine`` holds every request's state and KV cache; which instance holds a request's
    cache is tracked here, and a request stepped on another instance has its cache dropped first,
    so its step is a recompute, as on a real worker. Forwards are deferred: at the first ``finish``
    after some ``start``s, every step in flight runs in one batched ``DLMEngine.step`` call.
    """

    name = "model"

    def __init__(self, model_dir: str | Path = DEFAULT_MODEL_DIR, rng: np.random.Generator | None = None) -> None:
        import torch

        from services.worker.engine.engine import DLMEngine

        torch.set_num_threads(1)
        self._engine = DLMEngine.from_pretrained(model_dir)
        self._states: dict = {}  # request id -> RequestState
        self._specs: dict[str, RequestSpec] = {}  # request id -> spec
        self._cache_on: dict[str, str] = {}  # request id -> instance holding its KV cache
        self._pending: dict[int, list[tuple[str, float]]] = {}  # token -> (request id, threshold)
        self._done: dict[int, list[EngineOutcome]] = {}  # token -> outcomes computed ahead
        self._num_steps = 0
        self.num_forward_calls = 0

    def prompt_len(self, spec: RequestSpec) -> int:
        return len(self._engine.encode(spec.problem.prompt))

    def admit(self, spec: RequestSpec, cache_mode: CacheMode) -> None:
        ids = self._engine.encode(spec.problem.prompt)
        self._states[spec.request_id] = self._engine.new_request(spec.request_id, ids, spec.gen_len, spec.block_len,
                                                                 cache_mode)
        self._specs[spec.request_id] = spec

    def start(self, instance_id: str, batch: list[tuple[str, float]]) -> tuple[int, list[bool]]:
        engine = self._engine
        flags, items = [], []
        for rid, tau in batch:
            if self._cache_on.get(rid, instance_id) != instance_id:
                engine.drop(rid)  # its state moved; the cache stayed behind
            self._cache_on[rid] = instance_id
            state = self._states[rid]
            flags.append(engine.next_step_kind(state) == 0)
            items.append((rid, tau))
        self._num_steps += 1
        self._pending[self._num_steps] = items
        return self._num_steps, flags

    def finish(self, token: int) -> list[EngineOutcome]:
        if token not in self._done:
            self._run_pending()
        return self._done.pop(token)

    def _run_pending(self) -> None:
        tokens = list(self._pending)
        items = [item for t in tokens for item in self._pending[t]]
        results = self._engine.step([(self._states[rid], tau) for rid, tau in items])
        self.num_forward_calls += 1
        outcomes = iter(self._outcome(item, r) for item, r in zip(items, results, strict=True))
        for t in tokens:
            self._done[t] = [next(outcomes) for _ in self._pending.pop(t)]

    def _outcome(self, item: tuple[str, float], result) -> EngineOutcome:
        rid, tau = item
        c = result.confidence
        return EngineOutcome(
            rid, len(result.committed_positions), result.block_done, result.finished, result.kind == 0, tau,
            result.num_masked, (c.min, c.q25, c.median, c.mean, c.q75), result.predicted_end,
        )

    def correct(self, request_id: str) -> bool:
        state, spec = self._states[request_id], self._specs[request_id]
        return check_answer(spec.problem, self._engine.tokenizer.decode(state.canvas))

    def release(self, request_id: str) -> None:
        self._cache_on.pop(request_id, None)
        self._engine.drop(request_id)
        self._states.pop(request_id, None)
        self._specs.pop(request_id, None)

    def drop_cache(self, request_id: str, instance_id: str) -> None:
        if self._cache_on.get(request_id) == instance_id:
            del self._cache_on[request_id]
            self._engine.drop(request_id)


# --- replay ------------------------------------------------------------------------------------


@dataclass
class ReplayTrace:
    """Step outcomes of the real engine at fixed thresholds, summarised for sampling."""

    model_key: str
    gen_len: int
    block_len: int
    thresholds: tuple[float, ...]
    # "family|block|masked|threshold" -> {committed tokens: count}
    commit_counts: dict[str, dict[int, int]] = field(default_factory=dict)
    # same key -> recorded steps [committed, confidence min, q25, median, mean, q75] (the predictor's
    # features); sampled jointly when present, so predictions see realistic confidences
    step_samples: dict[str, list[list[float]]] = field(default_factory=dict)
    # family -> blocks run until finished, one entry per recorded request
    blocks_run: dict[str, list[int]] = field(default_factory=dict)
    # family -> threshold (as str) -> accuracy
    accuracy: dict[str, dict[str, float]] = field(default_factory=dict)
    # threshold (as str) -> mean steps, mean recompute steps per request (all families)
    mean_steps: dict[str, float] = field(default_factory=dict)
    mean_recompute_steps: dict[str, float] = field(default_factory=dict)
    mean_context_tokens: float = 0.0
    num_requests: int = 0
    # per recorded problem (calibration order): its family, and at each threshold its steps
    # [block, masked before, committed, confidence min, q25, median, mean, q75, then the top probability
    # of every masked position before the step] and whether it was right
    problem_families: list[str] = field(default_factory=list)
    trajectories: dict[str, list[list[list[float]]]] = field(default_factory=dict)  # threshold -> problem -> steps
    correct: dict[str, list[int]] = field(default_factory=dict)  # threshold -> problem -> 0/1

    def tokens_per_step(self) -> dict[float, float]:
        """threshold -> generation tokens per step as the scheduler's fallback counts them."""
        return {float(t): self.gen_len / max(s, 1e-9) for t, s in self.mean_steps.items()}

    def overall_accuracy(self) -> dict[float, float]:
        """threshold -> accuracy over the families (the calibration draws them in equal shares)."""
        families = list(self.accuracy.values())
        keys = set.intersection(*(set(f) for f in families)) if families else set()
        return {float(k): sum(f[k] for f in families) / len(families) for k in keys}

    def isolated_steps(self, threshold: float = 0.9) -> tuple[float, float]:
        """(recompute, cache) steps of a request alone at ``threshold``."""
        key = _tkey(threshold)
        rec = self.mean_recompute_steps[key]
        return rec, self.mean_steps[key] - rec

    def measured_steps(self) -> MeasuredSteps:
        """Mean steps per request at each recorded threshold, as the planner's step table reads them (the
        model's calibration of its steps on this trace's canvas and block)."""
        steps = {}
        for key, total in self.mean_steps.items():
            recompute = self.mean_recompute_steps.get(key, total)
            steps[float(key)] = StepCounts(recompute=recompute, cache=max(0.0, total - recompute))
        return MeasuredSteps(self.gen_len, self.block_len, steps, kv_cache=True)

    def to_json(self) -> dict:
        data = dict(self.__dict__)
        data["thresholds"] = list(self.thresholds)
        data["commit_counts"] = {k: {str(n): c for n, c in v.items()} for k, v in self.commit_counts.items()}
        return data

    @classmethod
    def from_json(cls, data: dict) -> ReplayTrace:
        data = dict(data)
        data["thresholds"] = tuple(data["thresholds"])
        data["commit_counts"] = {k: {int(n): c for n, c in v.items()} for k, v in data["commit_counts"].items()}
        return cls(**data)


def _tkey(threshold: float) -> str:
    return f"{threshold:.2f}"


def model_key(model_dir: str | Path) -> str:
    """A digest of the model's weights and config: traces are reused only for the same model."""
    digest = hashlib.sha1()
    for name in ("config.json", "model.safetensors"):
        path = Path(model_dir) / name
        if path.exists():
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def calibrate(
    model_dir: str | Path = DEFAULT_MODEL_DIR,
    num_problems: int = 192,
    thresholds: tuple[float, ...] = CALIBRATION_THRESHOLDS,
    seed: int = 12345,
    trace_dir: str | Path | None = DEFAULT_TRACE_DIR,
    num_shots: int | None = None,
    gen_len: int | None = None,
    block_len: int | None = None,
    families: tuple[Family, ...] = SHORT_FAMILIES,
) -> ReplayTrace:
    """Record (or load the cached) replay trace: every problem decoded at each threshold.

    Problems: held-out split, ``families`` in turn, ``num_shots`` few-shot examples (None: 0-8 in
    turn), a seed no workload uses; decoded on a canvas of ``gen_len`` in blocks of ``block_len``
    (None: the model's defaults), as served (early stop at EOS, dual cache).

    A trace shipped with the model (``<model>/replay/*.json.gz``, named by the weights' digest, so it is
    never read for other weights) is loaded first: the presets' traces are committed there so that a
    clean checkout's benchmarks (``make bench-guard``) need not record them (minutes each).
    """
    key = model_key(model_dir)
    shots = "mix" if num_shots is None else str(num_shots)
    shape = f"{gen_len or 'default'}x{block_len or 'default'}-{'+'.join(f.value for f in families)}"
    name = f"trace-v5-{key}-{num_problems}-{seed}-{shots}-{shape}.json"
    shipped = Path(model_dir) / SHIPPED_TRACE_DIR / f"{name}.gz"
    if shipped.exists():
        return ReplayTrace.from_json(json.loads(gzip.decompress(shipped.read_bytes())))
    path = (Path(trace_dir) / name) if trace_dir else None
    if path is not None and path.exists():
        return ReplayTrace.from_json(json.loads(path.read_text()))
    trace = _record(model_dir, key, num_problems, thresholds, seed, num_shots, gen_len, block_len, families)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(trace.to_json()))
    return trace


def _record(
    model_dir, key: str, num_problems: int, thresholds: tuple[float, ...], seed: int, num_shots: int | None,
    gen_len: int | None, block_len: int | None, families: tuple[Family, ...],
) -> ReplayTrace:
    import torch

    from services.worker.engine.engine import DLMEngine

    torch.set_num_threads(1)
    engine = DLMEngine.from_pretrained(model_dir)
    tasks = TaskGenerator(seed=seed)
    problems = [
        tasks.problem(i % 9 if num_shots is None else num_shots, Split.HELD_OUT, families[i % len(families)])
        for i in range(num_problems)
    ]
    per_family = {f.value: sum(p.family is f for p in problems) for f in families}
    gen, block = gen_len or engine.default_gen_length, block_len or engine.default_block_length
    trace = ReplayTrace(key, gen, block, tuple(thresholds), num_requests=num_problems)
    counts: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    samples: dict[str, list[list[float]]] = defaultdict(list)
    contexts = []
    trace.problem_families = [p.family.value for p in problems]
    for tau in thresholds:
        steps_of: list[list[list[float]]] = [[] for _ in problems]
        states = [engine.new_request(f"c{i}", engine.encode(p.prompt), gen, block) for i, p in enumerate(problems)]
        contexts = [len(s.prompt_ids) + gen for s in states]
        recompute = [0] * len(states)
        active = list(range(len(states)))
        while active:
            before = [_masked_in_block(engine, states[i]) for i in active]
            results = engine.step([(states[i], tau) for i in active])
            for i, (blk, masked), result in zip(active, before, results, strict=True):
                key = f"{problems[i].family.value}|{blk}|{masked}|{_tkey(tau)}"
                counts[key][len(result.committed_positions)] += 1
                c = result.confidence
                row = [len(result.committed_positions)] + [round(v, 4) for v in (c.min, c.q25, c.median, c.mean, c.q75)]
                samples[key].append(row)
                steps_of[i].append([blk, masked, *row, *(round(v, 4) for v in result.masked_confidences)])
                recompute[i] += int(result.kind == 0)
            active = [i for i in active if not states[i].finished]
        trace.trajectories[_tkey(tau)] = steps_of
        trace.correct[_tkey(tau)] = []
        for i, (p, s) in enumerate(zip(problems, states, strict=True)):
            trace.blocks_run.setdefault(p.family.value, []).append(_blocks_run(engine, s))
            ok = check_answer(p, engine.tokenizer.decode(s.canvas))
            trace.correct[_tkey(tau)].append(int(ok))
            trace.accuracy.setdefault(p.family.value, {}).setdefault(_tkey(tau), 0.0)
            trace.accuracy[p.family.value][_tkey(tau)] += ok / per_family[p.family.value]
            del i
        trace.mean_steps[_tkey(tau)] = statistics.fmean(s.num_steps for s in states)
        trace.mean_recompute_steps[_tkey(tau)] = statistics.fmean(recompute)
    trace.commit_counts = {k: dict(v) for k, v in counts.items()}
    trace.step_samples = dict(samples)
    trace.mean_context_tokens = statistics.fmean(contexts)
    return trace


def _stable_index(key: str, salt: int, n: int) -> int:
    """An index in [0, n) from ``key`` and ``salt`` alone (common random numbers across runs)."""
    digest = hashlib.blake2b(f"{salt}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % n


def _masked_in_block(engine, state) -> tuple[int, int]:
    block = state.current_block(engine.mask_id)
    start, end = state.block_bounds(block)
    return block, sum(1 for t in state.canvas[start:end] if t == engine.mask_id)


def _blocks_run(engine, state) -> int:
    """Blocks decoded before the request finished: up to the block holding the first EOS."""
    canvas = state.canvas
    first_eos = canvas.index(engine.eos_id) if engine.eos_id in canvas else len(canvas) - 1
    return first_eos // state.block_length + 1


def _commit_at(confidences: np.ndarray, tau: float) -> np.ndarray:
    """[committed, min, q25, median, mean, q75 of the rest]: the engine's commit rule at ``tau`` on
    one forward's confidences (those above it, and at least the most confident one)."""
    chosen = confidences > tau
    chosen[int(np.argmax(confidences))] = True
    rest = np.sort(confidences[~chosen])
    if not len(rest):
        return np.array([chosen.sum(), 1.0, 1.0, 1.0, 1.0, 1.0])  # as ConfidenceStats.of([])
    q = np.quantile(rest, [0.25, 0.5, 0.75])
    return np.array([chosen.sum(), rest[0], q[0], q[1], float(rest.mean()), q[2]])


@dataclass
class _ReplayState:
    family: str
    gen_len: int
    block_len: int
    blocks_to_run: int
    block: int = 0
    masked: int = 0
    weighted_accuracy: float = 0.0  # sum over committed tokens of the accuracy at their threshold
    num_committed: int = 0
    finished: bool = False
    problem: int = -1  # the recorded problem it follows (-1: none; pooled draws only)


class ReplayEngine:
    """Samples step outcomes from a ``ReplayTrace``; seeded, no model."""

    name = "replay"

    def __init__(self, trace: ReplayTrace, rng: np.random.Generator, model_dir: str | Path = DEFAULT_MODEL_DIR) -> None:
        self.trace = trace
        self.rng = rng
        self._tokenizer = _char_tokenizer(model_dir)
        self._states: dict[str, _ReplayState] = {}  # request id -> replay state
        self._cache_on: dict[str, str] = {}  # request id -> instance holding its KV cache
        self._cache_mode: dict[str, CacheMode] = {}  # request id -> its cache mode
        self._thresholds = sorted(trace.thresholds)
        self._samples = self._index(trace)
        self._by_family: dict[str, list[int]] = {}  # family -> recorded problems with trajectories
        if trace.trajectories:
            for i, family in enumerate(trace.problem_families):
                self._by_family.setdefault(family, []).append(i)
        self._done: dict[int, list[EngineOutcome]] = {}  # step token -> outcomes
        self._num_steps = 0
        # which recorded problem a request follows depends on its id and this salt only (not on how many
        # draws the steps before took): at a point every policy's request follows the same problem, so
        # their accuracies differ by the thresholds they ran at, not by which problems they drew
        self._problem_salt = int(rng.integers(2**32))

    @staticmethod
    def _index(trace: ReplayTrace) -> dict[tuple[str, int, int, str], tuple[np.ndarray, np.ndarray]]:
        # (family, block, masked, threshold) -> (committed values, cumulative probabilities)
        index = {}
        for key, hist in trace.commit_counts.items():
            family, block, masked, tau = key.split("|")
            recorded = trace.step_samples.get(key)
            if recorded:
                rows = np.array(recorded, dtype=float)
                index[(family, int(block), int(masked), tau)] = (rows, None)
                continue
            values = np.array(sorted(hist), dtype=float)[:, None]
            weights = np.array([hist[int(v)] for v in values[:, 0]], dtype=float)
            index[(family, int(block), int(masked), tau)] = (values, np.cumsum(weights) / weights.sum())
        return index

    def prompt_len(self, spec: RequestSpec) -> int:
        return len(self._tokenizer.encode(spec.problem.prompt))

    def admit(self, spec: RequestSpec, cache_mode: CacheMode) -> None:
        """A request follows one recorded problem of its family (drawn by its id): its steps at each
        threshold, so the confidences a step reports foretell that request's next steps as they do
        on the model; states the problem's recording lacks (after a threshold switch) fall back to
        draws pooled over the family."""
        family = spec.problem.family.value
        num_blocks = -(-spec.gen_len // spec.block_len)
        first = min(spec.block_len, spec.gen_len)
        mine = self._by_family.get(family)
        if mine and spec.gen_len == self.trace.gen_len and spec.block_len == self.trace.block_len:
            problem = int(mine[_stable_index(spec.request_id, self._problem_salt, len(mine))])
            top = self.trace.trajectories[_tkey(self._thresholds[-1])][problem]
            blocks = min(max(int(row[0]) for row in top) + 1, num_blocks) if top else num_blocks
        else:
            problem = -1
            runs = self.trace.blocks_run.get(family) or [1]
            blocks = min(int(runs[self.rng.integers(len(runs))]), num_blocks)
        self._states[spec.request_id] = _ReplayState(family, spec.gen_len, spec.block_len, blocks, 0, first,
                                                     problem=problem)
        self._cache_mode[spec.request_id] = cache_mode

    def start(self, instance_id: str, batch: list[tuple[str, float]]) -> tuple[int, list[bool]]:
        outcomes = self.step(instance_id, batch)
        self._num_steps += 1
        self._done[self._num_steps] = outcomes
        return self._num_steps, [o.recompute for o in outcomes]

    def finish(self, token: int) -> list[EngineOutcome]:
        return self._done.pop(token)

    def step(self, instance_id: str, batch: list[tuple[str, float]]) -> list[EngineOutcome]:
        """Start and finish at once."""
        return [self._step_one(instance_id, rid, tau) for rid, tau in batch]

    def _step_one(self, instance_id: str, rid: str, tau: float) -> EngineOutcome:
        state = self._states[rid]
        block_len_now = min(state.block_len, state.gen_len - state.block * state.block_len)
        at_block_start = state.masked == block_len_now
        recompute = (
            self._cache_mode[rid] == CacheMode.NONE or at_block_start or self._cache_on.get(rid) != instance_id
        )
        self._cache_on[rid] = instance_id
        row = self._follow(state, tau)
        if row is None:
            row = self._sample(state, tau)
        k = min(int(row[0]), state.masked)
        state.masked -= k
        state.num_committed += k
        state.weighted_accuracy += k * self._accuracy(state, tau)
        block_done = state.masked == 0
        if block_done:
            state.block += 1
            state.finished = state.block >= state.blocks_to_run
            if not state.finished:
                state.masked = min(state.block_len, state.gen_len - state.block * state.block_len)
        left = 0 if state.finished else state.masked + state.gen_len - (state.block + 1) * state.block_len
        confidences = tuple(float(v) for v in row[1:6]) if len(row) >= 6 else ()
        # the bundled model names its answer's end block from the first full forward on (all of 300
        # held-out requests over every family, canvas and block length: docs/notes.md; the test
        # ``test_the_first_forward_tells_the_block_where_a_chain_ends``), so the replay reports the
        # block where the problem it follows ended (as its first position)
        end = (state.blocks_to_run - 1) * state.block_len
        return EngineOutcome(rid, k, block_done, state.finished, recompute, tau, max(left, 0), confidences, end)

    def _follow(self, state: _ReplayState, tau: float) -> np.ndarray | None:
        """The followed problem's step from this (block, masked) state at ``tau``: its recording at
        ``tau`` when that reached the state, else the recording at the nearest other threshold that
        did, with the commit rule applied at ``tau`` to the confidences recorded there (the same
        forward; only which tokens clear the threshold differs). None when no recording of the
        problem reached the state (a draw pooled over the family then stands in)."""
        if state.problem < 0:
            return None
        for t in sorted(self._thresholds, key=lambda t: (abs(t - tau), -t)):
            for row in self.trace.trajectories[_tkey(t)][state.problem]:
                if int(row[0]) != state.block or int(row[1]) != state.masked:
                    continue
                if t == self._nearest(tau) or len(row) <= 8:
                    return np.asarray(row[2:8], dtype=float)
                return _commit_at(np.asarray(row[8:], dtype=float), tau)
        return None

    def _sample(self, state: _ReplayState, tau: float) -> np.ndarray:
        """A recorded step: [committed, confidences...] (or just [committed] from counts)."""
        for key in self._candidate_keys(state, tau):
            found = self._samples.get(key)
            if found is not None:
                rows, cdf = found
                i = self.rng.integers(len(rows)) if cdf is None else np.searchsorted(cdf, self.rng.random())
                return rows[min(int(i), len(rows) - 1)]
        rate = self.trace.tokens_per_step().get(self._nearest(tau), 1.0)
        return np.array([max(1, int(round(rate)))], dtype=float)

    def _candidate_keys(self, state: _ReplayState, tau: float):
        """The exact cell first; then the same masked count in another block; then larger masked
        counts (commits are clipped to what is left, so a fuller block's count is the closer
        stand-in: a request that switched threshold mid-block reaches states a fixed-threshold run
        rarely does); smaller counts last."""
        t = _tkey(self._nearest(tau))
        max_block = max(0, -(-self.trace.gen_len // self.trace.block_len) - 1)
        block = min(state.block, max_block)
        masked = min(state.masked, self.trace.block_len)
        blocks = [block] + [b for b in range(max_block, -1, -1) if b != block]
        larger = range(masked + 1, self.trace.block_len + 1)
        smaller = range(masked - 1, 0, -1)
        for m in (masked, *larger, *smaller):
            for b in blocks:
                yield state.family, b, m, t

    def _nearest(self, tau: float) -> float:
        ts = self._thresholds
        i = bisect.bisect_left(ts, tau - 1e-9)
        if i == len(ts):
            return ts[-1]
        if i > 0 and tau - ts[i - 1] < ts[i] - tau:
            return ts[i - 1]
        return ts[i]

    def _accuracy(self, state: _ReplayState, tau: float) -> float:
        """Whether the followed problem was right at ``tau`` (else the family's accuracy there)."""
        key = _tkey(self._nearest(tau))
        if state.problem >= 0:
            return float(self.trace.correct[key][state.problem])
        return self.trace.accuracy.get(state.family, {}).get(key, 0.0)

    def correct(self, request_id: str) -> bool:
        state = self._states[request_id]
        p = state.weighted_accuracy / max(state.num_committed, 1)
        # the same uniform draw for this request in every run at the point (common random numbers)
        return _stable_index(request_id, self._problem_salt + 1, 2**32) / 2**32 < p

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._cache_on.pop(request_id, None)
        self._cache_mode.pop(request_id, None)

    def drop_cache(self, request_id: str, instance_id: str) -> None:
        if self._cache_on.get(request_id) == instance_id:
            del self._cache_on[request_id]


# name -> factory(trace, rng, model_dir)
ENGINES: Registry = Registry("engine")
ENGINES.register("replay", lambda trace, rng, model_dir: ReplayEngine(trace, rng, model_dir))
ENGINES.register("model", lambda trace, rng, model_dir: ModelEngine(model_dir, rng))
