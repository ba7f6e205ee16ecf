"""``dls loadgen``: open-loop load against a running gateway, with a report (JSON) and a figure (PNG).

    dls loadgen --url http://127.0.0.1:8000 --rate 2 --num-requests 100 --json runs/load.json --plot runs/load.png
    dls loadgen --trace tests/data/burstgpt_sample.csv --time-scale 10 --trace-model GPT-4 --json runs/trace.json
    dls loadgen --trace tests/data/AzureLLMInferenceTrace_conv_first10min.csv --target-rate 3 --num-requests 300
    dls loadgen --endpoint chat --rates 0.5,1,2,4 --goodput ttft:1000 tpot:100 e2el:5000 --json runs/sweep.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from shared.cli import CliError


def register(subparsers) -> None:
    p = subparsers.add_parser("loadgen", help="open-loop load against a gateway; report in vLLM's metric names",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    p.add_argument("--api-key", default=os.environ.get("DLS_API_KEY"), help="Bearer key (default: DLS_API_KEY)")
    p.add_argument("--model", default="dls-tiny", help="the served model's name")
    p.add_argument("--endpoint", default="completions", choices=("completions", "chat"),
                   help="/v1/completions, or /v1/chat/completions (the prompt as one user message)")
    g = p.add_argument_group("arrivals")
    g.add_argument("--arrival", default=None, choices=("poisson", "gamma", "constant", "ramp"),
                   help="arrival process (default poisson; --trace replays a trace file instead)")
    g.add_argument("--rate", type=float, default=1.0, help="mean requests per second (poisson, gamma, constant)")
    g.add_argument("--rates", default=None, metavar="R1,R2,...",
                   help="a sweep: one run per rate, in order (with --trace: per target rate); the JSON holds "
                        "every run's report under 'sweep'")
    g.add_argument("--num-requests", type=int, default=None,
                   help="requests to send (at most; default 100, or every row of a --trace)")
    g.add_argument("--duration", type=float, default=None, help="stop arrivals after this many seconds")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma: shape of the gaps (vLLM's burstiness; 1 = Poisson, below 1 burstier)")
    g.add_argument("--ramp-start-rps", type=float, default=1.0)
    g.add_argument("--ramp-end-rps", type=float, default=10.0)
    g.add_argument("--trace", default=None,
                   help="trace to replay: BurstGPT CSV (either column layout), Azure LLM inference CSV "
                        "(TIMESTAMP,ContextTokens,GeneratedTokens) or Mooncake JSONL (timestamp in ms, input_length, "
                        "output_length); the layout is read from the file")
    g.add_argument("--time-scale", type=float, default=None,
                   help="trace: seconds = (timestamp - first) / this (default 1: the trace's own pace)")
    g.add_argument("--target-rate", type=float, default=None,
                   help="trace: scale the timestamps so that the replayed requests' mean rate is this (req/s); "
                        "the bursts keep their shape")
    g.add_argument("--trace-model", action="append", default=[],
                   help="trace: keep only this BurstGPT model (repeatable)")
    g.add_argument("--keep-failures", action="store_true", help="trace: replay failed rows (0 response tokens) too")
    g.add_argument("--save-trace", default=None, help="write the arrivals as a BurstGPT CSV (for dls sim --trace)")
    g = p.add_argument_group("requests")
    g.add_argument("--lengths", default=None, choices=("fixed", "sharegpt-like", "sharegpt"),
                   help="fixed (default): --num-shots and --gen-len; sharegpt-like: synthetic ShareGPT lengths "
                        "(a trace's own lengths with --trace); sharegpt: prompts from --sharegpt")
    g.add_argument("--sharegpt", default=None, help="ShareGPT JSON file (implies --lengths sharegpt)")
    g.add_argument("--num-shots", type=int, default=5, help="few-shot examples per task prompt")
    g.add_argument("--gen-len", type=int, default=16, help="max_tokens (the mean or cap for other lengths)")
    g.add_argument("--block-len", type=int, default=8, help="block_length")
    g.add_argument("--family", default=None, choices=("add", "words", "chain"),
                   help="only this task family (chain: the long one; send --gen-len 128 --block-len 32)")
    g.add_argument("--slo-ms", type=float, default=None, help="every request's SLO (default: the gateway's)")
    g.add_argument("--slo-class", action="append", default=[], metavar="NAME:FACTOR[:PRIO[:WEIGHT[:FLOOR]]]",
                   help="an SLO class: SLO = FACTOR x --slo-ms, priority, share of requests, min_threshold")
    g.add_argument("--cache", default=None, choices=("none", "prefix", "dual"), help="KV cache (default: gateway's)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("sending and output")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    g.add_argument("--no-stream", action="store_true", help="plain JSON answers (no TTFT, TPOT, ITL)")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    g.add_argument("--warmup", type=int, default=0, help="send this many requests first (not reported)")
    g.add_argument("--goodput", nargs="+", action="extend", default=[], metavar="KEY:MS",
                   help="vLLM's goodput constraints (ttft, tpot, e2el in ms): goodput counts the completed "
                        "requests per second that meet all of them (default: each request's own SLO)")
    g.add_argument("--timelines", action="store_true",
                   help="after the run, read the finished requests' step timelines and report the live stack's "
                        "control-plane time per step under 'control_plane' (for dls sim --control-plane-ms) and "
                        "the mean batch of the steps that started while requests waited under 'batch_when_queued'")
    g.add_argument("--json", default=None, help="write the report here")
    g.add_argument("--plot", default=None, help="write a PNG figure here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--dry-run", action="store_true", help="print the plan's arrivals and exit")
    p.set_defaults(func=cmd_loadgen)


def spec_from_args(args):
    from loadgen.workload import LoadSpec, WorkloadError, parse_slo_class

    lengths = args.lengths or ("sharegpt" if args.sharegpt else "fixed")
    try:
        classes = tuple(parse_slo_class(text) for text in args.slo_class)
    except WorkloadError as exc:
        raise CliError(str(exc)) from None
    if args.trace and args.arrival:
        raise CliError("--arrival and --trace: give one (a trace brings its own arrival times)")
    if not args.trace and (args.time_scale is not None or args.target_rate is not None):
        raise CliError(f"{'--time-scale' if args.time_scale is not None else '--target-rate'}: sets a --trace's pace; "
                       "give --trace (or --rate for generated arrivals)")
    return LoadSpec(
        arrival="trace" if args.trace else (args.arrival or "poisson"), rate_rps=args.rate,
        num_requests=args.num_requests or (10**9 if args.trace else 100), duration_s=args.duration, burstiness=args.burstiness,
        ramp_start_rps=args.ramp_start_rps, ramp_end_rps=args.ramp_end_rps, trace_path=args.trace,
        time_scale=args.time_scale, target_rate_rps=args.target_rate, trace_models=tuple(args.trace_model),
        keep_failures=args.keep_failures,
        lengths=lengths, sharegpt_path=args.sharegpt, num_shots=args.num_shots, gen_len=args.gen_len,
        block_len=args.block_len, family=args.family, slo_ms=args.slo_ms, seed=args.seed,
        **({"slo_classes": classes} if classes else {}),
    )


def _rates(args) -> list[float] | None:
    if args.rates is None:
        return None
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        raise CliError(f"--rates {args.rates!r}: expected comma-separated requests per second") from None
    if not rates or any(r <= 0 for r in rates):
        raise CliError(f"--rates {args.rates!r}: every rate must be positive")
    return rates


def _goodput(args) -> dict[str, float]:
    from loadgen.report import GoodputError, parse_goodput

    try:
        constraints = parse_goodput(args.goodput)
    except GoodputError as exc:
        raise CliError(str(exc)) from None
    if args.no_stream and {"ttft", "tpot"} & set(constraints):
        raise CliError("--goodput ttft/tpot: TTFT needs streamed answers; drop --no-stream")
    return constraints


def cmd_loadgen(args) -> int:
    rates = _rates(args)
    goodput = _goodput(args)
    if rates is None:
        report = _one_run(args, goodput)
        if report is None:
            return 0
        _write(args, report, args.plot)
        return 0
    reports = []
    for rate in rates:
        if args.trace:
            args.target_rate = rate
        else:
            args.rate = rate
        print(f"rate {rate:g} req/s", file=sys.stderr)
        report = _one_run(args, goodput)
        if report is None:
            continue  # a dry run: each rate's plan printed
        report["rate_rps"] = rate
        reports.append(report)
    if args.dry_run:
        return 0
    from loadgen.report import sweep_table

    print(sweep_table(reports), file=sys.stderr)
    summary = {"endpoint": args.endpoint, "rates": rates, "goodput_constraints_ms": goodput or None,
               "goodput": [r["goodput"] for r in reports], "sweep": reports}
    _write(args, summary, None)
    if args.plot:
        from loadgen.plot import plot_report

        stem, suffix = os.path.splitext(args.plot)
        for report in reports:
            plot_report(report, f"{stem}-{report['rate_rps']:g}{suffix or '.png'}")
    return 0


def _write(args, report: dict, plot: str | None) -> None:
    text = json.dumps(_without_rows(report), indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if plot:
        from loadgen.plot import plot_report

        plot_report(report, plot)


def _without_rows(report: dict) -> dict:
    """The report without the per-request rows (what is printed)."""
    out = {k: v for k, v in report.items() if k != "requests"}
    if "sweep" in out:
        out["sweep"] = [_without_rows(r) for r in out["sweep"]]
    return out


def _one_run(args, goodput: dict[str, float]) -> dict | None:
    """Plan and run (None: a dry run, printed)."""
    import dataclasses

    from loadgen.workload import WorkloadError, plan_load, write_burstgpt

    spec = spec_from_args(args)
    try:
        load = plan_load(spec)
    except WorkloadError as exc:
        raise CliError(str(exc)) from None
    plan = load.requests
    if load.scale is not None:
        print(f"trace {spec.trace_path}: {len(plan)} requests, native {load.trace_native_rps:.4g} req/s x scale "
              f"{load.scale:.4g} = {load.rate_rps:.4g} req/s replayed", file=sys.stderr)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise CliError("--max-concurrency: must be at least 1")
    if args.save_trace:
        write_burstgpt(plan, args.save_trace, args.model)
    if args.dry_run:
        print(json.dumps([{"arrival_s": p.arrival_s, "max_tokens": p.max_tokens, "slo_ms": p.slo_ms,
                           "slo_class": p.slo_class, "prompt_chars": len(p.prompt)} for p in plan]))
        return None
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
    config["spec"] = {k: list(v) if isinstance(v, tuple) and k == "trace_models" else v
                      for k, v in dataclasses.asdict(spec).items() if k != "slo_classes"}
    config["spec"]["slo_classes"] = [dataclasses.asdict(c) for c in spec.slo_classes]
    # a trace: the mean rate replayed, the trace's own over the same requests, and the factor between them
    config.update(replayed_rps=load.rate_rps, trace_native_rps=load.trace_native_rps, scale=load.scale)
    report = run(args, plan, config, goodput)
    from loadgen.report import headline

    print(headline(report), file=sys.stderr)
    return report


def run(args, plan, config: dict, goodput: dict[str, float] | None = None) -> dict:
    """Warm-up (if asked), then the plan; the report."""
    from loadgen.driver import poisson_plan, run_plan
    from loadgen.report import build_report

    common = dict(model=args.model, cache=args.cache, timeout_s=args.timeout, stream=not args.no_stream,
                  max_concurrency=args.max_concurrency, api_key=args.api_key, endpoint=args.endpoint)
    if args.warmup > 0:
        warmup = poisson_plan(2.0, args.warmup, slo_ms=60_000.0, max_tokens=args.gen_len, seed=args.seed + 1)
        asyncio.run(run_plan(args.url, warmup[: args.warmup], **common))
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(plan), desc="requests", unit="req", file=sys.stderr)

    def progress(result) -> None:
        if bar is not None:
            bar.update(1)
            if not result.finished:
                bar.set_postfix_str(f"last error: {result.status} {result.error[:40]}")

    start = time.perf_counter()
    try:
        results = asyncio.run(run_plan(args.url, plan, progress=progress, **common))
    except KeyboardInterrupt:
        raise CliError("interrupted") from None
    finally:
        if bar is not None:
            bar.close()
    first_sent = min((r.sent_s for r in results), default=0.0)
    duration = time.perf_counter() - start - first_sent
    report = build_report(results, duration, config=config, goodput=goodput, endpoint=args.endpoint)
    if args.timelines:
        from loadgen.timelines import batch_when_queued, fetch_timelines, step_gaps

        ids = [r.request_id for r in results if r.finished and r.request_id]
        timelines = asyncio.run(fetch_timelines(args.url, ids, api_key=args.api_key))
        report["control_plane"] = step_gaps(timelines)
        report["batch_when_queued"] = batch_when_queued(timelines)
        print(f"control-plane time per step: {report['control_plane']}", file=sys.stderr)
        print(f"batched steps while requests waited: {report['batch_when_queued']}", file=sys.stderr)
    return report
