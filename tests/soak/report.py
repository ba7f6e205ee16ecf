"""The soak's report, from what the clients saw and what the injector did (pure: no I/O, no clock).

Latency classes: a completed request is *after_fault* when its life (sent to answered) overlaps the
``AFTER_FAULT_S`` seconds that follow any fault's injection, *undisturbed* otherwise. Percentiles are
nearest-rank (p50 of [1, 2, 3, 4] is 2), None when a class is empty.

A fault's verdict (``Fault.verdict``): *recovered*; *not recovered* (the load went on and its part did
not serve again within the injector's timeout), which fails the soak; or *not judged* (no load was left
to show its recovery), which is listed (``faults_not_judged``) and printed but neither counted among
the faults nor failing the run: the injector's schedule keeps it from happening (``faults.Schedule``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

AFTER_FAULT_S = 30.0


@dataclass(frozen=True)
class RequestOutcome:
    """One logical request, as its client saw it (times in seconds on one monotonic clock)."""

    outcome: str  # completed, refused, failed, lost
    sent_at: float
    done_at: float
    refusals: tuple[tuple[int, str, str], ...] = ()  # (status, Retry-After, error code) of each 429/503 it got
    accepted: bool = False  # it got a request id (generation began)
    duplicated: bool = False  # a step or position stored twice, or more than one RequestFinished


@dataclass(frozen=True)
class Fault:
    """One injected fault."""

    kind: str
    target: str
    at: float  # injected
    recovered_at: float | None = None  # the broken part serves again (None: it did not within the wait)
    detail: dict = field(default_factory=dict)
    judged: bool = True  # False: no load was left to show its recovery (recovered_at is then None)

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.at

    @property
    def verdict(self) -> str:
        """recovered, not_recovered (fails the soak) or not_judged."""
        if not self.judged:
            return "not_judged"
        return "not_recovered" if self.recovered_at is None else "recovered"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank ``q``-th percentile (0 < q <= 100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def after_fault(request: RequestOutcome, fault_times: Iterable[float], window_s: float = AFTER_FAULT_S) -> bool:
    """Does the request's life [sent, done] overlap [t, t + window_s] for a fault injected at t?"""
    return any(request.sent_at <= t + window_s and request.done_at >= t for t in fault_times)


def latency_summary(values: Sequence[float]) -> dict:
    p50, p99 = percentile(values, 50), percentile(values, 99)
    return {"n": len(values), "p50": None if p50 is None else round(p50, 3),
            "p99": None if p99 is None else round(p99, 3)}


def summarize(requests: Sequence[RequestOutcome], faults: Sequence[Fault]) -> dict:
    """The report's figures (see tests/chaos/README.md, "The soak")."""
    completed = [r for r in requests if r.outcome == "completed"]
    refused = [r for r in requests if r.outcome == "refused"]
    fault_times = [f.at for f in faults]
    disturbed = [r.done_at - r.sent_at for r in completed if after_fault(r, fault_times)]
    calm = [r.done_at - r.sent_at for r in completed if not after_fault(r, fault_times)]
    unjudged = [f for f in faults if f.verdict == "not_judged"]
    unrecovered = [f for f in faults if f.verdict == "not_recovered"]
    faults = [f for f in faults if f.judged]
    kinds = sorted({f.kind for f in faults})
    recovery: dict[str, float | None] = {}
    recovery_detail: dict[str, dict] = {}
    for kind in kinds:
        times = [f.recovery_s for f in faults if f.kind == kind]
        done = [t for t in times if t is not None]
        recovery[kind] = round(max(done), 2) if done and len(done) == len(times) else None
        recovery_detail[kind] = {"n": len(times), "recovered": len(done),
                                 "mean_s": round(sum(done) / len(done), 2) if done else None,
                                 "max_s": round(max(done), 2) if done else None}
    statuses: dict[str, int] = {}
    reasons: dict[str, int] = {}  # "<status> <error code>" -> refused requests
    for r in refused:
        status = str(r.refusals[-1][0]) if r.refusals else "none"
        statuses[status] = statuses.get(status, 0) + 1
        reason = f"{status} {r.refusals[-1][2] or '?'}" if r.refusals else "none"
        reasons[reason] = reasons.get(reason, 0) + 1
    return {
        "sent": len(requests),
        "accepted": sum(r.accepted for r in requests),
        "completed": len(completed),
        "refused": len(refused),
        "refused_by_status": statuses,
        "refused_by_reason": reasons,
        "refused_without_retry_after": sum(1 for r in refused if not r.refusals or not r.refusals[-1][1].isdigit()),
        "failed": sum(r.outcome == "failed" for r in requests),
        "lost": sum(r.outcome not in ("completed", "refused", "failed") for r in requests),
        "accepted_not_completed": sum(r.accepted and r.outcome != "completed" for r in requests),
        "duplicated": sum(r.duplicated for r in completed),
        "faults": len(faults),
        "faults_not_recovered": [{"kind": f.kind, "target": f.target} for f in unrecovered],
        "faults_not_judged": [{"kind": f.kind, "target": f.target} for f in unjudged],
        "fault_kinds": kinds,
        "faults_by_kind": {kind: sum(f.kind == kind for f in faults) for kind in kinds},
        "recovery_s": recovery,
        "recovery_detail": recovery_detail,
        "latency_s": {"undisturbed": latency_summary(calm), "after_fault": latency_summary(disturbed)},
    }


def skew_problems(skewed: Sequence[dict], faults: Sequence[Fault]) -> list[str]:
    """What the skewed workers (the injector's ``skew``: instance_id, steps, dropped_while_alive) did wrong:
    dropped by the scheduler while alive, or served no step; a skew fault not judged is not blamed for
    serving nothing (no load was left to give it a step)."""
    unjudged = {f.detail.get("instance_id") for f in faults if f.kind == "worker_skew" and not f.judged}
    return [f"skewed worker {s['instance_id']} dropped while alive" for s in skewed if s.get("dropped_while_alive")] + [
        f"skewed worker {s['instance_id']} served no step" for s in skewed
        if not s.get("steps") and s["instance_id"] not in unjudged]


def acceptance(report: dict, min_requests: int, min_faults: int, min_kinds: int) -> list[str]:
    """What the report misses of the acceptance bar (empty: it passes)."""
    problems = []
    if report["sent"] < min_requests:
        problems.append(f"sent {report['sent']} < {min_requests} requests")
    if report["faults"] < min_faults:
        problems.append(f"{report['faults']} faults < {min_faults}")
    if len(report["fault_kinds"]) < min_kinds:
        problems.append(f"{len(report['fault_kinds'])} fault kinds < {min_kinds}")
    for key in ("lost", "duplicated", "failed", "accepted_not_completed", "refused_without_retry_after"):
        if report[key]:
            problems.append(f"{key} {report[key]}")
    unrecovered = [kind for kind, seconds in report["recovery_s"].items() if seconds is None]
    if unrecovered:
        problems.append(f"not recovered: {unrecovered}")
    return problems
