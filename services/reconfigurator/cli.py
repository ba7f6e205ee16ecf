"""`dls reconfig solve`: run Stage 1 and Stage 2 on a workload file and a cluster file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shared.cli import CliError
from shared.profiles import LatencyProfile, ProfileError

from .core.example_profile import EXAMPLE_PROFILE_PATH, example_profile
from .core.files import SpecError, load_cluster, load_workload
from .core.planner import PlannerOptions, PlanOutcome, plan_reconfiguration
from .core.solver import SolverOptions, SolverUnavailable
from .core.stage1 import Stage1Options
from .core.stage2 import Stage2Infeasible, Stage2Options
from .core.trigger import TriggerDecision, improvement_decision

_REPO_ROOT = Path(__file__).resolve().parents[2]


def register(subparsers: argparse._SubParsersAction) -> None:
    reconfig = subparsers.add_parser("reconfig", help="cluster reconfiguration (two-stage ILP)")
    commands = reconfig.add_subparsers(dest="reconfig_command", required=True, metavar="SUBCOMMAND")
    solve = commands.add_parser("solve", help="plan instances per TP degree and the keep/stop/start lists")
    solve.add_argument("--workload", required=True, help="workload JSON (request classes and rates)")
    solve.add_argument("--cluster", required=True, help="cluster JSON (nodes, GPUs, running instances)")
    solve.add_argument(
        "--profile",
        help=f"latency profile JSON (default: {EXAMPLE_PROFILE_PATH} if present, "
        "else the built-in example profile)",
    )
    solve.add_argument("--margin", type=float, default=0.10, help="apply only above this relative gain")
    solve.add_argument("--max-utilization", type=float, default=0.9, help="stability margin per TP degree")
    solve.add_argument("--time-limit", type=float, default=20.0, help="HiGHS time limit per solve, seconds")
    solve.add_argument("--plan-id", default="plan-1")
    solve.add_argument("--json", action="store_true", help="print the plan as JSON")
    solve.set_defaults(func=run_solve)


def run_solve(args: argparse.Namespace) -> int:
    profile, profile_name = _load_profile(args.profile)
    try:
        workload = load_workload(args.workload)
        cluster = load_cluster(args.cluster, profile.tp_degrees)
    except SpecError as exc:
        raise CliError(str(exc)) from None
    if not 0 < args.max_utilization <= 1:
        raise CliError("--max-utilization: must be in (0, 1]")
    try:
        outcome = plan_reconfiguration(workload, cluster, profile, args.plan_id, _options(args))
    except (SolverUnavailable, Stage2Infeasible) as exc:
        raise CliError(str(exc)) from None
    decision = improvement_decision(outcome.plan.capacity, outcome.current, args.margin)
    if args.json:
        print(json.dumps(_report(outcome, decision, profile_name), indent=2))
    else:
        print(_text(outcome, decision, profile_name))
    return 0


def _options(args: argparse.Namespace) -> PlannerOptions:
    stage1_solver = SolverOptions(time_limit_s=args.time_limit)
    stage2_solver = SolverOptions(time_limit_s=args.time_limit, mip_rel_gap=0.0)
    return PlannerOptions(
        stage1=Stage1Options(max_utilization=args.max_utilization, solver=stage1_solver),
        stage2=Stage2Options(solver=stage2_solver),
    )


def _load_profile(path: str | None) -> tuple[LatencyProfile, str]:
    candidate = Path(path) if path else _REPO_ROOT / EXAMPLE_PROFILE_PATH
    if path is None and not candidate.exists():
        return example_profile(), "built-in example profile"
    try:
        return LatencyProfile.load(candidate), str(candidate)
    except ProfileError as exc:
        raise CliError(str(exc)) from None


def _report(outcome: PlanOutcome, decision: TriggerDecision, profile_name: str) -> dict:
    report = outcome.to_dict()
    report["solve_s"]["stage1_plus_stage2"] = round(outcome.solve_s["stage1"] + outcome.solve_s["stage2"], 4)
    report["decision"] = decision.to_dict()
    report["profile"] = profile_name
    return report


def _text(outcome: PlanOutcome, decision: TriggerDecision, profile_name: str) -> str:
    capacity, placement = outcome.plan.capacity, outcome.plan.placement
    shape = ", ".join(
        f"{n} x TP-{d} (batch {capacity.batch_by_tp.get(d, '-')})"
        for d, n in sorted(capacity.instances_by_tp.items())
        if n
    )
    lines = [f"plan {outcome.plan.plan_id} (profile: {profile_name})", f"  instances: {shape}"]
    if capacity.objective:
        lines.append(
            f"  average threshold {capacity.objective.avg_threshold:.4f}, "
            f"SLO slack {capacity.objective.slo_slack:.4f}"
        )
    if capacity.fallback_reason:
        lines.append(f"  FALLBACK: {capacity.fallback_reason}")
    lines.append(f"  keep {placement.num_kept}, stop {placement.num_stopped}, start {placement.num_started}")
    for node in placement.nodes:
        if node.stop or node.start:
            lines.append(
                f"    {node.node}: stop {[list(i.gpu_ids) for i in node.stop]}, "
                f"start {[(i.tp, list(i.gpu_ids)) for i in node.start]}"
            )
    lines.append(f"  apply: {'yes' if decision.apply else 'no'} ({decision.reason})")
    s = outcome.solve_s
    lines.append(
        f"  solve: stage 1 {s['stage1']:.3f} s, stage 2 {s['stage2']:.3f} s, current {s['current']:.3f} s"
    )
    return "\n".join(lines)
