"""`dls collect-traces` and `dls train-predictor`: the step predictor's offline pipeline.

    dls collect-traces     # data/predictor/train.csv (train split) and heldout.csv (held-out split)
    dls train-predictor    # models/dls-tiny/calibration/predictor/ (+ oneshot/), card scored on heldout.csv
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shared.cli import CliError

DEFAULT_MODEL_DIR = "models/dls-tiny"
DEFAULT_DATA_DIR = "data/predictor"
TRAIN_FILE = "train.csv"
HELDOUT_FILE = "heldout.csv"
HELDOUT_SEED_OFFSET = 1000  # held-out problems and schedules come from a different seed


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_collect(subparsers)
    _register_train(subparsers)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


DEFAULT_FAMILIES = "add=0.35,words=0.35,chain=0.3"  # the short families and the long one


def _family_weights(text: str) -> dict:
    from shared.tasks import Family

    weights = {}
    for part in (p for p in text.split(",") if p.strip()):
        name, _, weight = part.partition("=")
        try:
            weights[Family(name.strip())] = float(weight) if weight else 1.0
        except ValueError:
            known = ", ".join(f.value for f in Family)
            raise argparse.ArgumentTypeError(f"expected family=weight pairs of {known}, got {part!r}") from None
    if not weights or min(weights.values()) < 0 or sum(weights.values()) <= 0:
        raise argparse.ArgumentTypeError(f"--families needs positive weights, got {text!r}")
    return weights


def _register_collect(subparsers) -> None:
    from services.predictor.traces import DEFAULT_THRESHOLDS

    p = subparsers.add_parser("collect-traces", help="run the engine over task problems and record predictor traces")
    p.add_argument("--model", default=DEFAULT_MODEL_DIR)
    p.add_argument("--out-dir", default=DEFAULT_DATA_DIR, help=f"writes {TRAIN_FILE} and {HELDOUT_FILE} here")
    p.add_argument("--train-requests", type=int, default=600, help="train-split problems (0: skip)")
    p.add_argument("--heldout-requests", type=int, default=300, help="held-out-split problems (0: skip)")
    p.add_argument("--seed", type=int, default=1, help=f"train seed; held-out uses seed + {HELDOUT_SEED_OFFSET}")
    p.add_argument("--thresholds", type=_floats, default=DEFAULT_THRESHOLDS)
    p.add_argument("--switch-fraction", type=float, default=0.5, help="requests that switch threshold once")
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--max-shots", type=int, default=8)
    p.add_argument("--families", type=_family_weights, default=_family_weights(DEFAULT_FAMILIES),
                   help=f"task families and their shares (default {DEFAULT_FAMILIES})")
    p.add_argument("--gen-lengths", type=_ints, default=(), help="drawn per request (default: the model's)")
    p.add_argument("--block-lengths", type=_ints, default=(), help="drawn per request (default: the model's)")
    p.add_argument("--cache", choices=["none", "prefix", "dual"], default="dual")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.set_defaults(func=_collect)


def _collect(args: argparse.Namespace) -> int:
    if args.train_requests < 0 or args.heldout_requests < 0 or args.batch_size < 1:
        raise CliError("--train-requests and --heldout-requests must be >= 0, --batch-size >= 1")
    if not args.thresholds or not all(0.0 <= t <= 1.0 for t in args.thresholds):
        raise CliError(f"--thresholds must be in [0, 1], got {args.thresholds}")
    if not 0.0 <= args.switch_fraction <= 1.0:
        raise CliError("--switch-fraction must be in [0, 1]")
    import torch

    from services.predictor.traces import CollectConfig, collect_traces, write_traces
    from services.worker.engine.engine import DLMEngine
    from services.worker.engine.request import EngineError
    from shared.tasks import Split, TaskGenerator

    torch.set_num_threads(args.threads)
    config = CollectConfig(tuple(args.thresholds), args.switch_fraction, batch_size=args.batch_size,
                           gen_lengths=args.gen_lengths, block_lengths=args.block_lengths, cache_mode=args.cache)
    engine = DLMEngine.from_pretrained(args.model)
    jobs = [(TRAIN_FILE, args.train_requests, args.seed, Split.TRAIN),
            (HELDOUT_FILE, args.heldout_requests, args.seed + HELDOUT_SEED_OFFSET, Split.HELD_OUT)]
    for name, count, seed, split in jobs:
        if count == 0:
            continue
        problems = TaskGenerator(seed, family_weights=args.families).problems(count, args.max_shots, split=split)
        try:
            rows = collect_traces(engine, problems, seed, config, on_progress=_progress_printer(name))
        except EngineError as exc:
            raise CliError(f"engine: {exc}") from None
        path = write_traces(Path(args.out_dir) / name, rows)
        _write_manifest(path, args, count, seed, split)
        print(f"\nwrote {path}: {count} requests, {len(rows)} rows, seed {seed}, split {split}")
    return 0


def _manifest_path(traces: Path) -> Path:
    return traces.with_name(traces.name + ".json")


def _write_manifest(traces: Path, args: argparse.Namespace, count: int, seed: int, split) -> None:
    """Which engine model and settings produced a trace file (copied into the predictor's card)."""
    model = Path(args.model)
    info_path = model / "training_info.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    manifest = {
        "engine_model": str(model),
        "engine_model_steps_done": info.get("steps_done"),
        "requests": count, "seed": seed, "split": str(split), "thresholds": list(args.thresholds),
        "switch_fraction": args.switch_fraction, "cache_mode": args.cache,
        "families": {f.value: w for f, w in args.families.items()}, "gen_lengths": list(args.gen_lengths),
        "block_lengths": list(args.block_lengths),
    }
    _manifest_path(traces).write_text(json.dumps(manifest, indent=2) + "\n")


