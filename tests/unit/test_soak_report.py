"""The soak's report (tests/soak/report.py): latency classes, percentiles, recovery, the acceptance bar."""

from __future__ import annotations

from tests.soak.report import (
    AFTER_FAULT_S,
    Fault,
    RequestOutcome,
    acceptance,
    after_fault,
    percentile,
    skew_problems,
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


def test_a_fault_that_could_not_be_judged_is_reported_apart_from_one_that_did_not_recover():
    faults = [Fault("worker_kill", "w0", 10.0, 14.0), Fault("worker_skew", "w9", 118.0, None, judged=False)]
    report = summarize([done(0.0, 1.0), done(20.0, 1.0)], faults)
    assert report["faults"] == 1 and report["fault_kinds"] == ["worker_kill"]
    assert report["faults_not_judged"] == [{"kind": "worker_skew", "target": "w9"}]
    assert acceptance(report, 1, 1, 1) == []  # unjudged is not unrecovered
    report = summarize([done(0.0, 1.0)], [*faults, Fault("worker_hang", "w1", 30.0, None)])
    assert acceptance(report, 1, 1, 1) == ["not recovered: ['worker_hang']"]


def test_each_fault_has_one_verdict_and_only_not_recovered_fails():
    recovered = Fault("gateway_kill", "gateway", 10.0, 13.0)
    unrecovered = Fault("worker_hang", "w1", 30.0, None)
    unjudged = Fault("worker_skew", "skew-2", 118.0, None, {"instance_id": "skew-2"}, judged=False)
    assert [f.verdict for f in (recovered, unrecovered, unjudged)] == ["recovered", "not_recovered", "not_judged"]
    report = summarize([done(0.0, 1.0)], [recovered, unrecovered, unjudged])
    assert report["faults"] == 2 and report["faults_by_kind"] == {"gateway_kill": 1, "worker_hang": 1}
    assert report["faults_not_recovered"] == [{"kind": "worker_hang", "target": "w1"}]
    assert report["faults_not_judged"] == [{"kind": "worker_skew", "target": "skew-2"}]
    assert "worker_skew" not in report["recovery_s"]  # not judged: neither a recovery time nor a failure
    assert acceptance(report, 1, 1, 1) == ["not recovered: ['worker_hang']"]


def test_a_skewed_worker_is_blamed_for_serving_nothing_only_when_its_fault_was_judged():
    skewed = [{"instance_id": "skew-1", "steps": 12.0, "dropped_while_alive": 0},
              {"instance_id": "skew-2", "steps": 0.0, "dropped_while_alive": 0},
              {"instance_id": "skew-3", "steps": 0.0, "dropped_while_alive": 2}]
    faults = [Fault("worker_skew", "skew-1 (+60 s)", 1.0, 9.0, {"instance_id": "skew-1"}),
              Fault("worker_skew", "skew-2 (-60 s)", 50.0, None, {"instance_id": "skew-2"}),
              Fault("worker_skew", "skew-3 (+60 s)", 90.0, None, {"instance_id": "skew-3"}, judged=False)]
    assert skew_problems(skewed, faults) == ["skewed worker skew-3 dropped while alive",
                                             "skewed worker skew-2 served no step"]


def test_the_load_goes_on_past_its_duration_while_a_fault_is_watched():
    import asyncio
    import random
    import time

    from tests.soak.load import OpenLoopLoad

    async def scenario(watching_s: float) -> tuple[float, int]:
        load = OpenLoopLoad(["http://127.0.0.1:9"], 50.0, random.Random(1))
        load._send = lambda: load.tracked.append(None)  # count the arrivals only (no server here)
        started = time.monotonic()
        until = started + watching_s
        await load.run(0.2, keep_going=lambda: time.monotonic() < until, max_extra_s=1.0)
        return time.monotonic() - started, len(load.tracked)

    alone, sent_alone = asyncio.run(scenario(0.0))
    watched, sent_watched = asyncio.run(scenario(0.6))
    assert watched >= 0.6 and sent_watched > sent_alone  # it sent until nothing was watched any more
    _, sent_capped = asyncio.run(scenario(60.0))  # a fault never seen recovering: at most max_extra_s more
    assert sent_capped < 50.0 * (0.2 + 1.0) * 2
