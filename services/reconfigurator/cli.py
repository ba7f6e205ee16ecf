"""`dls reconfig solve`: run Stage 1 and Stage 2 on a workload file and a cluster file.
`dls reconfig apply`: ask the running reconfigurator service to publish a plan to a given shape."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
from pathlib import Path

from shared.cli import CliError
from shared.messages import codec
from shared.messages.control import ApplyConfiguration, ApplyConfigurationReply, PlanAck, PlanAckStatus
from shared.profiles import LatencyProfile, ProfileError
from shared.settings import ReconfiguratorSettings
from shared.subjects import Subjects

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
    apply = commands.add_parser(
        "apply", help="ask the reconfigurator service to move the running instances to a given shape"
    )
    apply.add_argument(
        "--instances-by-tp", required=True, type=parse_instances_by_tp, metavar="TP:N[,TP:N...]",
        help="instances wanted per TP degree, e.g. 1:2,2:1 (degrees left out: none)",
    )
    apply.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the service's answer")
    apply.add_argument(
        "--wait", type=float, default=0.0, metavar="SECONDS",
        help="also wait this long for the node agents' acknowledgements (0: do not wait)",
    )
    apply.set_defaults(func=run_apply)


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


# --- dls reconfig apply ------------------------------------------------------------------------------


def parse_instances_by_tp(text: str) -> dict[int, int]:
    """``"1:2,2:1"`` -> ``{1: 2, 2: 1}`` (argparse type: errors become usage errors)."""
    instances_by_tp: dict[int, int] = {}  # tp degree -> instances
    for part in filter(None, (p.strip() for p in text.split(","))):
        tp, sep, count = part.partition(":")
        try:
            degree, number = int(tp), int(count)
        except ValueError:
            degree = number = -1
        if not sep or degree < 1 or number < 0:
            raise argparse.ArgumentTypeError(f"{part!r}: expected TP:N with TP >= 1 and N >= 0, e.g. 1:2,2:1")
        if degree in instances_by_tp:
            raise argparse.ArgumentTypeError(f"TP degree {degree} given twice")
        instances_by_tp[degree] = number
    if not instances_by_tp:
        raise argparse.ArgumentTypeError("no TP:N pair given")
    return instances_by_tp


def run_apply(args: argparse.Namespace) -> int:
    settings = ReconfiguratorSettings()
    return asyncio.run(apply_configuration(settings, args.instances_by_tp, args.timeout, args.wait))


async def apply_configuration(settings: ReconfiguratorSettings, instances_by_tp: dict[int, int], timeout_s: float,
                              wait_s: float = 0.0) -> int:
    """Send ``ApplyConfiguration``, print the plan id and its per-node changes; optionally wait for acks."""
    import nats

    from shared.settings import redact_urls

    subjects = Subjects(settings.subject_prefix)
    try:
        nc = await nats.connect(settings.nats_url.split(","), connect_timeout=5, allow_reconnect=False,
                                name="dls-reconfig-apply")
    except Exception as exc:  # noqa: BLE001 (nats-py raises several types; the user needs the URL and why)
        raise CliError(f"cannot connect to NATS at {redact_urls(settings.nats_url)}: {exc}") from None
    acks: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_ack(msg) -> None:
        acks.put_nowait(msg.data)

    try:
        await nc.subscribe(subjects.plans_ack, cb=on_ack)  # first, so that no ack is missed
        request = ApplyConfiguration(instances_by_tp=instances_by_tp, requested_by=_requester())
        try:
            msg = await nc.request(subjects.reconfig_apply, codec.encode(request), timeout=timeout_s)
        except nats.errors.NoRespondersError:
            raise CliError(f"no reconfigurator service answers on {subjects.reconfig_apply}") from None
        except nats.errors.TimeoutError:
            raise CliError(f"the reconfigurator did not answer within {timeout_s:g} s") from None
        reply = codec.decode(ApplyConfigurationReply, msg.data)
        if reply.error:
            raise CliError(f"no plan published: {reply.error}")
        print(reply.plan_id)
        for node in reply.nodes:
            print(f"  {node.node}: keep {[s.gpu_ids for s in node.keep]}, stop {[s.gpu_ids for s in node.stop]}, "
                  f"start {[(s.tp, s.gpu_ids) for s in node.start]}")
        if wait_s > 0:
            await _wait_for_acks(acks, reply.plan_id, {n.node for n in reply.nodes if n.stop or n.start}, wait_s)
        return 0
    finally:
        await nc.close()


async def _wait_for_acks(acks: asyncio.Queue[bytes], plan_id: str, node_ids: set[str], wait_s: float) -> None:
    """Print each awaited node's ack; ``CliError`` if one is missing after ``wait_s`` or not APPLIED."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    failed = []
    while node_ids:
        try:
            data = await asyncio.wait_for(acks.get(), timeout=max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise CliError(f"plan {plan_id}: no acknowledgement from {sorted(node_ids)} within {wait_s:g} s") from None
        try:
            ack = codec.decode(PlanAck, data)
        except codec.CodecError:
            continue
        if ack.plan_id != plan_id or ack.node not in node_ids:
            continue
        node_ids.discard(ack.node)
        if ack.status != PlanAckStatus.APPLIED:
            failed.append(ack.node)
        detail = f": {ack.detail}" if ack.detail else ""
        print(f"  {ack.node}: {ack.status.name} (started {ack.started_instance_ids}, "
              f"stopped {ack.stopped_instance_ids}){detail}")
    if failed:
        raise CliError(f"plan {plan_id} was not applied on {failed}")


def _requester() -> str:
    try:
        return f"dls reconfig apply ({getpass.getuser()})"
    except (KeyError, OSError):  # no user name in this environment
        return "dls reconfig apply"