def _read_manifest(traces: str) -> dict | None:
    path = _manifest_path(Path(traces))
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # optional: traces written by other tools have none


def _progress_printer(name: str):
    last = [-1]

    def show(done: int, total: int) -> None:
        if done != last[0] and (done % 50 == 0 or done == total):
            print(f"\r{name}: {done}/{total} requests", end="", file=sys.stderr, flush=True)
            last[0] = done

    return show


def _register_train(subparsers) -> None:
    p = subparsers.add_parser("train-predictor", help="train the LightGBM step predictor from traces")
    p.add_argument("--traces", default=f"{DEFAULT_DATA_DIR}/{TRAIN_FILE}")
    p.add_argument("--eval", default=f"{DEFAULT_DATA_DIR}/{HELDOUT_FILE}",
                   help="held-out traces for the card's error table ('' to skip)")
    p.add_argument("--out", default=f"{DEFAULT_MODEL_DIR}/predictor", help="model directory (one-shot model in oneshot/)")
    p.add_argument("--max-requests", type=int, default=None, help="train on the first N requests only")
    p.add_argument("--rounds", type=int, default=None, help="boosting rounds")
    p.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    import dataclasses

    from services.predictor.core.training import TrainingError, default_params
    from services.predictor.traces import TraceError, read_traces
    from services.predictor.training import ONE_SHOT, SERVED, evaluate, fit

    if args.max_requests is not None and args.max_requests < 1:
        raise CliError("--max-requests must be >= 1")
    if args.rounds is not None and args.rounds < 1:
        raise CliError("--rounds must be >= 1")

    def params(feature_set: str):
        defaults = default_params(feature_set)
        return defaults if args.rounds is None else dataclasses.replace(defaults, num_rounds=args.rounds)

    try:
        traces = read_traces(args.traces)
        if args.max_requests:
            traces = traces.first_requests(args.max_requests)
        held_out = read_traces(args.eval) if args.eval else None
        models = {fs: fit(traces, fs, params(fs)) for fs in (SERVED, ONE_SHOT)}
    except (TraceError, TrainingError) as exc:
        raise CliError(str(exc)) from None
    out = Path(args.out)
    manifest = _read_manifest(args.traces)
    for feature_set, model in models.items():
        if manifest is not None:
            model.card["training"]["collection"] = manifest
        if held_out is not None:
            model.card["error"] = evaluate(model, held_out)
        directory = model.save(out if feature_set == SERVED else out / "oneshot")
        error = model.card.get("error", {}).get("overall", {})
        print(f"wrote {directory}: {feature_set}, {model.card['training']['num_requests']} requests, "
              f"{model.card['num_rows']} rows; held-out error {json.dumps(error)}")
    return 0
