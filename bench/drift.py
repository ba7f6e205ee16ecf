"""Drift, measured live: a step predictor calibrated on one task family's prompts only, then served
traffic that shifts to another family halfway. Reports the predictor's live error before the shift, at
it and after it, and how long retraining on the served steps (``services/predictor/core/retraining.py``)
takes to bring it back within 1.2x of its error before the shift. Prints JSON (``--json`` writes it too).

    python -m bench.drift --json docs/bench/drift-cpu.json

1. **Calibrate** a copy of the bundled model whose calibration's predictor knows one family only::

       dls collect-traces --model COPY --families add=1 --gen-lengths 16 --block-lengths 8 --out-dir T
       dls train-predictor --traces T/train.csv --eval T/heldout.csv --out COPY/calibration/predictor

2. **Serve** it live: ``dls up --model COPY`` (fresh NATS and Redis ports, 2 workers at their own speed),
   retraining every ``--retrain-interval-s``; Poisson arrivals of the first family's held-out prompts for
   ``--phase-s`` seconds, then of the second family's for ``--shift-phase-s``.
3. **Measure** from the predictor's ``/metrics`` every ``--scrape-s``: ``dls_predictor_served_error``
   (its sum and count between two times: the mean relative error of the rows of the requests that
   finished between them, each scored by the predictor serving when it finished), the sliding
   ``dls_predictor_live_error`` and the retrains.

Why add -> words by default: served at one threshold, a short family's steps are very predictable (a
predictor trained on it scores a few percent), so the direction matters. From ``add`` (about 1.3 steps a
request) to ``words`` (about 12) the new family's rows soon fill the retraining window; the other way
round, ``add``'s few rows a request sit in the held-out share of a window still full of ``words`` rows
until they outnumber it, and nothing is learnt from them meanwhile (a smaller window adapts sooner).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common import emit_json, launch_stack, stop_stack
from loadgen.driver import poisson_plan, run_plan, summarize
from services.stack import SERVICES
from shared.calibration import MANIFEST, PREDICTOR, bundle_dir
from shared.runtime import free_port, free_port_range
from shared.tasks import Family

MAX_TOKENS, BLOCK_LENGTH = 16, 8  # the short families' requests: a canvas of 16 in blocks of 8
RECOVERY_FACTOR = 1.2  # "back" = within this factor of the error before the shift
SHADOW_NOTE = ("shadow decoding (the scheduler's quality watch) is measured by its own benchmark; this run "
               "serves every request at the highest candidate under light load, where shadow decoding has "
               "nothing to decode, so its share of the steps is not measured here")


# --- 1. calibrate on one family ------------------------------------------------------------------


def model_copy(args, run_dir: Path) -> Path:
    """Where the one-family copy goes (its directory's name is the model name requests ask for)."""
    return run_dir / f"{Path(args.model).name}-{args.before}-only"


def calibrate_copy(args, run_dir: Path) -> dict:
    """A copy of ``args.model`` whose calibration's predictor is trained on ``args.before`` traces only."""
    model = model_copy(args, run_dir)
    if model.exists():
        shutil.rmtree(model)
    shutil.copytree(args.model, model)
    traces, predictor = run_dir / "traces", bundle_dir(model) / PREDICTOR
    shutil.rmtree(predictor)
    commands = [
        ["collect-traces", "--model", str(model), "--families", f"{args.before}=1", "--train-requests",
         str(args.train_requests), "--heldout-requests", str(args.heldout_requests), "--gen-lengths", str(MAX_TOKENS),
         "--block-lengths", str(BLOCK_LENGTH), "--out-dir", str(traces)],
        ["train-predictor", "--traces", str(traces / "train.csv"), "--eval", str(traces / "heldout.csv"),
         "--out", str(predictor)],
    ]
    started = time.perf_counter()
    for command in commands:
        print("dls " + " ".join(command), file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "services.cli", *command], check=True, stdout=sys.stderr,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    card = json.loads((predictor / "card.json").read_text())
    _note_in_manifest(model, args.before, card)
    return {"family": args.before, "train_requests": card["training"]["num_requests"],
            "train_rows": card["training"]["num_rows"], "heldout_mre": card["error"]["overall"]["mre"],
            "seconds": round(time.perf_counter() - started, 1), "commands": ["dls " + " ".join(c) for c in commands]}


def _note_in_manifest(model: Path, family: str, card: dict) -> None:
    """The copy's manifest says its predictor is the one-family one (its other artefacts are the bundled model's)."""
    path = bundle_dir(model) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["artefacts"]["predictor"] = {
        "dir": PREDICTOR, "train_requests": card["training"]["num_requests"],
        "heldout_mre": round(card["error"]["overall"]["mre"], 4), "families": [family],
        "made_by": "bench.drift (one task family only)"}
    path.write_text(json.dumps(manifest, indent=2) + "\n")


# --- 2. serve -------------------------------------------------------------------------------------


def start_stack(args, model: Path, run_dir: Path, metrics_base: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, DLS_NATS_URL=f"nats://127.0.0.1:{free_port()}",
               DLS_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0", DLS_METRICS_PORT=str(metrics_base),
               DLS_PREDICTOR_RETRAIN="true", DLS_PREDICTOR_RETRAIN_INTERVAL_S=str(args.retrain_interval_s),
               DLS_PREDICTOR_RETRAIN_MIN_ROWS=str(args.min_rows),
               DLS_PREDICTOR_RETRAIN_WINDOW_ROWS=str(args.window_rows),
               DLS_PREDICTOR_RETRAIN_HOLDOUT_SHARE=str(args.holdout_share),
               DLS_PREDICTOR_LIVE_ERROR_ROWS=str(args.live_error_rows))
    argv = [sys.executable, "-m", "services.cli", "up", "--model", str(model), "--port", str(port), "--workers",
            str(args.workers), "--run-dir", str(run_dir / "stack")]
    url = f"http://127.0.0.1:{port}"
    return launch_stack(argv, env, run_dir / "stack.log", url), url


def shifting_plan(args) -> list:
    """The first family's prompts for ``phase_s`` seconds, then the second's for ``shift_phase_s``."""
    shape = {"slo_ms": args.slo_ms, "max_tokens": MAX_TOKENS, "block_length": BLOCK_LENGTH}
    before = poisson_plan(args.rate, args.phase_s, seed=args.seed, family=Family(args.before), **shape)
    after = poisson_plan(args.rate, args.shift_phase_s, seed=args.seed + 1, family=Family(args.after), **shape)
    return before + [dataclasses.replace(p, arrival_s=p.arrival_s + args.phase_s) for p in after]


# --- 3. measure -----------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict:
    """The predictor's figures this benchmark reads, from a /metrics page."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{v}" for _, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return {
        "sum": values.get("dls_predictor_served_error_sum", 0.0),
        "count": values.get("dls_predictor_served_error_count", 0.0),
        "live_error": values.get("dls_predictor_live_error"),
        "swapped": values.get("dls_predictor_retrains_total{swapped}", 0.0),
        "kept": values.get("dls_predictor_retrains_total{kept}", 0.0),
        "failed": values.get("dls_predictor_retrains_total{failed}", 0.0),
        "old_error": values.get("dls_predictor_retrain_error{old}"),
        "new_error": values.get("dls_predictor_retrain_error{new}"),
        "window_rows": values.get("dls_predictor_retrain_window_rows"),
    }


async def drive(url: str, plan: list, model: str, metrics_url: str, scrape_s: float) -> tuple[list, list[dict]]:
    """Send the plan (open loop) while scraping the predictor's metrics; (results, samples with ``t_s``)."""
    samples: list[dict] = []
    started = time.perf_counter()

    async def scrape(client: httpx.AsyncClient) -> None:
        try:
            text = (await client.get(metrics_url)).text
        except httpx.HTTPError:
            return
        samples.append({"t_s": round(time.perf_counter() - started, 2), **parse_metrics(text)})

    async def scraper(client: httpx.AsyncClient) -> None:
        while True:
            await scrape(client)
            await asyncio.sleep(scrape_s)

    async with httpx.AsyncClient(timeout=5.0) as client:
        task = asyncio.create_task(scraper(client))
        results = await run_plan(url, plan, model=model, cache="dual", timeout_s=120.0)
        await asyncio.sleep(2 * scrape_s)  # the last requests' rows reach the metrics
        task.cancel()
        await scrape(client)
    return results, samples


def _at(samples: list[dict], t: float) -> dict:
    """The last sample taken at or before ``t`` (the first one if none)."""
    before = [s for s in samples if s["t_s"] <= t]
    return before[-1] if before else samples[0]


def error_between(samples: list[dict], start: float, end: float) -> tuple[float | None, int]:
    """(mean relative error, rows) of the requests that finished between ``start`` and ``end``."""
    a, b = _at(samples, start), _at(samples, end)
    rows = int(b["count"] - a["count"])
    return ((b["sum"] - a["sum"]) / rows if rows else None), rows


def analyse(samples: list[dict], args) -> dict:
    shift, end = args.phase_s, args.phase_s + args.shift_phase_s
    before, before_rows = error_between(samples, shift - args.before_window_s, shift)
    timeline = []
    t = 0.0
    while t < samples[-1]["t_s"]:
        mre, rows = error_between(samples, t, t + args.bin_s)
        timeline.append({"t_s": round(t + args.bin_s, 1), "rows": rows,
                         "mre": None if rows < args.min_bin_rows or mre is None else round(mre, 4),
                         "live_error_gauge": _round(_at(samples, t + args.bin_s)["live_error"])})
        t += args.bin_s
    after_bins = [b for b in timeline if b["t_s"] > shift and b["mre"] is not None]
    limit = None if before is None else RECOVERY_FACTOR * before
    back = next((b for b in after_bins if limit is not None and b["mre"] <= limit), None)
    later = [b for b in after_bins if back is not None and b["t_s"] >= back["t_s"]]
    gauge_back = next((s for s in samples if s["t_s"] > shift + args.bin_s and limit is not None
                       and s["live_error"] is not None and s["live_error"] <= limit), None)
    after, after_rows = error_between(samples, end - args.before_window_s, end + args.bin_s)
    return {
        "before": _round(before), "before_rows": before_rows, "before_window_s": args.before_window_s,
        "at_shift": after_bins[0]["mre"] if after_bins else None,
        "peak": max((b["mre"] for b in after_bins), default=None),
        "after": _round(after), "after_rows": after_rows,
        "recovery_limit": _round(limit),
        "recovery_s": None if back is None else round(back["t_s"] - shift, 1),
        "bins_within_limit_after_recovery": f"{sum(b['mre'] <= limit for b in later)}/{len(later)}" if later else None,
        "recovery_s_by_gauge": None if gauge_back is None else round(gauge_back["t_s"] - shift, 1),
        "bin_s": args.bin_s, "timeline": timeline,
    }


def retrains(samples: list[dict], shift: float) -> list[dict]:
    """Each retrain the scrapes saw (at the scrape resolution): when, what it did, its held-out errors."""
    out = []
    for prev, cur in zip(samples, samples[1:], strict=False):
        for outcome in ("swapped", "kept", "failed"):
            if cur[outcome] > prev[outcome]:
                out.append({"t_s": cur["t_s"], "after_shift": cur["t_s"] > shift, "outcome": outcome,
                            "old_error": _round(cur["old_error"]), "new_error": _round(cur["new_error"])})
    return out


def retrain_log(run_dir: Path) -> list[str]:
    """The predictor's own lines about its retrains."""
    path = run_dir / "stack" / "logs" / "predictor.log"
    if not path.exists():
        return []
    return [line.strip() for line in path.read_text(errors="replace").splitlines() if re.search(r"retrained on", line)]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/dls-tiny", help="the model copied and calibrated on one family")
    p.add_argument("--before", default="add", choices=[f.value for f in Family], help="family calibrated on, served first")
    p.add_argument("--after", default="words", choices=[f.value for f in Family], help="family served after the shift")
    p.add_argument("--train-requests", type=int, default=200, help="traces of the calibration's predictor")
    p.add_argument("--heldout-requests", type=int, default=100)
    p.add_argument("--rate", type=float, default=3.0, help="arrivals per second")
    p.add_argument("--phase-s", type=float, default=120.0, help="seconds of the first family")
    p.add_argument("--shift-phase-s", type=float, default=180.0, help="seconds of the second family")
    p.add_argument("--slo-ms", type=float, default=20_000.0, help="every request's SLO (generous: no rejections)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--retrain-interval-s", type=float, default=15.0)
    p.add_argument("--min-rows", type=int, default=100, help="DLS_PREDICTOR_RETRAIN_MIN_ROWS")
    p.add_argument("--window-rows", type=int, default=800, help="DLS_PREDICTOR_RETRAIN_WINDOW_ROWS")
    p.add_argument("--holdout-share", type=float, default=0.2, help="DLS_PREDICTOR_RETRAIN_HOLDOUT_SHARE")
    p.add_argument("--live-error-rows", type=int, default=200, help="DLS_PREDICTOR_LIVE_ERROR_ROWS")
    p.add_argument("--scrape-s", type=float, default=2.0)
    p.add_argument("--bin-s", type=float, default=10.0, help="the timeline's bins")
    p.add_argument("--min-bin-rows", type=int, default=5, help="a bin with fewer rows has no error")
    p.add_argument("--before-window-s", type=float, default=60.0, help="the error before the shift: over this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/drift")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.before == args.after:
        p.error("--before and --after must be different families")
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    calibration = calibrate_copy(args, run_dir)
    metrics_base = free_port_range(len(SERVICES) + args.workers + 2)
    model = model_copy(args, run_dir)
    process, url = start_stack(args, model, run_dir, metrics_base)
    try:
        plan = shifting_plan(args)
        print(f"{len(plan)} requests: {args.before} for {args.phase_s:.0f} s, then {args.after} for "
              f"{args.shift_phase_s:.0f} s ...", file=sys.stderr, flush=True)
        metrics_url = f"http://127.0.0.1:{metrics_base + SERVICES.index('predictor')}/metrics"
        results, samples = asyncio.run(drive(url, plan, model.name, metrics_url, args.scrape_s))
    finally:
        stop_stack(process)
    if not samples:
        raise RuntimeError(f"no metrics were scraped from the predictor ({metrics_url})")
    shift = args.phase_s
    report = {
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "run_dir")},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "calibration": calibration,
        "served": {"before_shift": summarize([r for r in results if r.planned.arrival_s < shift], shift),
                   "after_shift": summarize([r for r in results if r.planned.arrival_s >= shift],
                                            args.shift_phase_s)},
        "live_error": analyse(samples, args),
        "retrains": retrains(samples, shift),
        "retrain_log": retrain_log(run_dir),
        "shadow_step_share": None,
        "shadow_note": SHADOW_NOTE,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    emit_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
