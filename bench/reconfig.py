"""Reconfigurator benchmark: Stage 1 + Stage 2 solve times at 16, 256, 1,024 and 8,192 GPUs, for two
models sharing 64 GPUs, and the plans Stage 1 chooses across a sweep of arrival rates on 16 GPUs.

    python -m bench.reconfig --json runs/bench-reconfig.json [--quick] [--repeats 3] [--models 2]

Clusters are nodes of 4 GPUs with TP degrees 1, 2, 4 (16 GPUs = 4 nodes, 1,024 GPUs = 256 nodes).
The workload is the example mix (``services/reconfigurator/examples/workload.json``), its rates
scaled to the cluster: for each size the timed solves run at three load levels (per 16 GPUs: 8, 32
and 64 requests/s: all TP-4, a mix, lower thresholds), each starting from the plan of the next level
as the running placement, so that Stage 2 has instances to keep, stop and start. ``solve_s`` is the
median over all runs of one size of Stage 1 plus Stage 2 seconds (building the Pyomo models
included). The profile is ``profiles/llada-8b-h100.json`` when present, else the built-in example.

``scale`` times one model on 8,192 GPUs the same way (2,048 nodes of 4). ``models`` times ``--models``
models (default 2; 0: skip) sharing 8 nodes of 8 GPUs with TP 1, 2, 4, 8, each with the example mix,
a 60-s switch time and a minimum of one instance: at three loads (per 64 GPUs: 40, 120 and 200
requests/s in all) split 3:1 between the first model and the others, each starting from the placement
planned for the mirrored split (1:3), so that GPUs move between the models; ``solve_s`` is the median
of Stage 1 (``divide_gpus``) plus Stage 2 (``place_models``). ``headline`` holds the two acceptance
figures: one model on 8,192 GPUs and the models on 64 GPUs.

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
from services.reconfigurator.core.planner import plan_models, plan_reconfiguration
from services.reconfigurator.core.spec import Cluster, Instance, ModelDemand, Workload, uniform_cluster
from services.reconfigurator.core.stage1 import solve_stage1
from services.reconfigurator.core.trigger import improvement_decision
from shared.profiles import LatencyProfile

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKLOAD_PATH = REPO_ROOT / "services" / "reconfigurator" / "examples" / "workload.json"
GPUS_PER_NODE = 4
TP_DEGREES = (1, 2, 4)
SIZES = (16, 256, 1024)  # GPUs
SCALE_SIZE = 8192  # GPUs: one model at scale
MODELS_NODES, MODELS_GPUS_PER_NODE, MODELS_TP_DEGREES = 8, 8, (1, 2, 4, 8)
MODELS_TIMED_RPS = (40.0, 120.0, 200.0)  # requests/s over every model, per 64 GPUs
MODELS_SWITCH_S = 60.0
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


def model_demands(workload: Workload, profile: LatencyProfile, num_models: int, rps: float, first_share: float):
    """``num_models`` models with the example mix: ``first_share`` of ``rps`` on the first, the rest
    split evenly between the others."""
    rest = (1.0 - first_share) / max(1, num_models - 1)
    shares = [first_share] + [rest] * (num_models - 1)
    return tuple(
        ModelDemand(f"model-{i}", at_rps(workload, rps * share), profile, switch_s=MODELS_SWITCH_S, min_instances=1)
        for i, share in enumerate(shares)
    )


def time_models(workload: Workload, profile: LatencyProfile, num_models: int, repeats: int) -> dict:
    cluster = uniform_cluster(MODELS_NODES, MODELS_GPUS_PER_NODE, MODELS_TP_DEGREES)
    first_share = 0.75 if num_models > 1 else 1.0
    runs = []
    for rps in MODELS_TIMED_RPS:
        mirrored = model_demands(workload, profile, num_models, rps, 1.0 - first_share if num_models > 1 else 1.0)
        before = plan_models(mirrored, cluster, {}, "warm-start")
        running: dict[Instance, str] = {
            inst: name for name, insts in before.placement.target_instances_by_model().items() for inst in insts
        }
        start_from = cluster.with_placement(tuple(running))
        for _ in range(repeats):
            demands = model_demands(workload, profile, num_models, rps, first_share)
            outcome = plan_models(demands, start_from, running, "bench")
            division, placement = outcome.division, outcome.placement
            runs.append(
                {
                    "rps": rps,
                    "stage1_s": outcome.solve_s["stage1"],
                    "stage2_s": outcome.solve_s["stage2"],
                    "total_s": outcome.solve_s["stage1"] + outcome.solve_s["stage2"],
                    "gpus_by_model": division.gpus_by_model,
                    "avg_threshold": round(division.objective.avg_threshold, 4) if division.objective else None,
                    "fallback": not division.feasible,
                    "switch_gpu_s": round(division.switch_gpu_s, 1),
                    "kept": placement.num_kept,
                    "stopped": placement.num_stopped,
                    "started": placement.num_started,
                }
            )
    return {
        "num_models": num_models,
        "num_gpus": MODELS_NODES * MODELS_GPUS_PER_NODE,
        "tp_degrees": list(MODELS_TP_DEGREES),
        "switch_s": MODELS_SWITCH_S,
        "solve_s": round(statistics.median(r["total_s"] for r in runs), 4),
        "stage1_median_s": round(statistics.median(r["stage1_s"] for r in runs), 4),
        "stage2_median_s": round(statistics.median(r["stage2_s"] for r in runs), 4),
        "max_s": round(max(r["total_s"] for r in runs), 4),
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
    parser.add_argument("--models", type=int, default=2, help="models sharing 64 GPUs in the models case (0: skip)")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    profile, profile_name = load_profile()
    workload = load_workload(WORKLOAD_PATH)
    solve_stage1(workload, uniform_cluster(1, 1, (1,)), profile)  # warm imports and HiGHS once
    started = time.perf_counter()
    sizes = {str(n): time_size(n, workload, profile, repeats) for n in SIZES}
    scale = time_size(SCALE_SIZE, workload, profile, repeats)
    models = time_models(workload, profile, args.models, repeats) if args.models > 0 else None
    result = {
        "solve_s": {n: round(s["median_s"], 4) for n, s in sizes.items()},
        "headline": {
            f"one_model_{SCALE_SIZE}_gpus_solve_s": round(scale["median_s"], 4),
            f"one_model_{SCALE_SIZE}_gpus_max_s": round(scale["max_s"], 4),
            **({f"{args.models}_models_64_gpus_solve_s": models["solve_s"],
                f"{args.models}_models_64_gpus_max_s": models["max_s"]} if models else {}),
        },
        "scale": {str(SCALE_SIZE): {k: (round(v, 4) if isinstance(v, float) else v) for k, v in scale.items()}},
        "models": models,
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
