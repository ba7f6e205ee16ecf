"""The latency profile: recompute, cache and full steps per batch size and TP degree, measured with the
serving engine on this device (``services.worker.profiling``), in the ``shared.profiles`` format.

The context is anchored as `dls profile` anchors it: the model's default canvas plus a prompt (the
median prompt of --prompts, the bundled model's median task prompt, or --prompt-tokens). Batches double
from 1 up to --max-batch; on a GPU a batch that runs out of memory ends the curve there. TP > 1 runs the
worker's tensor-parallel engine (``services/worker/parallel/tp_engine.py``: one process per rank, gloo on a CPU, NCCL on
GPUs). Every batch measured is kept in ``work/profile-partial.json``, so a stopped run measures only what
it had not.
"""

from __future__ import annotations

import time

import torch

from calibrate.bundle import read_json, write_json
from calibrate.session import Session
from shared.calibration import PROFILE
from shared.profiles import LatencyProfile

PARTIAL = "profile-partial.json"


def key(session: Session) -> dict:
    from services.worker.profiling import device_name

    setup = session.setup
    return {**session.identity, "device_name": device_name(setup.device), "torch": torch.__version__,
            "--tp": list(setup.tp), "--max-batch": setup.max_batch, "--repeats": setup.repeats,
            "prompts": setup.prompts_source, "--prompt-tokens": setup.prompt_tokens}


def run(session: Session, stage_key: dict) -> dict:
    """Measure (what the partial file lacks), write ``profile.json``; its headline figures."""
    from services.worker.profiling import Curves, batch_sizes, measure_batches

    setup, progress, bundle = session.setup, session.progress, session.setup.bundle
    partial_path = bundle.work_path(PARTIAL)
    partial = read_json(partial_path)
    if partial is None or partial.get("key") != stage_key:
        partial = {"key": stage_key, "tp": {}}
    elif partial["tp"]:
        kept = sum(len(saved["ms"]["recompute_ms"]) for saved in partial["tp"].values())
        progress.say(f"profile: resuming: {kept} batch measurements kept from the run that stopped")
    engine = session.engine
    prompt_tokens, anchor = session.profile_prompt_tokens()
    context = engine.default_gen_length + prompt_tokens
    sizes = batch_sizes(setup.max_batch)
    progress.say(f"profile: TP {', '.join(map(str, setup.tp))} at batch {', '.join(map(str, sizes))}, context "
                 f"{context} tokens (canvas {engine.default_gen_length} + {prompt_tokens}: {anchor}), median of "
                 f"{setup.repeats} repeats")
    curves_by_tp: dict[int, Curves] = {}
    kv_bytes_per_token = engine.kv_memory().bytes_per_token
    started = time.monotonic()
    total = len(setup.tp) * len(sizes)
    for n, tp in enumerate(setup.tp):
        saved = partial["tp"].get(str(tp), {})
        curves = Curves({k: dict(v) for k, v in saved.get("ms", {}).items()} or Curves().ms,
                        saved.get("bounded_by_memory"))
        curves_by_tp[tp] = curves
        if curves.bounded_by_memory or all(str(b) in curves.ms["recompute_ms"] for b in sizes):
            continue

        def keep(batch: int, curves: Curves, tp: int = tp, n: int = n) -> None:
            partial["tp"][str(tp)] = {"ms": curves.ms, "bounded_by_memory": curves.bounded_by_memory}
            write_json(partial_path, partial)
            ms = {k: v[str(batch)] for k, v in curves.ms.items()}
            progress.note(f"profile: TP {tp} batch {batch} ({n * len(sizes) + sizes.index(batch) + 1}/{total}): "
                          f"recompute {ms['recompute_ms']} ms, cache {ms['cache_ms']} ms, full {ms['full_ms']} ms "
                          f"[{time.monotonic() - started:.1f} s]")

        with _tp_engine(session, tp) as tp_engine:
            measure_batches(tp_engine, sizes, context, setup.repeats, curves, on_batch=keep)
        if curves.bounded_by_memory:
            progress.say(f"profile: TP {tp}: batch {curves.bounded_by_memory} ran out of device memory; the curve "
                         f"ends at batch {max(curves.batches)}")
            partial["tp"][str(tp)] = {"ms": curves.ms, "bounded_by_memory": curves.bounded_by_memory}
            write_json(partial_path, partial)
    document = _document(session, engine, context, anchor, curves_by_tp, kv_bytes_per_token)
    profile = LatencyProfile.from_dict(document, source="the measured profile")  # loads as services load it
    path = write_json(bundle.path(PROFILE), document)
    partial_path.unlink(missing_ok=True)
    summary = {
        "file": PROFILE, "tp": list(setup.tp), "max_batch": min(profile.max_batch(tp) for tp in setup.tp),
        "context_tokens": context,
        "recompute_ms_b1": document["tp"][str(setup.tp[0])]["recompute_ms"].get("1"),
        "cache_ms_b1": document["tp"][str(setup.tp[0])]["cache_ms"].get("1"),
    }
    bounded = {str(tp): c.bounded_by_memory for tp, c in curves_by_tp.items() if c.bounded_by_memory}
    if bounded:
        summary["bounded_by_memory"] = bounded  # TP degree -> the first batch that did not fit
    if profile.smoothed:
        summary["smoothed"] = list(profile.smoothed)
    progress.say(f"profile: wrote {path} (recompute {summary['recompute_ms_b1']} ms, cache {summary['cache_ms_b1']} "
                 f"ms at batch 1, TP {setup.tp[0]}; largest batch {summary['max_batch']})")
    return summary


