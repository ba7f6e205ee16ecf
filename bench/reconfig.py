"""Reconfigurator benchmark: Stage 1 + Stage 2 solve times at 16, 256 and 1,024 GPUs, and the plans
Stage 1 chooses across a sweep of arrival rates on 16 GPUs.

    python -m bench.reconfig --json runs/bench-reconfig.json [--quick] [--repeats 3]

Clusters are nodes of 4 GPUs with TP degrees 1, 2, 4 (16 GPUs = 4 nodes, 1,024 GPUs = 256 nodes).
The workload is the example mix (``services/reconfigurator/examples/workload.json``), its rates
scaled to the cluster: for each size the timed solves run at three load levels (per 16 GPUs: 8, 32
and 64 requests/s: all TP-4, a mix, lower thresholds), each starting from the plan of the next level
as the running placement, so that Stage 2 has instances to keep, stop and start. ``solve_s`` is the
median over all runs of one size of Stage 1 plus Stage 2 seconds (building the Pyomo models
included). The profile is ``profiles/llada-8b-h100.json`` when present, else the built-in example.

In the sweep, a plan that fell back (Stage 1 infeasible: all TP-1) reports the lowest threshold as
``avg_threshold`` (what the load control then runs) with ``fallback: true``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench.common import emit_json
from services.reconfigurator.core.example_profile import EXAMPLE_PROFILE_PATH, example_profile
from services.reconfigurator.core.files import load_workload
from services.reconfigurator.core.plan import CapacityPlan
from services.reconfigurator.core.planner import plan_reconfiguration
from services.reconfigurator.core.spec import Cluster, Workload, uniform_cluster
from services.reconfigurator.core.stage1 import solve_stage1
from services.reconfigurator.core.trigger import improvement_decision
from shared.profiles import LatencyProfile

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKLOAD_PATH = REPO_ROOT / "services" / "reconfigurator" / "examples" / "workload.json"
GPUS_PER_NODE = 4
TP_DEGREES = (1, 2, 4)
SIZES = (16, 256, 1024)  # GPUs
TIMED_RPS_PER_16_GPUS = (8.0, 32.0, 64.0)
SWEEP_RPS = (0.5, 1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 128)
QUICK_SWEEP_RPS = (1, 8, 32, 64, 80, 128)


def load_profile() -> tuple[LatencyProfile, str]:
    path = REPO_ROOT / EXAMPLE_PROFILE_PATH
    if path.exists():
        return LatencyProfile.load(path), EXAMPLE_PROFILE_PATH
    return example_profile(), "built-in example profile"


def at_rps(workload: Workload, rps: float) -> Workload:
    return workload.with_rate_scale(rps / workload.total_rate)


def running_placement(workload: Workload, cluster: Cluster, profile: LatencyProfile) -> Cluster:
    """The cluster running the plan for ``workload`` (the starting point of a timed solve)."""
    outcome = plan_reconfiguration(
        workload,
        cluster,
        profile,
        "warm-start",
    )
    return cluster.with_placement(tuple(outcome.plan.placement.target_instances()))


def time_size(num_gpus: int, workload: Workload, profile: LatencyProfile, repeats: int) -> dict:
    cluster = uniform_cluster(num_gpus // GPUS_PER_NODE, GPUS_PER_NODE, TP_DEGREES)
    scale = num_gpus / 16
    levels = [rps * scale for rps in TIMED_RPS_PER_16_GPUS]
    runs = []
    for i, rps in enumerate(levels):
        start_from = running_placement(at_rps(workload, levels[(i + 1) % len(levels)]), cluster, profile)
        for _ in range(repeats):
            outcome = plan_reconfiguration(at_rps(workload, rps), start_from, profile, "bench")
            placement = outcome.plan.placement
            runs.append(
                {
                    "rps": rps,
                    "stage1_s": outcome.solve_s["stage1"],
                    "stage2_s": outcome.solve_s["stage2"],
                    "total_s": outcome.solve_s["stage1"] + outcome.solve_s["stage2"],
                    "instances_by_tp": _by_tp(outcome.plan.capacity),
                    "kept": placement.num_kept,
                    "stopped": placement.num_stopped,
                    "started": placement.num_started,
                }
            )
    return {
        "median_s": statistics.median(r["total_s"] for r in runs),
        "stage1_median_s": statistics.median(r["stage1_s"] for r in runs),
        "stage2_median_s": statistics.median(r["stage2_s"] for r in runs),
        "max_s": max(r["total_s"] for r in runs),
        "runs": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in runs],
    }


def sweep(workload: Workload, profile: LatencyProfile, rates: tuple[float, ...]) -> list[dict]:
    """Stage 1's plan at each rate on 16 GPUs; Stage 2 and the trigger from the previous applied plan."""
    cluster = uniform_cluster(4, GPUS_PER_NODE, TP_DEGREES)
    lowest_threshold = min(workload.thresholds)
    plans = []
    for i, rps in enumerate(rates):
        outcome = plan_reconfiguration(at_rps(workload, rps), cluster, profile, f"sweep-{i}")
        capacity = outcome.plan.capacity
        decision = improvement_decision(capacity, outcome.current, margin=0.10)
        placement = outcome.plan.placement
        plans.append(
            {
                "rps": rps,
                "instances_by_tp": _by_tp(capacity),
                "avg_threshold": round(capacity.avg_threshold, 4) if capacity.objective else lowest_threshold,
                "slo_slack": round(capacity.objective.slo_slack, 4) if capacity.objective else None,
                "batch_by_tp": {str(d): b for d, b in capacity.batch_by_tp.items()},
                "fallback": not capacity.feasible,
                "fallback_reason": capacity.fallback_reason,
                "applied": decision.apply,
                "kept": placement.num_kept,
                "stopped": placement.num_stopped,
                "started": placement.num_started,
            }
        )
        if decision.apply:
            cluster = cluster.with_placement(tuple(placement.target_instances()))
    return plans


def _by_tp(capacity: CapacityPlan) -> dict[str, int]:
    return {str(d): n for d, n in sorted(capacity.instances_by_tp.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reconfig", description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the result here too")
    parser.add_argument("--quick", action="store_true", help="one repeat, a shorter sweep")
    parser.add_argument("--repeats", type=int, default=3, help="runs per load level and size")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    profile, profile_name = load_profile()
    workload = load_workload(WORKLOAD_PATH)
    solve_stage1(workload, uniform_cluster(1, 1, (1,)), profile)  # warm imports and HiGHS once
    started = time.perf_counter()
    sizes = {str(n): time_size(n, workload, profile, repeats) for n in SIZES}
    result = {
        "solve_s": {n: round(s["median_s"], 4) for n, s in sizes.items()},
        "plans": sweep(workload, profile, QUICK_SWEEP_RPS if args.quick else SWEEP_RPS),
        "sizes": {
            n: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()}
            for n, s in sizes.items()
        },
        "meta": {
            "profile": profile_name,
            "workload": str(WORKLOAD_PATH.relative_to(REPO_ROOT)),
            "gpus_per_node": GPUS_PER_NODE,
            "tp_degrees": list(TP_DEGREES),
            "repeats": repeats,
            "timed_rps_per_16_gpus": list(TIMED_RPS_PER_16_GPUS),
            "cpus": os.cpu_count(),
            "bench_wall_s": round(time.perf_counter() - started, 2),
        },
    }
    emit_json(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
