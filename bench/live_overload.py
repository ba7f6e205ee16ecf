"""The live counterpart of the simulator's comparison: the local stack (``dls up``) under sustained
overload, once per policy, with the same Poisson arrivals.

For each policy: start ``dls up --policy P`` on fresh NATS/Redis ports (workers paced to a GPU
profile, so a CPU machine has a GPU cluster's timing while the real model picks the tokens), send a
short warm-up, then the open-loop load, stop the stack, and report SLO attainment, accuracy,
latency and the thresholds used. Prints JSON (``--json`` writes it too).

    python -m bench.live_overload --rate 4 --duration 60 --json runs/live-overload.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.common import emit_json
from loadgen.driver import poisson_plan, run_plan, summarize
from shared.runtime import free_port


def start_stack(policy: str, args, run_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, DLS_NATS_URL=f"nats://127.0.0.1:{free_port()}",
               DLS_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    argv = [sys.executable, "-m", "shared.cli", "up", "--port", str(port), "--workers", str(args.workers),
            "--policy", policy, "--pace", args.pace, "--pace-scale", str(args.pace_scale), "--run-dir", str(run_dir)]
    log = open(run_dir.with_suffix(".log"), "wb")  # noqa: SIM115 (the child keeps it)
    process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"dls up exited ({process.returncode}); see {run_dir.with_suffix('.log')}")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as reply:
                if reply.status == 200 and json.loads(reply.read())["serving"]:  # a worker is up too
                    return process, url
        except OSError:
            pass
        time.sleep(1.0)
    process.send_signal(signal.SIGINT)
    raise RuntimeError("the stack was not ready in 240 s")


def stop_stack(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(300)  # dls up stops each service in turn (workers drain first)
    except subprocess.TimeoutExpired:
        process.kill()


def run_policy(policy: str, args) -> dict:
    run_dir = Path(args.run_dir) / policy
    run_dir.mkdir(parents=True, exist_ok=True)
    process, url = start_stack(policy, args, run_dir)
    try:
        warmup = poisson_plan(1.0, 3.0, slo_ms=args.slo_ms, seed=args.seed + 1)
        asyncio.run(run_plan(url, warmup, cache=args.cache))
        plan = poisson_plan(args.rate, args.duration, slo_ms=args.slo_ms, seed=args.seed)
        print(f"{policy}: {len(plan)} requests over {args.duration:.0f} s ...", file=sys.stderr, flush=True)
        results = asyncio.run(run_plan(url, plan, cache=args.cache))
        return summarize(results, args.duration)
    finally:
        stop_stack(process)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="dilaserve,fixed", help="comma-separated policies to compare")
    p.add_argument("--rate", type=float, default=4.0,
                   help="arrivals per second (default: about 2x what 2 workers serve at threshold 0.9)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--slo-ms", type=float, default=6500.0, help="every request's SLO (5x isolated latency at 0.9)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--pace", default="profiles/llada-8b-h100.json")
    p.add_argument("--pace-scale", type=float, default=10.8,
                   help="each bundled-model step paced as this many LLaDA-8B steps (80 / 7.4, as the simulator)")
    p.add_argument("--cache", default="none", choices=["none", "prefix", "dual"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/live-overload")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    report = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "run_dir")}, "policies": {}}
    for policy in args.policies.split(","):
        report["policies"][policy] = run_policy(policy, args)
        print(json.dumps({policy: report["policies"][policy]}), file=sys.stderr, flush=True)
    emit_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
