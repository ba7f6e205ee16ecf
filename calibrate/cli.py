"""`dls calibrate`: a model's calibration bundle (``shared.calibration``) for one kind of device.

    dls calibrate --model DIR [--device cpu|cuda] [--tp 1,2] [--prompts FILE] [--eval FILE --scorer NAME]
                  [--out DIR] [--thresholds 0.5,0.6,0.7,0.8,0.9] [--only profile,predictor,quality] ...

Three stages, in this order, each skipped when a finished run of it had the same inputs (and redone,
saying what changed, when not): the latency profile (``calibrate/profile.py``), the step predictor
(``calibrate/predictor.py``) and the quality curve (``calibrate/quality.py``). The manifest is written
last, once all three are in the bundle (``calibrate/bundle.py``). Every bad input is a ``CliError``
naming its flag.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from pathlib import Path

from shared.calibration import MANIFEST, PREDICTOR, PROFILE, QUALITY
from shared.cli import CliError

STAGES = ("profile", "predictor", "quality")
ARTEFACTS = {"profile": PROFILE, "predictor": f"{PREDICTOR}/model.txt", "quality": QUALITY}  # what each stage writes
DEFAULT_THRESHOLDS = "0.5,0.6,0.7,0.8,0.9"  # the scheduler's default candidates (DLS_SCHEDULER_THRESHOLDS)
DEFAULT_MAX_BATCH = 32  # the bundled profile's largest batch (at least the worker's max batch is measured)
CALIBRATION_DIR_ENV = "DLS_CALIBRATION_DIR"
DEFAULTS = {
    "device": "cpu", "tp": "1", "prompts_format": "auto", "thresholds": DEFAULT_THRESHOLDS,
    "only": ",".join(STAGES), "threads": 0, "max_batch": None, "repeats": 5, "prompt_tokens": None,
    "batch_size": 48, "max_prompts": 200, "max_eval": 400, "heldout_fraction": 0.2, "switch_fraction": 0.5,
    "gen_lengths": "", "block_lengths": "", "cache_modes": "dual", "seed": 0, "rounds": None,
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("calibrate", help="measure a model's latency profile, step predictor and quality curve "
                                                "on this device (a resumable calibration bundle)")
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--tp", help="tensor-parallel degrees of the profile, comma-separated (default 1)")
    p.add_argument("--prompts", help="the prompts the model will serve: JSONL of completion or chat bodies, ShareGPT "
                                     "JSON, or text one prompt a line (the bundled model: its task families)")
    p.add_argument("--prompts-format", help="auto (default), jsonl, sharegpt or text")
    p.add_argument("--eval", help="labelled problems: JSONL of a completion or chat body plus 'answer'")
    p.add_argument("--scorer", help="how --eval's answers are scored: exact, gsm8k, contains or choice")
    p.add_argument("--out", help=f"the bundle's directory (default ${CALIBRATION_DIR_ENV}, else DIR/calibration)")
    p.add_argument("--thresholds", help=f"candidate thresholds (default {DEFAULT_THRESHOLDS})")
    p.add_argument("--only", help="stages to run now: profile, predictor, quality (default all)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default torch's)")
    p.add_argument("--max-batch", type=int, help=f"largest batch profiled (default {DEFAULT_MAX_BATCH}, at least "
                                                 "the worker's max batch; on a GPU also bounded by memory)")
    p.add_argument("--repeats", type=int, help="profile: the median of this many repeats (default 5)")
    p.add_argument("--prompt-tokens", type=int, help="profile: the prompt length of its context (default the "
                                                     "median prompt; the canvas without prompts)")
    p.add_argument("--batch-size", type=int, help="requests decoded together for traces and quality (default 48)")
    p.add_argument("--max-prompts", type=int, help="prompts used at most, a seeded sample (default 200)")
    p.add_argument("--max-eval", type=int, help="labelled problems used at most, a seeded sample (default 400)")
    p.add_argument("--heldout-fraction", type=float, help="prompts held out to score the predictor (default 0.2)")
    p.add_argument("--switch-fraction", type=float, help="traced requests that switch threshold once (default 0.5)")
    p.add_argument("--gen-lengths", help="traces: canvases drawn per request (default: each prompt's)")
    p.add_argument("--block-lengths", help="traces: block lengths drawn per request (default: the model's)")
    p.add_argument("--cache-modes", help="quality: cache modes decoded, comma-separated (default dual, as served)")
    p.add_argument("--seed", type=int, help="prompt samples, the train/held-out cut, threshold switches (default 0)")
    p.add_argument("--rounds", type=int, help="predictor: boosting rounds (default `dls train-predictor`'s)")
    p.add_argument("--trust-remote-code", action="store_true", help="let a checkpoint's tokenizer code run "
                                                                    "(as DLS_TRUST_REMOTE_CODE)")
    p.set_defaults(func=_calibrate)


# --- arguments -------------------------------------------------------------------------------------


def _value(args: argparse.Namespace, name: str):
    value = getattr(args, name, None)
    return DEFAULTS.get(name) if value is None else value


def _numbers(args: argparse.Namespace, name: str, kind=float) -> tuple:
    flag, text = "--" + name.replace("_", "-"), _value(args, name)
    try:
        return tuple(kind(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise CliError(f"{flag}: expected {'integers' if kind is int else 'numbers'} separated by commas, "
                       f"got {text!r}") from None


def _positive(args: argparse.Namespace, name: str, allow_zero: bool = False) -> int | None:
    value = _value(args, name)
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise CliError(f"--{name.replace('_', '-')} must be {'>= 0' if allow_zero else 'positive'}, got {value}")
    return value


def _fraction(args: argparse.Namespace, name: str, low_open: bool) -> float:
    value = _value(args, name)
    if not (0 < value < 1 if low_open else 0 <= value <= 1):
        raise CliError(f"--{name.replace('_', '-')} must be in {'(0, 1)' if low_open else '[0, 1]'}, got {value}")
    return value


def _stages(args: argparse.Namespace) -> tuple[str, ...]:
    names = [s.strip() for s in _value(args, "only").split(",") if s.strip()]
    unknown = [s for s in names if s not in STAGES]
    if unknown or not names:
        raise CliError(f"--only: unknown stage {', '.join(unknown) or '(none)'} (stages: {', '.join(STAGES)})")
    return tuple(s for s in STAGES if s in names)


def _thresholds(args: argparse.Namespace) -> tuple[float, ...]:
    values = _numbers(args, "thresholds")
    if not values or not all(0 < t <= 1 for t in values):
        raise CliError(f"--thresholds must be in (0, 1], got {_value(args, 'thresholds')!r}")
    return tuple(sorted(set(values)))


def _model_dir(args: argparse.Namespace) -> Path:
    model = Path(args.model)
    if not model.is_dir():
        raise CliError(f"--model {model}: no such directory")
    if not (model / "config.json").exists():
        raise CliError(f"--model {model}: no config.json (not a model directory)")
    return model


def _device(args: argparse.Namespace, tp: tuple[int, ...]) -> str:
    from shared.devices import cuda_problem

    device = _value(args, "device")
    if device != "cpu" and not device.startswith("cuda"):
        raise CliError(f"--device {device}: expected cpu, cuda or cuda:N")
    problem = cuda_problem(device, max(tp))
    if problem:
        raise CliError(f"--device {device}: {problem}")
    return device


def _tp(args: argparse.Namespace) -> tuple[int, ...]:
    values = _numbers(args, "tp", int)
    if not values or min(values) < 1:
        raise CliError(f"--tp: expected positive degrees, got {_value(args, 'tp')!r}")
    return tuple(sorted(set(values)))


def _prompt_specs(args: argparse.Namespace):
    from calibrate.prompts import FORMATS, PromptFileError, file_digest, read_prompts

    if not args.prompts:
        return None, None
    fmt = _value(args, "prompts_format")
    if fmt not in FORMATS:
        raise CliError(f"--prompts-format {fmt}: unknown (one of {', '.join(FORMATS)})")
    try:
        return read_prompts(args.prompts, fmt), f"{file_digest(args.prompts)} ({Path(args.prompts).name})"
    except PromptFileError as exc:
        raise CliError(f"--prompts {args.prompts}: {exc}") from None


def _eval_specs(args: argparse.Namespace):
    from calibrate.prompts import PromptFileError, file_digest, read_problems
    from calibrate.scorers import SCORERS

    known = ", ".join(SCORERS)
    if args.scorer and not args.eval:
        raise CliError("--scorer needs --eval FILE (labelled problems to score)")
    if not args.eval:
        return None, None, None
    if not args.scorer:
        raise CliError(f"--eval needs --scorer (one of {known})")
    if args.scorer not in SCORERS:
        raise CliError(f"--scorer {args.scorer}: unknown (one of {known})")
    scorer = SCORERS[args.scorer]
    try:
        specs = read_problems(args.eval)
    except PromptFileError as exc:
        raise CliError(f"--eval {args.eval}: {exc}") from None
    for spec in specs:
        problem = scorer.check(spec.answer)
        if problem:
            raise CliError(f"--eval {args.eval}: line {spec.line}: {problem} (--scorer {scorer.name})")
    return specs, f"{file_digest(args.eval)} ({Path(args.eval).name})", scorer


def _bundle(args: argparse.Namespace, model: Path):
    from calibrate.bundle import Bundle
    from shared.calibration import bundle_dir

    out = args.out or os.environ.get(CALIBRATION_DIR_ENV) or None
    bundle = Bundle(bundle_dir(model, out))
    problem = bundle.check_writable()
    if problem:
        flag = "--out" if args.out else CALIBRATION_DIR_ENV if out else "--out (the model directory is not writable)"
        raise CliError(f"{problem}; pass {flag} DIR" if not args.out else f"--out {args.out}: {problem}")
    return bundle


def _max_batch(args: argparse.Namespace) -> int:
    value = _positive(args, "max_batch")
    if value is not None:
        return value
    try:
        from shared.settings import WorkerSettings

        return max(DEFAULT_MAX_BATCH, WorkerSettings().max_batch)
    except Exception:  # noqa: BLE001 - a bad DLS_WORKER_* setting is the worker's to report
        return DEFAULT_MAX_BATCH


def _command(args: argparse.Namespace) -> str:
    parts = ["dls", "calibrate", "--model", str(args.model)]
    for name in ("out", "prompts", "eval", "scorer", *DEFAULTS):
        value = getattr(args, name, None)
        if value is not None and value != DEFAULTS.get(name):
            parts += ["--" + name.replace("_", "-"), str(value)]
    if args.trust_remote_code:
        parts.append("--trust-remote-code")
    return shlex.join(parts)


def build_setup(args: argparse.Namespace):
    """The run the arguments ask for, checked (``CliError`` naming the flag); reads the prompt files."""
    from calibrate.session import Setup, is_bundled

    model = _model_dir(args)
    stages, thresholds, tp = _stages(args), _thresholds(args), _tp(args)
    device = _device(args, tp)
    cache_modes = tuple(m.strip() for m in _value(args, "cache_modes").split(",") if m.strip())
    if not cache_modes or any(m not in ("none", "prefix", "dual") for m in cache_modes):
        raise CliError(f"--cache-modes: expected none, prefix or dual, comma-separated, got {args.cache_modes!r}")
    for name in ("repeats", "batch_size", "max_prompts", "max_eval", "prompt_tokens", "rounds"):
        _positive(args, name)
    _positive(args, "threads", allow_zero=True)
    gen_lengths, block_lengths = _numbers(args, "gen_lengths", int), _numbers(args, "block_lengths", int)
    if min(gen_lengths + block_lengths, default=1) < 1:
        raise CliError("--gen-lengths and --block-lengths must be positive")
    prompt_specs, prompts_digest = _prompt_specs(args)
    eval_specs, eval_digest, scorer = _eval_specs(args)
    bundled = is_bundled(model)
    needs_prompts = "predictor" in stages or ("quality" in stages and eval_specs is None)
    if needs_prompts and prompt_specs is None and not bundled:
        raise CliError(
            f"--prompts: {model} is not the bundled model, whose task prompts stand in for them; its step predictor"
            " (and, without --eval, its quality curve) is calibrated on the prompts it will serve: pass --prompts FILE"
            " (JSONL of completion or chat bodies, ShareGPT JSON, or text one prompt a line), or --only profile")
    if prompt_specs is not None and "predictor" in stages and len(prompt_specs) < 10:
        raise CliError(f"--prompts {args.prompts}: {len(prompt_specs)} prompts; the predictor needs at least 10 "
                       "(some to train on, some held out to score it)")
    setup = Setup(
        model_dir=model, device=device, tp=tp, stages=stages, thresholds=thresholds, bundle=_bundle(args, model),
        bundled=bundled, prompt_specs=prompt_specs, prompts_digest=prompts_digest, eval_specs=eval_specs,
        eval_digest=eval_digest, scorer=scorer, max_batch=_max_batch(args), repeats=_value(args, "repeats"),
        batch_size=_value(args, "batch_size"), max_prompts=_value(args, "max_prompts"),
        max_eval=_value(args, "max_eval"), heldout_fraction=_fraction(args, "heldout_fraction", low_open=True),
        switch_fraction=_fraction(args, "switch_fraction", low_open=False), seed=_value(args, "seed"),
        cache_modes=cache_modes, prompt_tokens=_value(args, "prompt_tokens"), threads=_value(args, "threads"),
        rounds=_value(args, "rounds"), gen_lengths=gen_lengths, block_lengths=block_lengths,
        trust_remote_code=args.trust_remote_code, command=_command(args),
        args={**{k: _value(args, k) for k in ("model", "out", "prompts", "eval", "scorer", *DEFAULTS)},
              "trust_remote_code": args.trust_remote_code},
    )
    return setup


# --- the run ---------------------------------------------------------------------------------------


def _calibrate(args: argparse.Namespace) -> int:
    from calibrate.progress import Progress

    setup = build_setup(args)
    return run(setup, Progress())


def run(setup, progress) -> int:
    """Run the stages the setup asks for that are not done; write the manifest when the bundle is whole."""
    import torch

    from calibrate import predictor, profile, quality
    from calibrate.session import Session

    if setup.threads:
        torch.set_num_threads(setup.threads)
    session = Session(setup, progress)
    bundle = setup.bundle
    progress.say(f"dls calibrate: {setup.model_dir} on {setup.device} into {bundle.directory} "
                 f"(stages: {', '.join(setup.stages)})")
    keys = {"profile": profile.key(session), "predictor": predictor.key(session), "quality": quality.key(session)}
    todo = []
    for stage in setup.stages:
        done, changes = bundle.status(stage, keys[stage], bundle.path(ARTEFACTS[stage]))
        if done:
            progress.say(f"{stage}: done before with the same inputs: skipped")
        else:
            if changes:
                progress.say(f"{stage}: made before with other inputs ({'; '.join(changes)}): measuring again")
            elif bundle.record(stage) is not None:
                progress.say(f"{stage}: {bundle.path(ARTEFACTS[stage])} is gone: measuring again")
            todo.append(stage)
    if not todo and bundle.path(MANIFEST).exists():
        progress.say(f"nothing to do: {bundle.path(MANIFEST)} is up to date")
        return 0
    if todo and bundle.remove_manifest():
        progress.say(f"removed the old {bundle.path(MANIFEST)} (rewritten once every stage is done)")
    runners = {"profile": lambda: profile.run(session, keys["profile"]),
               "predictor": lambda: predictor.run(session, keys["predictor"]),
               "quality": lambda: quality.run(session, keys["quality"])}
    for stage in todo:
        started = time.monotonic()
        progress.note(f"{stage}: started ({todo.index(stage) + 1} of {len(todo)} stages to run)")
        bundle.forget(stage)
        summary = runners[stage]()
        elapsed = time.monotonic() - started
        bundle.finish(stage, keys[stage], summary, session.made_for(), elapsed)
        progress.say(f"{stage}: done in {elapsed:.1f} s")
    return _write_manifest(session, todo)


def _write_manifest(session, ran: list[str]) -> int:
    from shared.calibration import write_manifest

    setup, progress, bundle = session.setup, session.progress, session.setup.bundle
    records = {stage: bundle.record(stage) for stage in STAGES}
    missing = [s for s in STAGES if records[s] is None or not bundle.path(ARTEFACTS[s]).exists()]
    stale = [s for s in STAGES if s not in missing and _identity(records[s]) != session.identity]
    if missing or stale:
        why = "; ".join([*(f"no {s}" for s in missing), *(f"the {s} was made for other weights or another device"
                                                          for s in stale)])
        progress.say(f"no manifest yet ({why}): the bundle is incomplete and services treat {setup.model_dir} as "
                     f"uncalibrated; run `dls calibrate` with the stages it lacks (--only {','.join(missing + stale)})")
        return 0
    # what the profile was measured on names the device; the stages' keys agree on the weights and device
    made_for = session.made_for() if ran else records["profile"]["made_for"]
    path = write_manifest(bundle.directory, {
        "made_for": made_for,
        "created": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "made_by": "dls calibrate",
        "command": setup.command,
        "args": setup.args,
        "sizes": {
            "prompts": (records["predictor"]["summary"].get("train_prompts", 0)
                        + records["predictor"]["summary"].get("heldout_prompts", 0)),
            "eval_problems": records["quality"]["summary"].get("problems"),
            "trace_rows": (records["predictor"]["summary"].get("train_rows", 0)
                           + records["predictor"]["summary"].get("heldout_rows", 0)),
        },
        "artefacts": {s: {**records[s]["summary"], "made_with": _inputs(records[s])} for s in STAGES},
        "elapsed_s": {s: records[s]["elapsed_s"] for s in STAGES},
    })
    progress.say(f"wrote {path}: {setup.model_dir} is calibrated for {made_for['device']} "
                 f"({made_for['device_name']}) in {progress.elapsed():.1f} s")
    return 0


def _identity(record: dict) -> dict:
    return {k: record.get("key", {}).get(k) for k in ("weights", "tokenizer", "device")}


def _inputs(record: dict) -> dict:
    """A stage's key less the identity the manifest's made_for states."""
    return {k: v for k, v in record.get("key", {}).items() if k not in ("weights", "tokenizer", "device")}


def main(argv: list[str] | None = None) -> int:  # python -m calibrate.cli
    from services.cli import main as dls

    return dls(["calibrate", *(sys.argv[1:] if argv is None else argv)])
