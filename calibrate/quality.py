"""The quality curve: accuracy per candidate threshold, decoded with the serving engine as requests are
served (batched, the dual cache, greedy, stopping at the answer's EOS block), in the format the scheduler
reads (``services.scheduler.core.threshold``: ``accuracy`` maps each threshold to an accuracy).

Where the accuracy comes from (``source`` in quality.json and in the manifest):

* ``labelled``: --eval's problems, each answer scored against the expected one by --scorer;
* ``task-families``: the bundled model without --eval: held-out problems of its task families, scored by
  each family's check (``shared.tasks.check_answer``), with a curve per family (``families``);
* ``agreement``: no labels: how often each threshold's answer is the highest threshold's answer on the
  prompts (--prompts): what a lower threshold changes, not whether either is right.

Cache modes (--cache-modes): ``dual`` as served by default; ``accuracy`` is the no-cache curve where
``none`` was measured, else the dual cache's (``accuracy_dual_cache``, ``accuracy_prefix_cache``: each mode's).
Each threshold's answers are kept in ``work/quality/`` as soon as they are decoded.
"""

from __future__ import annotations

import statistics
import time

from calibrate.bundle import read_json, write_json
from calibrate.prompts import EncodedPrompt
from calibrate.session import TASK_MAX_SHOTS, Session
from shared.calibration import QUALITY

LABELLED, TASKS, AGREEMENT = "labelled", "task-families", "agreement"
CURVE_KEYS = {"dual": "accuracy_dual_cache", "prefix": "accuracy_prefix_cache", "none": "accuracy_no_cache"}


def source(session: Session) -> str:
    setup = session.setup
    if setup.eval_specs is not None:
        return LABELLED
    return TASKS if setup.bundled and setup.prompt_specs is None else AGREEMENT


def key(session: Session) -> dict:
    setup = session.setup
    kind = source(session)
    what = {LABELLED: {"eval": setup.eval_digest, "--scorer": setup.scorer.name if setup.scorer else None,
                       "--max-eval": setup.max_eval},
            TASKS: {"eval": "task families", "--max-eval": setup.max_eval},
            AGREEMENT: {"prompts": setup.prompts_source, "--max-prompts": setup.max_prompts}}[kind]
    return {**session.identity, "source": kind, **what, "--seed": setup.seed, "--cache-modes": list(setup.cache_modes),
            "--thresholds": list(setup.thresholds)}


def decode(engine, prompts: list[EncodedPrompt], threshold: float, mode: str, batch_size: int,
           on_progress=None) -> tuple[list[str], list[int]]:
    """Every prompt's answer text (``shared.tokenizer.answer_text``, as the API returns it) and steps at
    ``threshold``, continuous batching of at most ``batch_size`` requests."""
    from shared.messages.base import CacheMode
    from shared.tokenizer import answer_text

    texts: list[str] = [""] * len(prompts)
    steps: list[int] = [0] * len(prompts)
    pending = list(range(len(prompts)))[::-1]
    active: list[tuple[int, object]] = []  # (index, state)
    done = 0
    while pending or active:
        while pending and len(active) < batch_size:
            i = pending.pop()
            p = prompts[i]
            active.append((i, engine.new_request(f"q{i}", list(p.token_ids), p.gen_length, None, CacheMode(mode),
                                                 max_tokens=p.max_tokens)))
        engine.step([(state, threshold) for _, state in active])
        for i, state in active:
            if state.finished:
                texts[i] = answer_text(engine.tokenizer, engine.answer(state).token_ids, engine.mask_id)
                steps[i] = state.num_steps
                done += 1
        active = [(i, s) for i, s in active if not s.finished]
        if on_progress is not None:
            on_progress(done, len(prompts))
    return texts, steps


def _items(session: Session) -> list[EncodedPrompt]:
    kind = source(session)
    if kind == LABELLED:
        return session.eval_problems
    if kind == TASKS:
        return session.task_eval()
    return session.user_prompts


def _score(session: Session, kind: str, items: list[EncodedPrompt], texts: list[str]) -> list[bool] | None:
    if kind == LABELLED:
        return [session.setup.scorer.score(t, p.answer) for p, t in zip(items, texts, strict=True)]
    if kind == TASKS:
        from shared.tasks import check_answer

        return [check_answer(p.problem, t) for p, t in zip(items, texts, strict=True)]
    return None  # agreement: scored against the highest threshold's answers once those are in


def _threshold_results(session: Session, stage_key: dict, kind: str, items: list[EncodedPrompt], mode: str,
                       tau: float, n: int, total: int) -> dict:
    """One threshold's answers (kept from an earlier run with the same key, else decoded now)."""
    setup, progress = session.setup, session.progress
    path = setup.bundle.work_path(f"quality/{mode}-{tau:g}.json")
    tau_key = {**{k: v for k, v in stage_key.items() if k != "--thresholds"}, "threshold": tau, "mode": mode}
    saved = read_json(path)
    if saved is not None and saved.get("key") == tau_key:
        progress.note(f"quality: threshold {tau:g} ({mode} cache) decoded before: kept")
        return saved
    started = time.monotonic()
    task = f"quality: threshold {tau:g} ({mode} cache, {n}/{total})"
    texts, steps = decode(session.engine, items, tau, mode, setup.batch_size,
                          lambda done, count: progress.count(task, done, count, "problems", started))
    result = {"key": tau_key, "threshold": tau, "mode": mode, "texts": texts, "steps": steps,
              "correct": _score(session, kind, items, texts), "elapsed_s": round(time.monotonic() - started, 1)}
    write_json(path, result)
    return result


