"""Order of simultaneous events: (time, kind, seq), and what that means for decisions."""

from __future__ import annotations

from services.scheduler.core import EventKind, EventQueue, SchedulingLoop, make_policy
from tests.unit.scheduler.sched_builders import make_request, make_view, outcome, step_result


def test_event_queue_orders_by_time_then_kind_then_push_order():
    queue = EventQueue()
    queue.push(1.0, EventKind.ARRIVAL, "a1")
    queue.push(1.0, EventKind.TICK, "t")
    queue.push(1.0, EventKind.STEP_RESULT, "s1")
    queue.push(0.5, EventKind.ARRIVAL, "early")
    queue.push(1.0, EventKind.ARRIVAL, "a2")
    queue.push(1.0, EventKind.STEP_RESULT, "s2")
    queue.push(1.0, EventKind.PREDICTION, "p")
    order = [queue.pop().payload for _ in range(len(queue))]
    assert order == ["early", "s1", "s2", "p", "a1", "a2", "t"]


def drive(loop, queue):
    """Process events in queue order; returns the decisions per payload name."""
    out = {}
    while queue:
        event = queue.pop()
        name, body = event.payload
        if event.key.kind == EventKind.STEP_RESULT:
            out[name] = loop.on_step_result(event.key.time, body)
        else:
            out[name] = loop.on_arrival(event.key.time, body)
    return out


def test_a_step_result_at_the_same_time_frees_its_slot_for_the_arrival(profile):
    loop = SchedulingLoop(make_policy("dilaserve"), make_view(profile, [1], max_batch=1))
    loop.on_arrival(0.0, make_request("old", gen_len=1))
    queue = EventQueue()
    # pushed first, but processed second: the result goes first at equal times
    queue.push(1.0, EventKind.ARRIVAL, ("arrival", make_request("new", 1.0)))
    queue.push(1.0, EventKind.STEP_RESULT, ("result", step_result("i0", outcome("old", 1, True, True))))
    out = drive(loop, queue)
    assert [a.request_id for a in out["arrival"].assignments] == ["new"]


def test_simultaneous_arrivals_are_served_in_push_order(profile):
    for policy in ("dilaserve", "llumnix", "infaas"):
        loop = SchedulingLoop(make_policy(policy), make_view(profile, [1], max_batch=1))
        queue = EventQueue()
        for name in ("x", "y", "z"):
            queue.push(2.0, EventKind.ARRIVAL, (name, make_request(name, 2.0)))
        out = drive(loop, queue)
        assert [a.request_id for a in out["x"].assignments] == ["x"], policy
        assert out["y"].assignments == [] and out["z"].assignments == []
        # and when the slot frees, the earlier of the two waiting ones goes first
        decisions = loop.on_step_result(3.0, step_result("i0", outcome("x", 256, True, True)))
        assert [a.request_id for a in decisions.assignments] == ["y"], policy


def test_equal_latency_instances_tie_break_on_the_lowest_row(profile):
    loop = SchedulingLoop(make_policy("dilaserve"), make_view(profile, [1, 1, 1]))
    decisions = loop.on_arrivals(0.0, [make_request("a"), make_request("b"), make_request("c")])
    assert [a.instance_id for a in decisions.assignments] == ["i0", "i1", "i2"]


def test_step_results_of_several_instances_are_replanned_in_one_pass(profile):
    """``on_step_results``: each result recorded, one scheduling pass re-plans all their requests."""
    for policy in ("dilaserve", "fixed", "llumnix", "infaas"):
        one = SchedulingLoop(make_policy(policy), make_view(profile, [1, 1]))
        many = SchedulingLoop(make_policy(policy), make_view(profile, [1, 1]))
        for loop in (one, many):
            first = loop.on_arrivals(0.0, [make_request("a"), make_request("b")])
            assert {a.request_id for a in first.assignments} == {"a", "b"}, policy
        results = [step_result(a.instance_id, outcome(a.request_id, 4)) for a in first.assignments]
        decisions = many.on_step_results(1.0, results)
        assert {a.request_id for a in decisions.assignments} == {"a", "b"}, policy
        for rid in ("a", "b"):
            assert many.view.requests[rid].num_steps_done == 1, policy
            assert many.view.requests[rid].num_tokens_committed == 4, policy
        # a single result: the same as on_step_result
        d_one = one.on_step_result(1.0, results[0])
        d_many = many.on_step_results(2.0, [step_result(decisions.assignments[0].instance_id,
                                                        outcome(decisions.assignments[0].request_id, 4))])
        assert len(d_one.assignments) == len(d_many.assignments) == 1, policy
