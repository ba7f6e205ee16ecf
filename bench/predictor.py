"""Step predictor benchmark: error of one-shot, progress and progress-plus-confidence models on
held-out traces, the update-granularity study (the paper's Figure 7), and batched prediction cost.

    python -m bench.predictor --json runs/bench-predictor.json [--quick]

Traces come from ``--traces-dir`` (``train.csv``, ``heldout.csv``; written by `dls collect-traces`);
missing ones are collected first with the bundled model (about a minute, fewer with ``--quick``).
The three models are trained here from the train traces with the same code as
`dls train-predictor`, so they see identical data; ``training_size`` repeats the comparison with the
paper's budget of 100 training requests. Errors are over every held-out row (a request between
steps whose remaining steps all ran at the row's threshold); the one-shot estimate is the arrival
prediction aged by the steps run since (``one_shot_median_reference``: the same with the median
total per threshold instead of a model). ``committed_model`` scores the predictor in ``--model``.

Granularity: per-row predictions of the served model are replayed under each update policy (between
updates the last prediction is aged); cost is the number of updates. The chosen one is the cheapest
whose mean relative error is within 5% (relative) of per-step updates.

Latency: ``InProcessPredictor.predict`` end to end (features, both boosters, assembling results)
on 1, 64 and 1,024 (request, threshold) rows, median of repeats; ``per_row_cost_ratio`` is the
per-row time at 1,024 rows over the single-row call's time. ``all_thresholds`` times the service's
call shape (170 requests x 6 candidate thresholds); each granularity's ``predict_us_per_request`` is
its updates x 6 thresholds x the per-row time at 64 rows.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import emit_json
from services.cli import main as dls
from services.predictor.cli import HELDOUT_FILE, TRAIN_FILE
from services.predictor.core.evaluation import aged_one_shot, errors, granularity_study
from services.predictor.core.loading import predictor_dir
from services.predictor.core.model import ModelError, StepModel
from services.predictor.core.predictor import InProcessPredictor, PredictionQuery
from services.predictor.traces import DEFAULT_THRESHOLDS, TraceSet, read_traces
from services.predictor.training import ONE_SHOT, SERVED, evaluate, fit, predict_remaining
from shared.features import CONFIDENCE_FEATURE_NAMES, FEATURE_NAMES

MODELS = {"one_shot": ONE_SHOT, "progress": "progress", "progress_confidence": SERVED}
BATCH_ROWS = (1, 64, 1024)
PAPER_BUDGET_REQUESTS = 100
LONG_FAMILY = "chain"  # shared.tasks.Family.CHAIN: the multi-block answers
REPO_ROOT = Path(__file__).resolve().parents[1]


def ensure_traces(directory: Path, model_dir: str, quick: bool) -> None:
    """Collect whichever trace file is missing, with `dls collect-traces` (same seeds and settings)."""
    counts = {TRAIN_FILE: 200 if quick else 600, HELDOUT_FILE: 120 if quick else 300}
    missing = {name: count for name, count in counts.items() if not (directory / name).exists()}
    if missing:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON
            dls(["collect-traces", "--model", model_dir, "--out-dir", str(directory),
                 "--train-requests", str(missing.get(TRAIN_FILE, 0)),
                 "--heldout-requests", str(missing.get(HELDOUT_FILE, 0))])


def model_errors(train: TraceSet, heldout: TraceSet) -> tuple[dict, dict]:
    """(error table per model, fitted models)."""
    models = {key: fit(train, feature_set) for key, feature_set in MODELS.items()}
    return {key: evaluate(model, heldout) for key, model in models.items()}, models


def median_one_shot(train: TraceSet, heldout: TraceSet) -> dict:
    """A reference one-shot estimate without a model: the median total steps per threshold, aged."""
    arrival = train.take(train.steps == 0)
    medians = {t: float(np.median(arrival.remaining_steps[arrival.thresholds == t])) for t in np.unique(arrival.thresholds)}
    fallback = float(np.median(arrival.remaining_steps))
    totals = np.array([medians.get(t, fallback) for t in heldout.thresholds])
    return errors(aged_one_shot(totals, heldout.steps), heldout.remaining_steps)


def mre(table: dict) -> float:
    return table["overall"]["mre"]


def granularity(model: StepModel, heldout: TraceSet) -> dict:
    """Figure 7: replay per-row predictions under each update policy (from each request's first row)."""
    predicted, _ = predict_remaining(model, heldout)
    return granularity_study(heldout.request_ids, heldout.steps, heldout.progress, predicted, heldout.remaining_steps)


def queries_from(traces: TraceSet, count: int) -> list[PredictionQuery]:
    """``count`` queries rebuilt from trace rows (cycling), as the service would receive them."""
    out = []
    col = {name: i for i, name in enumerate(FEATURE_NAMES)}
    conf = [col[name] for name in CONFIDENCE_FEATURE_NAMES]
    for i in range(count):
        f = traces.features[i % len(traces)]
        gen, block, index = int(f[col["output_length"]]), int(f[col["block_length"]]), int(f[col["block_index"]])
        confidence = None if math.isnan(f[conf[0]]) else tuple(float(f[c]) for c in conf)
        ahead = f[col["end_blocks_left"]]
        out.append(PredictionQuery(f"q{i}", int(traces.steps[i % len(traces)]), gen, int(f[col["prompt_length"]]),
                                   block, round(f[col["full_progress"]] * gen), round(f[col["block_progress"]] * block),
                                   block, confidence, block_index=index,
                                   predicted_end=None if math.isnan(ahead) else int(index + ahead) * block))
    return out


def latency(model: StepModel, heldout: TraceSet, repeats: int) -> dict:
    predictor = InProcessPredictor(model)
    out = {}
    for rows in BATCH_ROWS:
        queries = queries_from(heldout, rows)
        predictor.predict(queries, (0.9,))  # warm up
        times = []
        for _ in range(max(repeats * 64 // rows, 20)):
            start = time.perf_counter()
            predictor.predict(queries, (0.9,))
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        out[str(rows)] = {"call_ms": median * 1e3, "per_row_us": median / rows * 1e6, "repeats": len(times)}
    return out


def latency_all_thresholds(model: StepModel, heldout: TraceSet, repeats: int) -> dict:
    """The service's call shape: many requests times every candidate threshold (about 1,024 rows)."""
    predictor = InProcessPredictor(model)
    queries = queries_from(heldout, BATCH_ROWS[-1] // len(DEFAULT_THRESHOLDS))
    predictor.predict(queries, DEFAULT_THRESHOLDS)
    times = []
    for _ in range(max(repeats // 5, 20)):
        start = time.perf_counter()
        predictor.predict(queries, DEFAULT_THRESHOLDS)
        times.append(time.perf_counter() - start)
    rows = len(queries) * len(DEFAULT_THRESHOLDS)
    median = statistics.median(times)
    return {"num_queries": len(queries), "num_thresholds": len(DEFAULT_THRESHOLDS), "call_ms": median * 1e3,
            "per_row_us": median / rows * 1e6}


def add_update_cost(study: dict, per_row_us: float) -> None:
    """Predictor time per request for each granularity: updates x candidate thresholds x row cost."""
    for row in study["table"]:
        row["predict_us_per_request"] = row["updates_per_request"] * len(DEFAULT_THRESHOLDS) * per_row_us


def training_size(train: TraceSet, heldout: TraceSet) -> dict:
    small = train.first_requests(PAPER_BUDGET_REQUESTS)
    return {
        "num_requests": small.num_requests,
        "relative_error": {key: mre(evaluate(fit(small, fs), heldout)) for key, fs in MODELS.items()},
    }


def committed_model(model_dir: str, heldout: TraceSet) -> dict:
    path = predictor_dir(model_dir)  # the calibration bundle's
    try:
        model = StepModel.load(path)
    except ModelError as exc:
        return {"path": str(path), "error": str(exc)}
    table = evaluate(model, heldout)
    return {"path": str(path), "trained_on": model.card.get("training", {}), "relative_error": mre(table),
            "absolute_error": table["overall"]["mae"]}


def breakdown(tables: dict, key: str) -> dict:
    """``{group: {model: relative error, ..., "num_rows": n}}`` from each model's error table (the
    models' keys as in ``relative_error``)."""
    groups = next(iter(tables.values())).get(key, {})
    return {
        group: {**{model: table[key][group]["mre"] for model, table in tables.items()},
                "num_rows": groups[group]["num_rows"]}
        for group in groups
    }


def acceptance(relative_error: dict, ratio: float, study: dict, by_family: dict) -> dict:
    pc, one_shot = relative_error["progress_confidence"], relative_error["one_shot"]
    long_family = by_family.get(LONG_FAMILY, {})
    return {
        "progress_confidence_at_most_half_one_shot": pc <= 0.5 * one_shot,
        "long_family_at_most_half_one_shot": bool(long_family)
        and long_family["progress_confidence"] <= 0.5 * long_family["one_shot"],
        "progress_confidence_below_progress": pc < relative_error["progress"],
        "per_row_cost_ratio_at_most_one_third": ratio <= 1 / 3,
        "granularity_within_5pct": study["relative_error_vs_per_step"] <= study["tolerance"] + 1e-12,
    }


def trace_info(traces: TraceSet) -> dict:
    return {"path": traces.path, "num_requests": traces.num_requests, "num_rows": len(traces),
            "seeds": list(traces.seeds), "switched_rows": int(traces.switched.sum())}


def rounded(value):
    if isinstance(value, float):
        return round(value, 5)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.predictor", description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the result here too")
    parser.add_argument("--quick", action="store_true", help="fewer timing repeats; smaller traces if collected")
    parser.add_argument("--traces-dir", default="data/predictor")
    parser.add_argument("--model", default="models/dls-tiny", help="engine model (collection) and its predictor/")
    parser.add_argument("--repeats", type=int, default=100, help="timing repeats at 64 rows (scaled by batch)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    directory = Path(args.traces_dir)
    ensure_traces(directory, args.model, args.quick)
    train, heldout = read_traces(directory / TRAIN_FILE), read_traces(directory / HELDOUT_FILE)
    tables, models = model_errors(train, heldout)
    relative_error = {key: mre(table) for key, table in tables.items()}
    study = granularity(models["progress_confidence"], heldout)
    timings = latency(models["progress_confidence"], heldout, 20 if args.quick else args.repeats)
    ratio = timings[str(BATCH_ROWS[-1])]["per_row_us"] / timings["1"]["per_row_us"]
    timings["all_thresholds"] = latency_all_thresholds(models["progress_confidence"], heldout,
                                                       20 if args.quick else args.repeats)
    add_update_cost(study, timings["64"]["per_row_us"])
    result = {
        "relative_error": relative_error,
        "absolute_error": {key: table["overall"]["mae"] for key, table in tables.items()},
        # predicted over actual remaining steps, summed (below 1: biased low, read as slack by the scheduler)
        "total_ratio": {key: table["overall"]["total_ratio"] for key, table in tables.items()},
        "by_family": breakdown(tables, "by_family"),
        "by_canvas": breakdown(tables, "by_canvas"),
        "by_block_index": breakdown(tables, "by_block_index"),
        "reduction": {
            "progress_vs_one_shot": 1 - relative_error["progress"] / relative_error["one_shot"],
            "progress_confidence_vs_one_shot": 1 - relative_error["progress_confidence"] / relative_error["one_shot"],
            "confidence_over_progress": 1 - relative_error["progress_confidence"] / relative_error["progress"],
        },
        "one_shot_median_reference": median_one_shot(train, heldout),
        "per_row_cost_ratio": ratio,
        "granularity": study,
        "latency": timings,
        "error_tables": tables,
        "training_size": training_size(train, heldout),
        "committed_model": committed_model(args.model, heldout),
        "traces": {"train": trace_info(train), "heldout": trace_info(heldout)},
        "meta": {"cpus": os.cpu_count(), "bench_wall_s": time.perf_counter() - started},
    }
    result["acceptance"] = acceptance(relative_error, ratio, study, result["by_family"])
    emit_json(rounded(result), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
