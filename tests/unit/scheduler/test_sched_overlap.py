"""Overlap in the policy loop: after ``record``, ``SchedulingLoop.continue_steps`` keeps instances stepping
before a pass, ``replan`` sets the continued requests' next thresholds (``StepScheduler`` drives both)."""

from __future__ import annotations

from services.scheduler.core import RequestStatus, SchedulingLoop, make_policy
from tests.unit.scheduler.sched_builders import make_request, make_view, outcome, step_result, toy_profile


def _running_loop(num_requests: int = 3, slo_s: float = 60.0, **request_kwargs) -> SchedulingLoop:
    """One TP-1 instance running ``num_requests`` requests (first step done: inside block 0)."""
    loop = SchedulingLoop(make_policy("dilaserve", rng=0), make_view(toy_profile(), [1]))
    requests = [make_request(f"r{k}", slo_s=slo_s, **request_kwargs) for k in range(num_requests)]
    decisions = loop.on_arrivals(0.0, requests)
    assert {a.instance_id for a in decisions.assignments} == {"i0"}
    loop.on_step_result(0.1, step_result("i0", *(outcome(r.request_id, num=1) for r in requests)))
    return loop


def _continue(loop: SchedulingLoop, now: float, result, min_tokens: int = 32, running=None):
    loop.record(now, [result])
    return loop.continue_steps(now, [result.instance_id], min_tokens, running)


def test_continue_keeps_the_batch_at_its_thresholds_without_a_pass():
    loop = _running_loop()
    before = {rid: loop.view.requests[rid].threshold for rid in ("r0", "r1", "r2")}
    cont = _continue(loop, 0.2, step_result("i0", *(outcome(f"r{k}") for k in range(3))))
    assert sorted(cont.continued_ids) == ["r0", "r1", "r2"]
    assert {a.request_id: a.threshold for a in cont.decisions.assignments} == before
    assert all(a.instance_id == "i0" and not a.is_migration for a in cont.decisions.assignments)
    assert all(loop.view.requests[rid].status == RequestStatus.RUNNING for rid in before)
    assert not cont.needs_pass
    assert all(loop.view.requests[rid].num_steps_done == 2 for rid in before)  # the step is recorded


def test_replan_moves_thresholds_with_the_budget():
    """A deadline that has become tight: the next threshold after replan is the lowest allowed."""
    loop = _running_loop(slo_s=60.0)
    top = max(loop.policy.grid.values)
    assert loop.view.requests["r0"].threshold == top  # plenty of budget
    cont = _continue(loop, 50.0, step_result("i0", *(outcome(f"r{k}") for k in range(3))))
    assert loop.view.requests["r0"].threshold == top  # continued as it was
    loop.replan(59.0, cont.continued_ids)  # one second left for ~230 tokens
    assert loop.view.requests["r0"].threshold == min(loop.policy.grid.values)


def test_no_continuation_at_a_block_start_near_the_end_or_with_a_queue():
    loop = _running_loop()
    cont = _continue(loop, 0.2, step_result("i0", outcome("r0", block_done=True), outcome("r1"), outcome("r2")))
    assert cont.continued_ids == [] and cont.needs_pass  # r0 starts a block: the pass decides
    assert loop.tick(0.2).assignments  # and it places all three

    near_end = _running_loop(gen_len=40, block_len=40)
    cont = _continue(near_end, 0.2, step_result("i0", *(outcome(f"r{k}", num=8) for k in range(3))))
    assert cont.continued_ids == []  # 40 - 9 = 31 tokens left: below the minimum

    queued = _running_loop(num_requests=3)
    queued.on_arrival(0.15, make_request("late"))  # the toy instance (max batch 8) has room: placed
    queued.view.instances["i0"].max_batch = 4  # now full at four: a fifth request would queue
    queued.view.add_request(make_request("waiting"))
    cont = _continue(queued, 0.2, step_result("i0", *(outcome(f"r{k}") for k in range(3))))
    assert cont.continued_ids == []  # "late" is still running (not READY): the pass owns this instance
    assert cont.needs_pass


def test_finished_request_frees_its_slot_through_the_pass():
    loop = _running_loop()
    loop.view.add_request(make_request("waiting"))
    cont = _continue(loop, 0.2, step_result("i0", outcome("r0", finished=True), outcome("r1"), outcome("r2")))
    assert cont.continued_ids == [] and cont.needs_pass  # a queue and room: the pass admits into the slot
    placed = {a.request_id for a in loop.tick(0.2).assignments}
    assert {"r1", "r2", "waiting"} <= placed


def test_an_instance_that_went_on_by_itself_is_mirrored_at_its_thresholds():
    """Pipelining: the worker ran the step it held, so the core continues exactly those requests at
    those thresholds even where its own checks (a queue, a block start) would have said no."""
    loop = _running_loop()
    loop.view.add_request(make_request("waiting"))  # a queue and room: continue_steps alone would not go on
    result = step_result("i0", *(outcome(f"r{k}") for k in range(3)))
    cont = _continue(loop, 0.2, result, running={"i0": [("r0", 0.7), ("r1", 0.8)]})
    assert sorted(cont.continued_ids) == ["r0", "r1"]
    assert {a.request_id: a.threshold for a in cont.decisions.assignments} == {"r0": 0.7, "r1": 0.8}
    assert loop.view.requests["r0"].status == RequestStatus.RUNNING
    assert loop.view.requests["r2"].status == RequestStatus.READY  # not in the held command: the pass places it
    assert cont.needs_pass


def test_would_stay_says_who_keeps_its_instance_at_a_block_start():
    """Pipelining asks one step ahead: on a lopsided cluster a request would move at its block start
    (an empty instance is much faster), so it may not go on through it; on its own, it stays."""
    loop = _running_loop(num_requests=6)
    ids = [f"r{k}" for k in range(6)]
    assert loop.would_stay("i0", ids) == set(ids)  # nowhere to go
    loop.view.add_instance("i1", 1, toy_profile(), node_id="n0")
    assert loop.would_stay("i0", ids) == set()  # batch 6 at 150 ms vs an empty instance at 100 ms
    fixed = SchedulingLoop(make_policy("fixed", rng=0), make_view(toy_profile(), [1]))
    assert fixed.would_stay("i0", ["x"]) == set()  # a policy that cannot say: no one goes on through a block start
