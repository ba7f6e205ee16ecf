"""``python -m tests.chaos`` (``make test-chaos``): start a chaos cluster, run scenarios 1-6 against
it, write ``chaos-report.json`` (scenario -> {sent, completed, lost, duplicated, ...}) and exit 1 when
any scenario lost or duplicated a request, or could not run."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import traceback
from pathlib import Path

from tests.chaos.cluster import REPO, Cluster
from tests.chaos.scenarios import RUN_ORDER, SCENARIOS, FinishedCounter


async def run(cluster: Cluster, names: list[str]) -> dict[str, dict]:
    finished = FinishedCounter(cluster.nats_urls)
    await finished.start()
    results: dict[str, dict] = {}
    try:
        for name in names:
            started = time.monotonic()
            print(f"chaos: {name} ...", flush=True)
            try:
                results[name] = await SCENARIOS[name](cluster, finished)
            except Exception as exc:  # noqa: BLE001 (reported, and the run fails)
                traceback.print_exc()
                results[name] = {"sent": 0, "completed": 0, "lost": 0, "duplicated": 0,
                                 "error": f"{type(exc).__name__}: {exc}"}
            results[name]["wall_s"] = round(time.monotonic() - started, 1)
            print(f"chaos: {name}: {json.dumps(results[name])}", flush=True)
            if "error" in results[name]:
                try:  # a scenario that broke things leaves the cluster for the next one to find ready
                    await asyncio.to_thread(cluster.wait_ready, 120)
                except Exception as exc:  # noqa: BLE001
                    print(f"chaos: cluster did not recover: {exc}", flush=True)
                    break
    finally:
        await finished.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--scenarios", default=",".join(RUN_ORDER),
                        help=f"comma-separated, run in this order (default: {','.join(RUN_ORDER)})")
    parser.add_argument("--report", default=str(REPO / "chaos-report.json"), help="where the JSON report goes")
    parser.add_argument("--run-dir", default=str(REPO / "runs" / "chaos"), help="logs and server data")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pace-scale", type=float, default=8.0, help="stretch paced steps (mid-step kills)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {unknown}; known: {sorted(SCENARIOS)}")
    run_dir = Path(args.run_dir) / time.strftime("%Y%m%d-%H%M%S")
    cluster = Cluster(run_dir, workers=args.workers, pace_scale=args.pace_scale)
    started = time.monotonic()
    try:
        print(f"chaos: starting the cluster (logs in {run_dir / 'logs'}) ...", flush=True)
        cluster.start()
        results = asyncio.run(run(cluster, names))
    finally:
        cluster.stop()
    report = {name: results[name] for name in sorted(results)}
    Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    failed = [name for name, r in report.items() if r.get("error") or r["lost"] or r["duplicated"]
              or r["sent"] == 0]
    missing = [n for n in names if n not in report]
    print(f"chaos: report in {args.report} ({time.monotonic() - started:.0f} s)")
    for name, r in report.items():
        print(f"  {name:22s} sent {r['sent']:3d}  completed {r['completed']:3d}  lost {r['lost']}  "
              f"duplicated {r['duplicated']}{'  ERROR ' + r['error'] if r.get('error') else ''}")
    if failed or missing:
        print(f"chaos: FAILED: {failed + missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