class _tp_engine:
    """The session's engine for TP 1; for TP > 1 the worker's tensor-parallel engine, the threads shared
    out between its ranks, closed afterwards."""

    def __init__(self, session: Session, tp: int) -> None:
        self.session, self.tp = session, tp
        self.engine = None
        self.threads = torch.get_num_threads()

    def __enter__(self):
        if self.tp == 1:
            return self.session.engine
        from services.worker.parallel.build import make_engine

        per_rank = max(1, self.threads // self.tp)
        self.session.progress.note(f"profile: starting TP {self.tp} ({self.tp} ranks, {per_rank} threads each)")
        torch.set_num_threads(per_rank)
        self.engine = make_engine(self.session.setup.model_dir, self.tp, self.session.setup.device,
                                  num_threads=per_rank, trust_remote_code=self.session.setup.trust_remote_code)
        return self.engine

    def __exit__(self, *exc) -> None:
        if self.engine is not None:
            self.engine.close()
            torch.set_num_threads(self.threads)


def _document(session: Session, engine, context: int, anchor: str, curves_by_tp: dict, kv_bytes_per_token: int) -> dict:
    from services.worker.profiling import device_name, profile_document

    setup = session.setup
    measured_on = (f"{device_name(setup.device)}, torch {torch.__version__}, {str(engine.model.dtype).removeprefix('torch.')}, "
                   f"attention {engine.attention.value}, CUDA graphs {'on' if engine.runner.graphs_enabled else 'off'}, "
                   f"{time.strftime('%Y-%m-%d')}: {setup.command}")
    notes = (f"measured by `dls calibrate` at TP {', '.join(map(str, setup.tp))} with the serving engine, median of "
             f"{setup.repeats} repeats; context: the canvas plus {anchor}")
    bounded = [f"TP {tp} from batch {c.bounded_by_memory}" for tp, c in curves_by_tp.items() if c.bounded_by_memory]
    if bounded:
        notes += f"; out of device memory at {', '.join(bounded)}"
    document = profile_document(engine, setup.model_dir.resolve().name, setup.device, context, curves_by_tp,
                                kv_bytes_per_token, notes)
    return {**document, "measured_on": measured_on}
