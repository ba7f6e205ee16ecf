"""The soak's report (tests/soak/report.py): latency classes, percentiles, recovery, the acceptance bar."""

from __future__ import annotations

from tests.soak.report import (
    AFTER_FAULT_S,
    Fault,
    RequestOutcome,
    acceptance,
    after_fault,
    percentile,
    summarize,
)


def done(sent: float, latency: float, **kw) -> RequestOutcome:
    return RequestOutcome("completed", sent, sent + latency, accepted=True, **kw)


def test_percentiles_are_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([4, 1, 3, 2], 50) == 2 and percentile([4, 1, 3, 2], 99) == 4
    assert percentile(list(range(1, 101)), 99) == 99 and percentile([7], 99) == 7


def test_a_request_is_after_a_fault_when_its_life_overlaps_the_window():
    assert after_fault(done(100.0, 5.0), [90.0])  # in flight when the fault hit... and within 30 s of it
    assert after_fault(done(100.0, 5.0), [103.0])  # the fault came while it ran
    assert after_fault(done(100.0 + AFTER_FAULT_S - 0.1, 1.0), [100.0])
    assert not after_fault(done(100.0 + AFTER_FAULT_S + 0.1, 1.0), [100.0])
    assert not after_fault(done(50.0, 5.0), [60.0])  # answered before the fault


def test_summary_counts_and_splits_latency():
    requests = [done(0.0, 1.0), done(10.0, 2.0), done(100.0, 9.0), done(200.0, 3.0, duplicated=True),
                RequestOutcome("refused", 5.0, 5.1, refusals=((429, "2", "deadline_infeasible"),)),
                RequestOutcome("refused", 6.0, 6.1, refusals=((503, "", "unavailable"),)),
                RequestOutcome("lost", 7.0, 300.0, accepted=True)]
    faults = [Fault("worker_kill", "w1", 95.0, 101.0), Fault("worker_kill", "w2", 195.0, 199.5),
              Fault("redis_failover", "redis-0", 96.0, None)]
    report = summarize(requests, faults)
    assert (report["sent"], report["completed"], report["refused"], report["lost"], report["duplicated"]) == \
        (7, 4, 2, 1, 1)
    assert report["refused_by_status"] == {"429": 1, "503": 1} and report["refused_without_retry_after"] == 1
    assert report["refused_by_reason"] == {"429 deadline_infeasible": 1, "503 unavailable": 1}
    assert report["accepted_not_completed"] == 1
    assert report["latency_s"]["undisturbed"] == {"n": 2, "p50": 1.0, "p99": 2.0}
    assert report["latency_s"]["after_fault"] == {"n": 2, "p50": 3.0, "p99": 9.0}
    assert report["faults"] == 3 and report["fault_kinds"] == ["redis_failover", "worker_kill"]
    assert report["recovery_s"] == {"redis_failover": None, "worker_kill": 6.0}
    problems = acceptance(report, min_requests=5, min_faults=3, min_kinds=3)
    assert problems == ["2 fault kinds < 3", "lost 1", "duplicated 1", "accepted_not_completed 1",
                        "refused_without_retry_after 1", "not recovered: ['redis_failover']"]
    clean = summarize([done(0.0, 1.0)], [Fault("gateway_kill", "gateway", 50.0, 52.0)])
    assert acceptance(clean, min_requests=1, min_faults=1, min_kinds=1) == []
