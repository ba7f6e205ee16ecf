"""The step predictor: traces of the model's own requests, then the served model and the one-shot model
trained on them as `dls train-predictor` trains them (``services.predictor.training``), scored on traces of
prompts held out.

The prompts are --prompts, shuffled with --seed and cut (--heldout-fraction held out), or the bundled
model's task families (their train and held-out splits). Each prompt runs once at every candidate
threshold, with the threshold switches `dls collect-traces` makes (``services.predictor.traces``,
``CollectConfig.every_threshold``). Each split's traces are kept under ``work/`` as soon as they are
collected; the predictor is written to ``work/`` and then moved into the bundle.
"""

from __future__ import annotations

import shutil
import time

from calibrate.bundle import read_json, write_json
from calibrate.prompts import EncodedPrompt
from calibrate.session import Session
from shared.calibration import ONE_SHOT, PREDICTOR
from shared.cli import CliError

SPLITS = ("train", "heldout")


def key(session: Session) -> dict:
    setup = session.setup
    return {**session.identity, "prompts": setup.prompts_source, "--max-prompts": setup.max_prompts,
            "--thresholds": list(setup.thresholds), "--seed": setup.seed, "--heldout-fraction": setup.heldout_fraction,
            "--switch-fraction": setup.switch_fraction, "--gen-lengths": list(setup.gen_lengths),
            "--block-lengths": list(setup.block_lengths), "--rounds": setup.rounds}


def _trace_prompts(prompts: list[EncodedPrompt]):
    from services.predictor.traces import TracePrompt

    return [TracePrompt(p.token_ids, p.family, p.problem.num_shots if p.problem is not None else 0,
                        p.gen_length if p.max_tokens is not None else None) for p in prompts]


def _collect(session: Session, split: str, prompts: list[EncodedPrompt], config, traces_key: dict):
    """The split's trace file: kept from an earlier run with the same key, else collected now."""
    from services.predictor.traces import collect_traces, write_traces

    bundle, progress = session.setup.bundle, session.progress
    path, record_path = bundle.work_path(f"traces-{split}.csv"), bundle.work_path(f"traces-{split}.json")
    record = read_json(record_path)
    if record is not None and record.get("key") == traces_key and path.exists():
        progress.say(f"predictor: {split} traces collected before ({record['requests']} requests, {record['rows']} "
                     f"rows): kept")
        return path, record
    seed = session.setup.seed + (0 if split == "train" else 1000)  # request ids and switches differ per split
    started = time.monotonic()
    task = f"predictor: tracing {split} prompts ({len(prompts)} prompts x {len(config.thresholds)} thresholds)"
    rows = collect_traces(session.engine, _trace_prompts(prompts), seed, config,
                          on_progress=lambda done, total: progress.count(task, done, total, "requests", started))
    write_traces(path, rows)
    record = {"key": traces_key, "prompts": len(prompts), "requests": len(prompts) * len(config.thresholds),
              "rows": len(rows), "seed": seed, "elapsed_s": round(time.monotonic() - started, 1)}
    write_json(record_path, record)
    progress.say(f"predictor: {split} traces: {record['requests']} requests, {len(rows)} rows in {record['elapsed_s']} s")
    return path, record


def run(session: Session, stage_key: dict) -> dict:
    import dataclasses

    from services.predictor.core.training import TrainingError, default_params
    from services.predictor.traces import CollectConfig, TraceError, read_traces
    from services.predictor.training import ONE_SHOT as ONE_SHOT_SET
    from services.predictor.training import SERVED, evaluate, fit

    setup, progress, bundle = session.setup, session.progress, session.setup.bundle
    train, heldout = session.prompt_split()
    progress.say(f"predictor: {len(train)} prompts to train on, {len(heldout)} held out ({setup.prompts_source}), "
                 f"each at thresholds {', '.join(map(str, setup.thresholds))}")
    config = CollectConfig(setup.thresholds, setup.switch_fraction, batch_size=setup.batch_size,
                           gen_lengths=setup.gen_lengths, block_lengths=setup.block_lengths, every_threshold=True)
    traces_key = {k: v for k, v in stage_key.items() if k != "--rounds"}
    files = {split: _collect(session, split, prompts, config, traces_key)
             for split, prompts in zip(SPLITS, (train, heldout), strict=True)}
    started = time.monotonic()
    progress.note("predictor: training the step predictor and the one-shot model (LightGBM)")
    try:
        traces, held_out = (read_traces(files[split][0]) for split in SPLITS)

        def params(feature_set: str):
            defaults = default_params(feature_set)
            return defaults if setup.rounds is None else dataclasses.replace(defaults, num_rounds=setup.rounds)

        models = {fs: fit(traces, fs, params(fs)) for fs in (SERVED, ONE_SHOT_SET)}
    except (TraceError, TrainingError) as exc:
        raise CliError(f"predictor: {exc} (--prompts: more prompts give more traces)") from None
    collection = _collection(session, config, len(train), len(heldout))
    made = bundle.work_path("predictor.new")
    shutil.rmtree(made, ignore_errors=True)
    errors = {}
    for feature_set, model in models.items():
        model.card["training"]["collection"] = collection
        model.card["error"] = evaluate(model, held_out)
        errors[feature_set] = model.card["error"]["overall"]
        model.save(made if feature_set == SERVED else made / ONE_SHOT)
    target = bundle.replace_predictor(made)
    heldout_mre, one_shot_mre = errors[SERVED]["mre"], errors[ONE_SHOT_SET]["mre"]
    summary = {
        "dir": PREDICTOR, "prompts": setup.prompts_source, "train_prompts": len(train), "heldout_prompts": len(heldout),
        "train_requests": traces.num_requests,
        "heldout_requests": held_out.num_requests, "train_rows": len(traces), "heldout_rows": len(held_out),
        "heldout_mre": round(heldout_mre, 4), "one_shot_mre": round(one_shot_mre, 4),
        "ratio": round(heldout_mre / one_shot_mre, 4) if one_shot_mre else None,
        "total_ratio": round(errors[SERVED]["total_ratio"], 4),
    }
    progress.say(f"predictor: wrote {target} in {time.monotonic() - started:.1f} s: held-out error (mean relative) "
                 f"{summary['heldout_mre']} vs the one-shot estimate's {summary['one_shot_mre']} "
                 f"(x{summary['ratio']}) over {summary['heldout_requests']} held-out requests")
    return summary


def _collection(session: Session, config, num_train: int, num_heldout: int) -> dict:
    """How the traces were made (the card's ``training.collection``, as `dls collect-traces` records it)."""
    setup = session.setup
    return {
        "engine_model": str(setup.model_dir), "made_by": "dls calibrate", "prompts": setup.prompts_source,
        "train_prompts": num_train, "heldout_prompts": num_heldout, "seed": setup.seed,
        "heldout_fraction": setup.heldout_fraction, "thresholds": list(config.thresholds),
        "every_threshold": True, "switch_fraction": config.switch_fraction, "cache_mode": config.cache_mode,
        "gen_lengths": list(config.gen_lengths), "block_lengths": list(config.block_lengths),
    }
