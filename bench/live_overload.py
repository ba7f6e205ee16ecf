"""The live counterpart of the simulator's comparison: the local stack (``dls up``) under sustained
overload, once per policy, with the same Poisson arrivals.

For each policy: start ``dls up --policy P`` on fresh NATS/Redis ports (workers paced to a GPU
profile, so a CPU machine has a GPU cluster's timing while the real model picks the tokens), send a
short warm-up, then the open-loop load, stop the stack, and report SLO attainment, accuracy,
latency and the thresholds used. Prints JSON (``--json`` writes it too).

    python -m bench.live_overload --rate 4 --duration 60 --json runs/live-overload.json
    python -m bench.live_overload --workload long --rate R --duration 60 --json runs/live-overload-long.json
    python -m bench.live_overload --model DIR ...   # a checkpoint calibrated by `dls calibrate`

``--workload short`` (the default) sends the short families with max_tokens 16; ``long`` sends the chain
family (35-125 tokens) with max_tokens 128 in blocks of 32 with the dual cache, as paper-bench-long
does in the simulator. Without ``--slo-ms`` the SLO is measured: 5x the median latency of requests
sent one at a time at threshold 0.9 to the first policy's stack (the same SLO for every policy).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.common import emit_json, launch_stack, stop_stack
from loadgen.driver import poisson_plan, run_plan, summarize
from services.scheduler.core.threshold import quality_curve_key
from shared.calibration import QUALITY, bundle_dir
from shared.runtime import free_port
from shared.tasks import LONG_BLOCK_LENGTH, LONG_CANVAS, Family

SLO_FACTOR = 5.0  # SLO = this times the isolated latency at 0.9 (as the simulator's presets)
ISOLATED_SAMPLES = 3  # requests sent one at a time to measure the isolated latency


@dataclass(frozen=True)
class LiveWorkload:
    """What a run sends: task family, cap, block and cache, and the pacing that stands for LLaDA-8B."""

    family: Family | None  # None: the short families' mix
    max_tokens: int
    block_length: int | None  # None: the model's default
    cache: str
    pace_scale: float  # each bundled-model step paced as this many LLaDA-8B steps


WORKLOADS = {
    "short": LiveWorkload(None, 16, None, "none", 12.4),  # 80 LLaDA steps / 6.45 bundled-model steps at 0.9
    # the chain takes ~43 steps at 0.9, so 80 LLaDA steps would pace it at 1.9: far below what a CPU
    # worker needs for a batch of 16 with the whole stack on two cores, so each step stands for 8.7
    # (the live-local-long preset's pace: a slower GPU, the same shape; at 4 a quarter of the fixed
    # configuration's steps overran their paced time)
    "long": LiveWorkload(Family.CHAIN, LONG_CANVAS, LONG_BLOCK_LENGTH, "dual", 8.7),
}


def quality_curve(workload: LiveWorkload, cache: str | None, model_dir: str = "models/dls-tiny") -> str | None:
    """The quality.json curve the workload's answers follow, by the simulator's rule
    (``quality_curve_key``: the family at its block, or the mix on its canvas); None: uncalibrated."""
    path = bundle_dir(model_dir) / QUALITY
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return quality_curve_key(data, family=workload.family.value if workload.family else None,
                             gen_len=workload.max_tokens, block_len=workload.block_length or 0,
                             no_cache=(cache or workload.cache) == "none")


def start_stack(policy: str, args, run_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args.metrics_port = free_port()  # the scheduler's /metrics (dls up: the base port)
    env = dict(os.environ, DLS_NATS_URL=f"nats://127.0.0.1:{free_port()}",
               DLS_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0", DLS_METRICS_PORT=str(args.metrics_port))
    # the quality budget on the workload's own curve, as the simulator's preset applies it
    curve = quality_curve(WORKLOADS[args.workload], args.cache, args.model)
    if curve is not None:
        env.setdefault("DLS_SCHEDULER_QUALITY_CURVES", json.dumps([curve]))
    argv = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--workers", str(args.workers),
            "--model", args.model,
            "--policy", policy, "--pace", args.pace, "--pace-scale", str(args.pace_scale), "--run-dir", str(run_dir)]
    url = f"http://127.0.0.1:{port}"
    return launch_stack(argv, env, run_dir.with_suffix(".log"), url), url


def run_policy(policy: str, args) -> dict:
    run_dir = Path(args.run_dir) / policy
    run_dir.mkdir(parents=True, exist_ok=True)
    process, url = start_stack(policy, args, run_dir)
    workload = WORKLOADS[args.workload]
    shape = {"max_tokens": workload.max_tokens, "family": workload.family, "block_length": workload.block_length}
    try:
        warmup = poisson_plan(1.0, 3.0, slo_ms=args.slo_ms or 60_000.0, seed=args.seed + 1, **shape)
        asyncio.run(run_plan(url, warmup, model=Path(args.model).name, cache=args.cache))
        if args.slo_ms is None:
            args.slo_ms = round(SLO_FACTOR * isolated_latency_ms(url, args, shape), 1)
            print(f"SLO {args.slo_ms:.0f} ms ({SLO_FACTOR:g}x the isolated latency at 0.9)", file=sys.stderr)
        plan = poisson_plan(args.rate, args.duration, slo_ms=args.slo_ms, seed=args.seed, **shape)
        print(f"{policy}: {len(plan)} requests over {args.duration:.0f} s ...", file=sys.stderr, flush=True)
        results = asyncio.run(run_plan(url, plan, model=Path(args.model).name, cache=args.cache))
        return {**summarize(results, args.duration), "scheduler": scheduler_steps(args.metrics_port)}
    finally:
        stop_stack(process)


def scheduler_steps(port: int) -> dict:
    """Request-steps the scheduler saw, of which shadow decodings (their share: what watching the quality
    curve costs), and the shadow decodings judged, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError as exc:
        return {"error": f"no scheduler metrics: {exc}"}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    steps = values.get("dls_scheduler_request_steps_total", 0.0)
    shadow = values.get("dls_scheduler_shadow_steps_total", 0.0)
    return {"request_steps": int(steps), "shadow_steps": int(shadow),
            "shadow_step_share": round(shadow / steps, 4) if steps else None,
            "shadow_decodings": int(values.get("dls_scheduler_shadow_decodings_total", 0.0))}


