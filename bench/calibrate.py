"""`dls calibrate`'s acceptance (issue 46): a copy of the bundled model with its calibration removed,
calibrated from scratch on this machine, against what the project ships.

    python -m bench.calibrate [--json docs/bench/calibrate-cpu.json] [--prompts 120] [--problems 400]

What it does:

1. copies ``models/dls-tiny`` without its ``calibration/`` into a temporary directory;
2. writes P, ``--prompts`` prompts as JSONL completion bodies (``{"prompt": ...}``) from the task
   families' held-out split (``shared.tasks``; ``dls collect-traces``' mix of add, words and chain, 0 to 8
   worked examples), and E, ``--problems`` labelled problems (``{"prompt": ..., "answer": ...}``) of
   ``--family`` from the held-out split, made as ``bench.engine`` makes its per-family problems (0 to 5
   examples) but from another seed: an independent sample of the same family;
3. runs ``dls calibrate --model COPY --prompts P --eval E --scorer exact`` as a subprocess (its progress
   passes through on stderr) and times it;
4. reports the total time (acceptance: at most 10 minutes), the new quality curve against the committed
   one on the same family (``families.<family>`` of ``models/dls-tiny/calibration/quality.json``; exact
   match is that family's check for ``add``) at every threshold (acceptance: at most 4 points apart), and
   the new predictor's held-out error over the one-shot estimate's (acceptance: at most 0.5).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import emit_json
from shared.calibration import DIRECTORY, MANIFEST, QUALITY
from shared.tasks import Family, Split, TaskGenerator

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "dls-tiny"
TRACE_MIX = {Family.ADD: 0.35, Family.WORDS: 0.35, Family.CHAIN: 0.3}  # dls collect-traces' default families
LIMITS = {"total_s": 600.0, "max_abs_diff_pp": 4.0, "error_ratio": 0.5}


def copy_model(source: Path, target: Path) -> Path:
    """The model's own files, without its calibration (nor the replay traces beside it)."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(DIRECTORY, "replay"))
    return target


def write_prompts(path: Path, count: int, seed: int) -> Path:
    problems = TaskGenerator(seed, family_weights=TRACE_MIX).problems(count, max_shots=8, split=Split.HELD_OUT)
    path.write_text("".join(json.dumps({"prompt": p.prompt}) + "\n" for p in problems))
    return path


def write_problems(path: Path, count: int, seed: int, family: Family, max_shots: int = 5) -> Path:
    tasks = TaskGenerator(seed)
    problems = [tasks.problem(i % (max_shots + 1), Split.HELD_OUT, family) for i in range(count)]
    path.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in problems))
    return path


def dls_command() -> list[str]:
    dls = Path(sys.executable).with_name("dls")
    return [str(dls)] if dls.exists() else [sys.executable, "-m", "services.cli"]


def compare(new: dict, committed: dict) -> dict:
    """Threshold -> points (new minus committed), at every threshold both curves have."""
    return {t: round(100 * (new[t] - committed[t]), 2) for t in new if t in committed}


def run(args: argparse.Namespace) -> dict:
    committed = json.loads((MODEL / DIRECTORY / QUALITY).read_text())
    committed_curve = committed["families"][args.family]
    with tempfile.TemporaryDirectory(prefix="bench-calibrate-") as tmp:
        work = Path(tmp)
        model = copy_model(MODEL, work / "dls-tiny-copy")
        prompts = write_prompts(work / "prompts.jsonl", args.prompts, args.seed)
        problems = write_problems(work / "eval.jsonl", args.problems, args.seed + 1, Family(args.family))
        command = [*dls_command(), "calibrate", "--model", str(model), "--prompts", str(prompts), "--eval",
                   str(problems), "--scorer", "exact", *args.calibrate_args]
        print("$ " + " ".join(command), file=sys.stderr, flush=True)
        started = time.monotonic()
        done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        total_s = time.monotonic() - started
        sys.stderr.write(done.stdout)
        if done.returncode != 0:
            raise SystemExit(f"dls calibrate failed (exit {done.returncode})")
        manifest = json.loads((model / DIRECTORY / MANIFEST).read_text())
        quality = json.loads((model / DIRECTORY / QUALITY).read_text())
        card = json.loads((model / DIRECTORY / "predictor" / "card.json").read_text())
    new_curve = quality["accuracy"]
    diff = compare(new_curve, committed_curve)
    predictor = manifest["artefacts"]["predictor"]
    figures = {
        "total_s": round(total_s, 1),
        "elapsed_s_by_stage": manifest["elapsed_s"],
        "quality_new": new_curve,
        "quality_committed": committed_curve,
        "quality_committed_key": f"families.{args.family}",
        "quality_diff_pp": diff,
        "max_abs_diff_pp": max(abs(d) for d in diff.values()),
        "heldout_mre": predictor["heldout_mre"],
        "one_shot_mre": predictor["one_shot_mre"],
        "error_ratio": predictor["ratio"],
        "predictor_error_by_threshold": {t: round(e["mre"], 4) for t, e in card["error"]["by_threshold"].items()},
    }
    checks = {
        "total_s <= 600": figures["total_s"] <= LIMITS["total_s"],
        "max_abs_diff_pp <= 4": figures["max_abs_diff_pp"] <= LIMITS["max_abs_diff_pp"],
        "error_ratio <= 0.5": figures["error_ratio"] <= LIMITS["error_ratio"],
    }
    return {
        "command": "dls calibrate --model COPY --prompts P --eval E --scorer exact" + (
            " " + " ".join(args.calibrate_args) if args.calibrate_args else ""),
        "prompts": args.prompts, "problems": args.problems, "family": args.family, "seed": args.seed,
        "prompts_written": "held-out split, add/words/chain 0.35/0.35/0.3, 0-8 shots, completion bodies",
        "problems_written": f"held-out split, {args.family} only, 0-5 shots, exact answers",
        **figures,
        "sizes": manifest["sizes"],
        "made_for": manifest["made_for"],
        "profile": manifest["artefacts"]["profile"],
        "predictor": {k: v for k, v in predictor.items() if k != "made_with"},
        "checks": checks,
        "passed": all(checks.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the figures to this path too")
    parser.add_argument("--prompts", type=int, default=120, help="prompts in P")
    parser.add_argument("--problems", type=int, default=400, help="labelled problems in E")
    parser.add_argument("--family", default=Family.ADD.value, choices=[Family.ADD.value],
                        help="E's family (exact match scores it as its own check does)")
    parser.add_argument("--seed", type=int, default=4600)
    parser.add_argument("calibrate_args", nargs="*", help="more arguments for dls calibrate (after --)")
    args = parser.parse_args(argv)
    result = run(args)
    emit_json(result, args.json)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
