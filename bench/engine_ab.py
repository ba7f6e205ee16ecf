"""The engine before and after a change, alternated in one run: request-steps per second.

    git worktree add /tmp/engine-before <commit>          # the engine before the change
    python -m bench.engine_ab --before /tmp/engine-before --json docs/bench/engine-ab-cpu.json

A machine shared with other work drifts by more than the few percent a change to the engine's host
work makes, so one old run and one new run compare nothing: each round runs the engine of the
``--before`` tree, then this tree's, then the next round starts with the other one first, so that a
drift of the machine falls on both alike. Each run is a fresh process (``python -m bench.engine
--arch ... --device cpu --threads 1``: a random-weight LLaDA-architecture model, dual cache, EOS
ignored) in the tree it measures; request-steps per second at batch ``b`` is the run's tokens per
second over its tokens per step. ``--tp 2`` also times the tensor-parallel engine over gloo on the
bundled model (``models/dls-tiny``, threshold 0.9, dual cache, EOS ignored) in both trees, each in a
fresh process with ``make_engine`` from wherever that tree keeps it.

Prints JSON: every round's figure, the medians, and ``new_over_old`` per batch (the acceptance
figure: at least 0.95 for a change that should keep the engine's speed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import emit_json

ROOT = Path(__file__).resolve().parent.parent

# Times the tensor-parallel engine in the tree it runs in (run with that tree as the working directory).
_TP_PROGRAM = r"""
import importlib, json, sys, time
factory = None
for name in ("services.worker.parallel.build", "services.worker.tp"):  # the factory's home now, and before
    try:
        factory = importlib.import_module(name).make_engine
        break
    except (ImportError, AttributeError):
        continue
tp, batches, steps = int(sys.argv[1]), [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3])
import torch
torch.set_num_threads(1)
engine = factory("models/dls-tiny", tp=tp, num_threads=1)
try:
    from shared.tasks import Split, TaskGenerator
    prompts = [engine.encode(q.prompt) for q in TaskGenerator(seed=7).problems(64, 3, Split.HELD_OUT)]
    engine.warm_up() if hasattr(engine, "warm_up") else None
    out = {}
    for b in batches:
        done, elapsed = 0, 0.0
        while done < steps:
            states = [engine.new_request(f"r{b}-{done}-{i}", prompts[(done + i) % 64], 64, 16,
                                         ignore_eos=True) for i in range(b)]
            batch = [(s, 0.9) for s in states]
            while batch and done < steps:
                t0 = time.perf_counter()
                engine.step(batch)
                elapsed += time.perf_counter() - t0
                done += 1
                batch = [(s, t) for s, t in batch if not s.finished]
            for s in states:
                engine.drop(s.request_id)
        out[str(b)] = round(done * b / elapsed, 2)
    print(json.dumps(out))
finally:
    close = getattr(engine, "close", None)
    if close is not None:
        close()
"""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _run(tree: Path, args: list[str], timeout_s: float) -> str:
    env = os.environ | {"PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} in {tree.name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def engine_request_steps(tree: Path, arch: str, batches: list[int], timeout_s: float) -> dict[str, float]:
    """Request-steps per second by batch of ``bench.engine --arch`` run in ``tree``."""
    out = _run(tree, ["-m", "bench.engine", "--arch", arch, "--device", "cpu", "--threads", "1",
                      "--batches", ",".join(map(str, batches))], timeout_s)
    figures = json.loads(out[out.index("{"):])
    tokens = figures["tokens_per_s_by_batch"]["engine"]
    per_step = figures["tokens_per_step_by_batch"]["engine"]
    return {b: round(tokens[b] / per_step[b], 2) for b in tokens}


def tp_request_steps(tree: Path, tp: int, batches: list[int], steps: int, timeout_s: float) -> dict[str, float]:
    out = _run(tree, ["-c", _TP_PROGRAM, str(tp), ",".join(map(str, batches)), str(steps)], timeout_s)
    return json.loads(out.strip().splitlines()[-1])


def alternate(measure, before: Path, after: Path, rounds: int, label: str) -> dict:
    """``measure(tree)`` of both trees, alternated (old first in odd rounds, new first in even ones)."""
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for r in range(rounds):
        order = [("old", before), ("new", after)] if r % 2 == 0 else [("new", after), ("old", before)]
        for name, tree in order:
            t0 = time.monotonic()
            runs[name].append(measure(tree))
            log(f"{label} round {r + 1}/{rounds} {name}: {runs[name][-1]} ({time.monotonic() - t0:.0f} s)")
    batches = list(runs["old"][0])
    medians = {name: {b: statistics.median(run[b] for run in rs) for b in batches} for name, rs in runs.items()}
    return {
        "rounds": {name: [{b: run[b] for b in batches} for run in rs] for name, rs in runs.items()},
        "median": medians,
        "new_over_old": {b: round(medians["new"][b] / medians["old"][b], 3) for b in batches},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="a checkout of the engine before the change (git worktree)")
    p.add_argument("--arch", default="llada-small")
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tp", type=int, default=0, help="also time this tensor-parallel degree (0: not)")
    p.add_argument("--tp-steps", type=int, default=120, help="steps per batch size of the TP timing")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument("--json", help="write the figures to this path too")
    args = p.parse_args(argv)
    before = Path(args.before).resolve()
    if not (before / "bench" / "engine.py").is_file():
        p.error(f"--before: {before} holds no checkout of this project (no bench/engine.py)")
    result = {
        "before": _revision(before), "after": _revision(ROOT), "arch": args.arch, "rounds_each": args.rounds,
        "request_steps_per_s": alternate(lambda t: engine_request_steps(t, args.arch, args.batches, args.timeout),
                                         before, ROOT, args.rounds, "engine"),
    }
    if args.tp:
        result[f"tp{args.tp}_request_steps_per_s"] = alternate(
            lambda t: tp_request_steps(t, args.tp, args.batches, args.tp_steps, args.timeout),
            before, ROOT, args.rounds, f"tp {args.tp}")
    emit_json(result, args.json)
    return 0


def _revision(tree: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree, capture_output=True,
                           text=True).stdout.strip()
    return done.stdout.strip() + ("+changes" if dirty else "")


if __name__ == "__main__":
    sys.exit(main())