def isolated_latency_ms(url: str, args, shape: dict) -> float:
    """Median latency of requests sent one at a time at threshold 0.9 (a quality floor of 0.9 pins it)."""
    latencies = []
    samples = poisson_plan(50.0, 1.0, slo_ms=600_000.0, seed=args.seed + 100, **shape)[:ISOLATED_SAMPLES]
    for planned in samples:
        alone = dataclasses.replace(planned, arrival_s=0.0, min_threshold=0.9)
        [result] = asyncio.run(run_plan(url, [alone], model=Path(args.model).name, cache=args.cache))
        if result.finished:
            latencies.append(result.latency_s * 1000.0)
    if not latencies:
        raise RuntimeError("no isolated request finished: cannot measure the SLO (pass --slo-ms)")
    return statistics.median(latencies)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="dilaserve,fixed", help="comma-separated policies to compare")
    p.add_argument("--rate", type=float, default=4.0,
                   help="arrivals per second (default: about 2x what 2 workers serve at threshold 0.9)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="short",
                   help="short: the short families, max_tokens 16; long: the chain family, 128 in blocks of 32")
    p.add_argument("--slo-ms", type=float, default=None,
                   help="every request's SLO; default: 5x the isolated latency at 0.9, measured")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default="models/dls-tiny",
                   help="model directory (with its calibration: its quality curve bounds DiLaServe's candidates)")
    p.add_argument("--pace", default="profiles/llada-8b-h100.json")
    p.add_argument("--pace-scale", type=float, default=None,
                   help="each bundled-model step paced as this many LLaDA-8B steps (default: the workload's, "
                        "80 LLaDA steps over the bundled model's steps per request at 0.9, as the simulator)")
    p.add_argument("--cache", default=None, choices=["none", "prefix", "dual"], help="default: the workload's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/live-overload")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    workload = WORKLOADS[args.workload]
    args.pace_scale = workload.pace_scale if args.pace_scale is None else args.pace_scale
    args.cache = args.cache or workload.cache
    report = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "run_dir")}, "policies": {}}
    for policy in args.policies.split(","):
        report["policies"][policy] = run_policy(policy, args)
        print(json.dumps({policy: report["policies"][policy]}), file=sys.stderr, flush=True)
    report["config"]["slo_ms"] = args.slo_ms  # measured in the first policy's stack when not given
    emit_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
