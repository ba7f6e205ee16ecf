"""``python -m tests.soak`` (``make test-soak``): open-loop load at a fraction of the local stack's
capacity for ``--minutes``, against real processes (the chaos cluster: 3-node NATS, a replicated Redis
behind Sentinels, two gateways, scheduler, predictor, reconfigurator, a node agent with paced workers),
while a seeded injector breaks something every few seconds (``tests/soak/faults.py``). Writes the
report (``tests/soak/report.py``) as JSON to ``--json`` and exits 1 when it misses the acceptance bar:
``--min-requests`` sent, ``--min-faults`` faults of ``--min-kinds`` kinds, and no request lost,
duplicated, failed or accepted and not completed, every refusal with a Retry-After, every fault recovered.
No fault starts in the load's last ``quiet_tail_s`` (the slowest kind's recovery window) and the load
goes on while one is still to be seen recovering, so every fault is judged; one that could not be all
the same is listed (``faults_not_judged``) and printed, and does not fail the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import traceback
from pathlib import Path

from tests.chaos.client import check_no_duplicates
from tests.chaos.cluster import REPO, Cluster
from tests.chaos.scenarios import FinishedCounter
from tests.soak.faults import RECOVERY_TIMEOUT_S, Injector, Schedule, quiet_tail_s, recovery_windows
from tests.soak.load import OpenLoopLoad, measure_capacity
from tests.soak.report import RequestOutcome, acceptance, skew_problems, summarize

SOAK_ENV = {
    "DLS_GATEWAY_MAX_IN_FLIGHT": "64",
    "DLS_NODE_AGENT_HANG_TIMEOUT_S": "6",  # leases are 4 s here
    "DLS_NODE_AGENT_STOP_TIMEOUT_S": "20",
    "DLS_NODE_AGENT_START_TIMEOUT_S": "60",  # a restarted worker not READY by then is killed and started again
    "DLS_RECONFIGURATOR_ENABLED": "false",  # plans come from the injector (operator plans) only
    "DLS_WORKER_DRAIN_TIMEOUT_S": "10",
}


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


async def soak(cluster: Cluster, args, rng: random.Random) -> dict:
    finished = FinishedCounter(cluster.nats_urls)
    await finished.start()
    try:
        windows = recovery_windows(cluster.env)
        schedule = Schedule(args.minutes * 60.0, args.storm_s, args.calm_s, quiet_tail_s(windows))
        if schedule.last_start_s <= 0:
            raise ValueError(f"--minutes {args.minutes:g} leaves no time for faults before the quiet tail "
                             f"({schedule.quiet_tail_s:.1f} s)")
        capacity = None
        rate = args.rate
        if rate is None:
            log(f"soak: measuring capacity ({args.calibrate_s:.0f} s, {args.calibrate_concurrency} in flight) ...")
            capacity = await measure_capacity(cluster.urls, args.calibrate_s, args.calibrate_concurrency)
            rate = args.load * capacity
            log(f"soak: capacity {capacity:.2f} req/s: loading at {rate:.2f} req/s")
        load = OpenLoopLoad(cluster.urls, rate, rng)
        injector = Injector(cluster, load, rng, log)
        log(f"soak: faults from 0 to {schedule.last_start_s:.1f} s of the load; none in its last "
            f"{schedule.quiet_tail_s:.1f} s (the slowest recovery window: {max(windows, key=windows.get)})")
        await injector.connect()
        started = time.monotonic()
        # the load goes on past its duration while a fault is still to be seen recovering
        await asyncio.gather(load.run(schedule.duration_s, keep_going=lambda: injector.active,
                                      max_extra_s=RECOVERY_TIMEOUT_S, start=started),
                             injector.run(schedule, (args.min_gap_s, args.max_gap_s), started))
        log(f"soak: {len(load.tracked)} requests sent; waiting for the ones in flight ...")
        await load.finish()
        await asyncio.sleep(2.0)  # late duplicate events, if any, reach the counter
        log("soak: checking every completed request's stored steps for duplicates ...")
        outcomes = await _outcomes(cluster, load, finished)
        report = summarize(outcomes, injector.faults)
        report.update({
            "minutes": args.minutes, "seed": args.seed, "capacity_req_s": capacity, "rate_req_s": round(rate, 3),
            "load_fraction": args.load if capacity else None, "wall_s": round(time.monotonic() - started, 1),
            "skewed_workers": injector.skew, "faults_skipped": injector.skipped,
            "quiet_tail_s": schedule.quiet_tail_s, "recovery_windows_s": windows,
            "fault_log": [{"kind": f.kind, "target": f.target, "at_s": round(f.at - started, 1),
                           "recovery_s": None if f.recovery_s is None else round(f.recovery_s, 2),
                           "verdict": f.verdict, **f.detail}
                          for f in injector.faults],
            "hung_workers_killed_by_agent": _count(cluster, "node_agent", "is hung ("),
            "leases_expired": _count(cluster, "scheduler", ": lease expired"),
        })
        if report["faults_not_judged"]:
            log(f"soak: {len(report['faults_not_judged'])} fault(s) NOT JUDGED (no load left to show their "
                f"recovery; not failing the run): {report['faults_not_judged']}")
        report["problems"] = skew_problems(injector.skew, injector.faults) + acceptance(
            report, args.min_requests, args.min_faults, args.min_kinds)
        return report
    finally:
        await finished.close()


async def _outcomes(cluster: Cluster, load: OpenLoopLoad, finished: FinishedCounter) -> list[RequestOutcome]:
    semaphore = asyncio.Semaphore(32)

    async def one(t) -> RequestOutcome:
        duplicated = False
        if t.outcome == "completed":
            async with semaphore:
                problem = await check_no_duplicates(cluster.url, t.request_id)
            duplicated = bool(problem) or finished.counts[t.request_id] > 1
            if duplicated:
                log(f"soak: DUPLICATED {t.request_id}: {problem or 'RequestFinished more than once'}")
        elif t.outcome != "refused":
            log(f"soak: {t.outcome.upper()} {t.request_id or '#' + str(t.index)}: {t.detail}")
        return RequestOutcome(t.outcome, t.sent_at, t.done_at, tuple(t.refusals), t.request_id is not None,
                              duplicated)

    return list(await asyncio.gather(*(one(t) for t in load.tracked)))


def _count(cluster: Cluster, service: str, needle: str) -> int:
    path = cluster.run_dir / "logs" / f"{service}.log"
    return path.read_text(errors="replace").count(needle) if path.exists() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the load and the faults last")
    parser.add_argument("--json", default=str(REPO / "soak-report.json"), help="where the JSON report goes")
    parser.add_argument("--run-dir", default=str(REPO / "runs" / "soak"), help="logs and server data")
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--load", type=float, default=0.7, help="fraction of the measured capacity to load at")
    parser.add_argument("--rate", type=float, default=None, help="requests per second (skips the measurement)")
    parser.add_argument("--calibrate-s", type=float, default=30.0)
    parser.add_argument("--calibrate-concurrency", type=int, default=24)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pace-scale", type=float, default=1.0, help="stretch the workers' paced steps")
    parser.add_argument("--storm-s", type=float, default=70.0, help="faults during this part of each cycle ...")
    parser.add_argument("--calm-s", type=float, default=50.0, help="... and none during this part")
    parser.add_argument("--min-gap-s", type=float, default=2.0, help="between two fault injections, at least")
    parser.add_argument("--max-gap-s", type=float, default=5.0, help="and at most")
    parser.add_argument("--min-requests", type=int, default=None, help="acceptance (default: 150 per minute)")
    parser.add_argument("--min-faults", type=int, default=None, help="acceptance (default: 4 per minute)")
    parser.add_argument("--min-kinds", type=int, default=7, help="acceptance: distinct fault kinds")
    args = parser.parse_args(argv)
    tail_s = quiet_tail_s(recovery_windows(SOAK_ENV))  # about: the cluster adds settings of its own
    if args.minutes * 60.0 <= tail_s:
        parser.error(f"--minutes must leave time for faults before the quiet tail (about {tail_s:.0f} s) where none "
                     "starts")
    if not 0 < args.load <= 2:
        parser.error("--load must be in (0, 2]")
    args.min_requests = int(150 * args.minutes) if args.min_requests is None else args.min_requests
    args.min_faults = int(4 * args.minutes) if args.min_faults is None else args.min_faults
    run_dir = Path(args.run_dir) / time.strftime("%Y%m%d-%H%M%S")
    cluster = Cluster(run_dir, workers=args.workers, pace_scale=args.pace_scale, redis_mode="sentinel", gateways=2,
                      reconfigurator=True, gpu_slots=args.workers + 1, extra_env=SOAK_ENV)
    rng = random.Random(args.seed)
    try:
        log(f"soak: starting the cluster (logs in {run_dir / 'logs'}) ...")
        cluster.start()
        report = asyncio.run(soak(cluster, args, rng))
    except Exception as exc:  # noqa: BLE001 (the report says why)
        traceback.print_exc()
        report = {"error": f"{type(exc).__name__}: {exc}", "problems": ["the soak did not run to the end"]}
    finally:
        cluster.stop()
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    log(f"soak: report in {args.json}")
    print(json.dumps({k: report.get(k) for k in ("sent", "completed", "refused", "lost", "duplicated", "faults",
                                                  "fault_kinds", "recovery_s", "faults_not_recovered",
                                                  "faults_not_judged", "latency_s", "problems")}, indent=2))
    if report["problems"]:
        print(f"soak: FAILED: {report['problems']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
