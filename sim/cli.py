"""``dls sim``, ``dls compare`` and ``dls capacity``: the simulator's commands."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from shared.cli import CliError


def register(subparsers) -> None:
    sim = subparsers.add_parser("sim", help="simulate one policy over a preset's sweep")
    _common(sim)
    sim.add_argument("--policy", default="dilaserve", help="policy name or variant label")
    sim.set_defaults(func=cmd_sim)

    compare = subparsers.add_parser("compare", help="policies side by side on the same arrivals")
    _common(compare)
    compare.add_argument("--policies", default=None, help="comma-separated (default: the preset's)")
    compare.add_argument("--plot", default=None, help="write a PNG figure here (needs matplotlib)")
    compare.add_argument("--no-fidelity", action="store_true", help="skip the model-in-the-loop check")
    compare.add_argument("--switch-s", type=float, default=None, metavar="S",
                         help="a multi-model preset: every model's switch time (s: deciding to start one of its "
                              "instances to that instance serving) instead of the preset's")
    compare.set_defaults(func=cmd_compare)

    capacity = subparsers.add_parser("capacity", help="highest request rate meeting an SLO-attainment target")
    _common(capacity)
    capacity.add_argument("--policy", default="dilaserve")
    capacity.add_argument("--target", type=float, default=0.9, help="SLO attainment, 0 to 1")
    capacity.set_defaults(func=cmd_capacity)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True, help="see sim/README.md; e.g. paper-bench")
    parser.add_argument("--quick", action="store_true", help="the preset's small size")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--engine", choices=("replay", "model"), default=None)
    parser.add_argument("--model", default="models/dls-tiny", help="bundled model directory")
    parser.add_argument("--profile", default="profiles/llada-8b-h100.json")
    parser.add_argument("--trace", default=None,
                        help="replay this trace (BurstGPT or Azure CSV, Mooncake JSONL), its timestamps scaled so "
                             "that its mean rate is each point's rate")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="with --trace: divide its timestamps by this instead; replaces the points' rates "
                             "(one point, labelled time-scale F)")
    parser.add_argument("--quality-budget", default=None, metavar="PP",
                        help="DiLaServe's candidates: the preset's thresholds within PP accuracy points of the "
                             "highest's on this model (default: the preset's, 1.0); 'none': all of them")
    parser.add_argument("--prediction", default="auto",
                        help="auto (the trained step predictor if present, else fallback), predictor, fallback")
    parser.add_argument("--no-pipelining", action="store_true",
                        help="no step sent ahead to its instance (the live DLS_SCHEDULER_PIPELINE_STEPS=false)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="every step waits for its scheduling pass (DLS_SCHEDULER_OVERLAP_MIN_TOKENS=0; "
                             "pipelining needs overlap, so it goes too)")
    parser.add_argument("--control-plane-ms", type=float, default=0.0, metavar="MS",
                        help="add MS to every step: a live stack's control-plane time per step, as `dls loadgen "
                             "--timelines` measures it (default 0: a GPU cluster's profile alone)")
    parser.add_argument("--kv-budget-mib", type=float, default=None, metavar="MIB",
                        help="KV cache memory per GPU: each instance holds tp x MIB / the profile's "
                             "kv_bytes_per_token context tokens, and placement, admission and preemption keep to "
                             "it (default: no budget). compare also runs every policy without it, for the report")
    parser.add_argument("--recompute-tokens", type=int, default=None, metavar="N",
                        help="the recompute tokens one step carries at most, block starts over it served by the "
                             "next steps (default: each instance's profile's budget, as the live scheduler's "
                             "DLS_SCHEDULER_RECOMPUTE_TOKENS; 0: no cap)")
    parser.add_argument("--overlap-min-tokens", type=int, default=None, metavar="N",
                        help="overlap continues requests with at least N tokens to go (default: the live "
                             "scheduler's, 32)")


def _setup(args):
    import torch

    from sim import experiments
    from sim.predictors import PREDICTION_SOURCES
    from sim.presets import PRESETS

    torch.set_num_threads(1)
    try:
        preset = PRESETS.get(args.preset)
    except KeyError as exc:
        raise CliError(f"--preset: {exc.args[0]}") from None
    if args.quick:
        preset = preset.quick()
    if args.trace is not None:
        preset = _with_trace(preset, args.trace, args.time_scale)
    elif args.time_scale is not None:
        raise CliError("--time-scale: scales a --trace; give one")
    if args.quality_budget is not None:
        preset = dataclasses.replace(preset, quality_budget_pp=_budget(args.quality_budget))
    if getattr(args, "kv_budget_mib", None) is not None:
        if not (args.kv_budget_mib > 0 and math.isfinite(args.kv_budget_mib)):
            raise CliError(f"--kv-budget-mib: must be positive, got {args.kv_budget_mib}")
        cluster = dataclasses.replace(preset.cluster, kv_budget_bytes=int(args.kv_budget_mib * 2**20))
        preset = dataclasses.replace(preset, cluster=cluster)
    if args.prediction not in PREDICTION_SOURCES:
        raise CliError(f"--prediction: unknown source {args.prediction!r}; known: {', '.join(PREDICTION_SOURCES)}")
    if not Path(args.profile).exists():
        raise CliError(f"--profile: file not found: {args.profile}")
    if preset.cluster.kv_budget_bytes:
        from shared.profiles import LatencyProfile

        profile = LatencyProfile.load(args.profile)
        if not profile.kv_bytes_per_token:
            raise CliError(f"--kv-budget-mib: {args.profile} has no kv_bytes_per_token")
        smallest = min(profile.kv_tokens(tp, preset.cluster.kv_budget_bytes) for tp in preset.cluster.tp_degrees)
        if smallest < 1:
            raise CliError(f"--kv-budget-mib: {args.kv_budget_mib:g} MiB holds no token of KV cache at "
                           f"{profile.kv_bytes_per_token} bytes per token")
    if not Path(args.model).is_dir():
        raise CliError(f"--model: not a directory: {args.model}")
    if not (args.control_plane_ms >= 0 and math.isfinite(args.control_plane_ms)):
        raise CliError(f"--control-plane-ms: must be >= 0, got {args.control_plane_ms}")
    return experiments.setup(preset, args.model, args.profile, prediction=args.prediction, steps=_steps(args),
                             control_plane_s=args.control_plane_ms / 1000.0)


def _steps(args):
    """Overlap and pipelining as the flags say (default: as the live scheduler runs them)."""
    from services.scheduler.core import StepConfig

    min_tokens = StepConfig().overlap_min_tokens if args.overlap_min_tokens is None else args.overlap_min_tokens
    if min_tokens < 0:
        raise CliError(f"--overlap-min-tokens: must be >= 0, got {min_tokens}")
    if args.recompute_tokens is not None and args.recompute_tokens < 0:
        raise CliError(f"--recompute-tokens: must be >= 0 (0: no cap), got {args.recompute_tokens}")
    return StepConfig(overlap_min_tokens=0 if args.no_overlap else min_tokens, pipelining=not args.no_pipelining,
                      recompute_tokens=args.recompute_tokens)


def _with_trace(preset, path: str, time_scale: float | None):
    """The preset replaying ``path``: the whole trace at every point, scaled to the point's rate; with
    ``time_scale``, one point at that scale (the points' rates are not run, so they are not shown)."""
    from shared.request_traces import TraceError, read_trace
    from sim.presets import Point

    try:
        trace = read_trace(path)
    except TraceError as exc:
        raise CliError(f"--trace: {exc}") from None
    changes = {"arrival": "trace", "trace_path": path, "duration_s": None, "time_scale": time_scale}
    workload = dataclasses.replace(preset.workload, **changes)
    points = preset.points
    if time_scale is not None:
        if not (time_scale > 0 and math.isfinite(time_scale)):
            raise CliError(f"--time-scale: must be positive, got {time_scale}")
        points = (Point(points[-1].rate_mult, f"time-scale {time_scale:g}"),)
    print(f"trace {path} ({trace.layout}): {len(trace.rows)} requests over {trace.rows[-1].arrival_s:.1f} s",
          file=sys.stderr)
    return dataclasses.replace(preset, workload=workload, points=points)


def _budget(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise CliError(f"--quality-budget: expected accuracy points (e.g. 1.0) or 'none', got {text!r}") from None
    if value < 0:
        raise CliError(f"--quality-budget: must be >= 0 points, got {value}")
    return value


def _check_policies(labels: list[str]) -> None:
    from services.scheduler.core.policies import POLICIES
    from sim.presets import VARIANTS

    for label in labels:
        if label not in POLICIES and label not in VARIANTS:
            known = ", ".join([*POLICIES, *VARIANTS])
            raise CliError(f"--policies: unknown policy {label!r}; known: {known}")


def _progress(label: str, point: dict) -> None:
    trace = (f"  (trace native {point['trace_native_rps']:.3f} req/s x scale {point['scale']:.4g})"
             if point.get("scale") is not None else "")
    print(
        f"  {label:<24} {point['label']:>8}  rps {point['rps']:8.2f}{trace}  SLO {100 * point['slo_attainment']:6.1f}%  "
        f"acc {100 * point['accuracy']:5.1f}%  mean {point['mean_latency_s']:.3f}s  p99 {point['p99_latency_s']:.3f}s  "
        f"tau {point['mean_threshold']:.3f}  ({point['wall_s']:.1f}s)",
        file=sys.stderr,
    )


def _write(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(_clean(data), indent=1))


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def cmd_sim(args) -> int:
    from sim import experiments

    _check_policies([args.policy])
    s = _setup(args)
    result = experiments.compare(s, [args.policy], args.engine, args.seed, _progress)
    result.pop("fidelity", None)
    _write(args.json, result)
    print_table(result)
    return 0


def cmd_compare(args) -> int:
    from sim import experiments
    from sim.multimodel import MULTI_PRESETS

    if args.preset in MULTI_PRESETS:
        return _compare_models(args)
    if args.switch_s is not None:
        raise CliError(f"--switch-s: only a multi-model preset ({', '.join(MULTI_PRESETS)}) switches models")
    s = _setup(args)
    labels = args.policies.split(",") if args.policies else list(s.preset.policies)
    _check_policies(labels)
    if args.no_fidelity:
        s.preset = dataclasses.replace(s.preset, fidelity_policies=())
    result = experiments.compare(s, labels, args.engine, args.seed, _progress)
    if s.preset.cluster.kv_budget_bytes:  # the same runs without the budget, beside them
        s.preset = dataclasses.replace(s.preset, cluster=dataclasses.replace(s.preset.cluster, kv_budget_bytes=0),
                                       fidelity_policies=())
        unbounded = experiments.compare(s, labels, args.engine, args.seed, _progress)
        for label, entry in unbounded["policies"].items():
            result["policies"][f"{label} (no KV budget)"] = entry
    _write(args.json, result)
    print_table(result)
    if args.plot:
        try:
            from sim.plots import plot_compare

            plot_compare(result, args.plot)
        except ImportError:
            raise CliError("--plot: matplotlib is not installed (pip install matplotlib)") from None
    return 0


def _compare_models(args) -> int:
    """``compare`` on a multi-model preset (``sim.multimodel``): its own runs and report."""
    import torch

    from sim import multimodel

    torch.set_num_threads(1)
    unsupported = [flag for flag, given in (("--trace", args.trace), ("--time-scale", args.time_scale),
                                            ("--kv-budget-mib", args.kv_budget_mib), ("--engine", args.engine),
                                            ("--plot", args.plot)) if given is not None]
    if unsupported:
        raise CliError(f"{unsupported[0]}: not supported by the multi-model preset {args.preset}")
    preset = multimodel.MULTI_PRESETS.get(args.preset)
    if args.quick:
        preset = preset.quick()
    if args.switch_s is not None:
        if not (args.switch_s >= 0 and math.isfinite(args.switch_s)):
            raise CliError(f"--switch-s: must be >= 0, got {args.switch_s}")
        preset = dataclasses.replace(preset, models=tuple(dataclasses.replace(m, switch_s=args.switch_s)
                                                          for m in preset.models))
    labels = args.policies.split(",") if args.policies else list(preset.policies)
    unknown = [label for label in labels if label not in multimodel.DIVISIONS]
    if unknown:
        raise CliError(f"--policies: {unknown[0]!r} is not one of {', '.join(multimodel.DIVISIONS)} "
                       f"(what {args.preset} runs)")
    if not Path(args.model).is_dir():
        raise CliError(f"--model: not a directory: {args.model}")
    if not Path(args.profile).exists():
        raise CliError(f"--profile: file not found: {args.profile}")
    ms = multimodel.multi_setup(preset, args.model, args.profile)

    def progress(label: str, summary: dict) -> None:
        per = ", ".join(f"{name} {100 * f['slo_attainment']:.1f}%" for name, f in summary["by_model"].items())
        print(f"  {label:<28} {summary['rate_mult']}x  SLO {100 * summary['slo_attainment']:5.1f}% ({per})  "
              f"acc {100 * summary['accuracy']:5.1f}%  ({summary['wall_s']:.0f}s)", flush=True)

    result = multimodel.compare(ms, labels, args.seed or 0, progress)
    _write(args.json, result)
    print_models_table(result)
    return 0


def print_models_table(result: dict) -> None:
    setup = result["setup"]
    models = list(setup["models"])
    print(f"preset {result['preset']}: {setup['num_gpus']} GPUs, models "
          + ", ".join(f"{n} (SLO {m['slo_s']:.2f}s, switch {m['switch_s']:g}s)" for n, m in setup["models"].items())
          + f", phases {setup['phase_s']}, nominal capacity {setup['nominal_capacity_rps']:.1f} req/s")
    head = "".join(f" {n[:12] + ' SLO %':>18} {'acc %':>6}" for n in models)
    print(f"{'policy':<12} {'point':>6} {'rps':>7} {'SLO %':>7} {'acc %':>7}{head}")
    for point in result["points"]:
        for label, s in point["policies"].items():
            per = "".join(f" {100 * s['by_model'][n]['slo_attainment']:18.1f} {100 * s['by_model'][n]['accuracy']:6.1f}"
                          for n in models)
            print(f"{label:<12} {point['rate_mult']:>5}x {point['rps']:7.2f} {100 * s['slo_attainment']:7.1f} "
                  f"{100 * s['accuracy']:7.1f}{per}")
        if "best_static_split" in point:
            print(f"  best static split at {point['rate_mult']}x: {point['best_static_split']}")
    hours = result.get("gpu_hours")
    if hours:
        print(f"GPU-hours: DiLaServe {hours['dilaserve']}, each model its own peak {hours['each_model_its_peak']} "
              f"(saving {100 * hours['saving']:.1f}%)")
    print("headline:", json.dumps(result["headline"]))


def cmd_capacity(args) -> int:
    from sim import experiments

    _check_policies([args.policy])
    if not 0 < args.target <= 1:
        raise CliError("--target: must be in (0, 1]")
    if args.time_scale is not None:
        raise CliError("--time-scale: fixes the replayed rate, and capacity searches over rates; leave it out")
    s = _setup(args)
    result = experiments.capacity(s, args.policy, args.target, args.seed)
    _write(args.json, result)
    print(f"{args.policy}: {result['max_rps']:.2f} req/s at >= {100 * args.target:.0f}% SLO attainment "
          f"({result['max_rate_mult']:.3f}x the nominal {result['nominal_capacity_rps']:.2f} req/s)")
    return 0


def print_table(result: dict) -> None:
    setup = result["setup"]
    trace = setup.get("trace")
    print(f"preset {result['preset']}: SLO {setup['slo_s']:.3f}s, nominal capacity {setup['nominal_capacity_rps']:.1f} "
          f"req/s, overlap {'on' if setup['overlap'] else 'off'}, pipelining {'on' if setup['pipelining'] else 'off'}")
    profile = setup.get("profile")
    if profile:
        derived = f"; TP-{', TP-'.join(map(str, profile['derived_tp']))} derived" if profile["derived_tp"] else ""
        smoothed = f"; {len(profile['smoothed'])} points smoothed" if profile["smoothed"] else ""
        print(f"profile {profile['path']}: {profile['model']} on {profile['device']}, "
              f"{'measured' if profile['measured'] else 'modelled'}{derived}{smoothed}")
    if trace:
        print(f"trace {trace['path']} ({trace['layout']}, {trace['num_requests']} requests): rps = the replayed "
              f"mean rate = native x scale")
    kv = setup.get("kv_budget")
    if kv:
        held = ", ".join(f"TP-{tp} {tokens}" for tp, tokens in kv["tokens_by_tp"].items())
        print(f"KV budget {kv['bytes_per_gpu'] / 2**20:g} MiB per GPU: tokens held per instance {held}")
    extra = f" {'native':>8} {'scale':>8}" if trace else ""
    extra += f" {'preempt':>8}" if kv else ""
    width = max([24, *(len(label) for label in result["policies"])])
    print(f"{'policy':<{width}} {'point':>12} {'rps':>9}{extra} {'SLO %':>7} {'acc %':>7} {'mean s':>8} {'p99 s':>8} "
          f"{'tau':>6}")
    for label, entry in result["policies"].items():
        for p in entry["points"]:
            extra = f" {p['trace_native_rps']:8.3f} {p['scale']:8.4g}" if trace else ""
            extra += f" {p.get('num_preemptions', 0):8d}" if kv else ""
            print(f"{label:<{width}} {p['label']:>12} {p['rps']:9.2f}{extra} {100 * p['slo_attainment']:7.1f} "
                  f"{100 * p['accuracy']:7.1f} {p['mean_latency_s']:8.3f} {p['p99_latency_s']:8.3f} "
                  f"{p['mean_threshold']:6.3f}")
    fid = result.get("fidelity")
    if fid:
        print(f"fidelity (replay vs model): SLO gap {fid['slo_attainment_gap_pp']:.2f} pp, "
              f"mean latency gap {fid['mean_latency_gap_pct']:.2f}% (targets 3 pp / 5%)")