def run(session: Session, stage_key: dict) -> dict:
    setup, progress = session.setup, session.progress
    kind = source(session)
    items = _items(session)
    if not items:
        from shared.cli import CliError

        raise CliError("quality: no problem fits the model (--eval / --prompts)")
    scorer = (setup.scorer.name if kind == LABELLED else "task" if kind == TASKS
              else f"agreement with threshold {max(setup.thresholds):g}")
    progress.say(f"quality: {len(items)} {'problems' if kind != AGREEMENT else 'prompts'} ({kind}, scorer {scorer}) "
                 f"at thresholds {', '.join(map(str, setup.thresholds))}, cache {', '.join(setup.cache_modes)}")
    started = time.monotonic()
    total = len(setup.cache_modes) * len(setup.thresholds)
    order = sorted(setup.thresholds, reverse=True)  # the highest first: agreement scores against it
    results = {mode: {tau: _threshold_results(session, stage_key, kind, items, mode, tau,
                                              m * len(order) + i + 1, total)
                      for i, tau in enumerate(order)} for m, mode in enumerate(setup.cache_modes)}
    curves = {mode: _curve(kind, by_tau, items) for mode, by_tau in results.items()}
    quality = _document(session, kind, scorer, len(items), curves, results)
    path = write_json(setup.bundle.path(QUALITY), quality)
    summary = {"file": QUALITY, "source": kind, "scorer": scorer, "problems": len(items),
               "accuracy": quality["accuracy"]}
    progress.say(f"quality: wrote {path} in {time.monotonic() - started:.1f} s: accuracy "
                 + ", ".join(f"{t} {a:.3f}" for t, a in quality["accuracy"].items()))
    return summary


MIN_PER_CANVAS = 20  # problems a canvas needs for a curve of its own (``accuracy@<canvas>``)


def _curve(kind: str, by_tau: dict[float, dict], items: list[EncodedPrompt]) -> dict:
    """accuracy (threshold -> share right or agreeing), families (task families only), by canvas (each
    canvas with at least ``MIN_PER_CANVAS`` problems: the scheduler keeps the budget on each request's
    own canvas, ``canvas_floors``), mean steps."""
    top = by_tau[max(by_tau)]["texts"]
    accuracy, families, steps, by_canvas = {}, {}, {}, {}
    canvases = [c for c in sorted({p.gen_length for p in items})
                if sum(p.gen_length == c for p in items) >= MIN_PER_CANVAS]
    for tau in sorted(by_tau):
        result = by_tau[tau]
        right = result["correct"] if kind != AGREEMENT else [
            a.strip() == b.strip() for a, b in zip(result["texts"], top, strict=True)]
        accuracy[str(tau)] = round(sum(right) / len(right), 4)
        steps[str(tau)] = round(statistics.fmean(result["steps"]), 3)
        if kind == TASKS:
            for family in dict.fromkeys(p.family for p in items):
                mine = [r for r, p in zip(right, items, strict=True) if p.family == family]
                families.setdefault(family, {})[str(tau)] = round(sum(mine) / len(mine), 4)
        for canvas in canvases:
            mine = [r for r, p in zip(right, items, strict=True) if p.gen_length == canvas]
            by_canvas.setdefault(canvas, {})[str(tau)] = round(sum(mine) / len(mine), 4)
    return {"accuracy": accuracy, "families": families, "by_canvas": by_canvas, "mean_steps": steps}


def _document(session: Session, kind: str, scorer: str, num_items: int, curves: dict, results: dict) -> dict:
    """quality.json (``bench/model_card.py:write_quality_curve``'s format, which the scheduler reads)."""
    setup = session.setup
    main = "none" if "none" in curves else setup.cache_modes[0]
    document = {
        "measured_by": "dls calibrate", "source": kind, "scorer": scorer, "problems": num_items,
        "thresholds": [str(t) for t in setup.thresholds], "cache_modes": list(setup.cache_modes),
        "accuracy": curves[main]["accuracy"],
    }
    for mode, curve in curves.items():
        document[CURVE_KEYS[mode]] = curve["accuracy"]
    if curves[main]["families"]:
        document["families"] = curves[main]["families"]
    for canvas, curve in curves[main]["by_canvas"].items():  # as bench.model_card writes them
        document[f"accuracy@{canvas}"] = curve
    document["mean_steps"] = {mode: curve["mean_steps"] for mode, curve in curves.items()}  # cache mode -> curve
    if kind == AGREEMENT:
        document["note"] = (f"no labelled problems (--eval): each threshold's accuracy is how often its answer is the "
                            f"answer at {max(setup.thresholds):g}, on {num_items} prompts of --prompts")
    elif kind == TASKS:
        document["max_shots"] = TASK_MAX_SHOTS
    document["seconds"] = {mode: round(sum(r["elapsed_s"] for r in by_tau.values()), 1)  # cache mode -> s
                           for mode, by_tau in results.items()}
    return document
