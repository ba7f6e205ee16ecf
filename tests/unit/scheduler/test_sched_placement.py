"""Algorithm 3: placement, spreading, migration rules."""

from __future__ import annotations

from services.scheduler.core import CacheMode, RequestStatus, SchedulingLoop, make_policy
from services.scheduler.core.placement import PlacementConfig, Placer
from tests.unit.scheduler.sched_builders import make_request, make_view, outcome, step_result


def loop_for(profile, tps, policy="dilaserve", config=None, **view_kwargs):
    return SchedulingLoop(make_policy(policy, config), make_view(profile, tps, **view_kwargs))


def test_low_load_prefers_the_faster_higher_tp_instance(h100):
    loop = loop_for(h100, [1, 1, 1, 4])
    (assignment,) = loop.on_arrival(0.0, make_request("r0")).assignments
    assert assignment.instance_id == "i3"


def test_high_load_spreads_over_more_instances(h100):
    loop = loop_for(h100, [1, 1, 1, 4])
    loop.on_arrivals(0.0, [make_request(f"r{i}") for i in range(12)])
    batches = {iid: inst.batch for iid, inst in loop.view.instances.items()}
    assert all(b > 0 for b in batches.values())
    # TP-4 takes more than its share because its steps stay faster at larger batches
    assert batches["i3"] == max(batches.values())
    assert sum(batches.values()) == 12


def test_batch_limit_holds_and_the_rest_queue(profile):
    loop = loop_for(profile, [1, 1], max_batch=2)
    decisions = loop.on_arrivals(0.0, [make_request(f"r{i}") for i in range(5)])
    assert len(decisions.assignments) == 4
    assert loop.view.num_queued == 1
    assert all(inst.batch == 2 for inst in loop.view.instances.values())


def test_memory_limit_is_respected(profile):
    loop = loop_for(profile, [1], mem_limit_tokens=1000)
    decisions = loop.on_arrivals(0.0, [make_request("a"), make_request("b")])  # 512 tokens each
    assert [a.request_id for a in decisions.assignments] == ["a"]


def _one_request_then_faster_instance(profile, cache_mode=CacheMode.DUAL):
    loop = loop_for(profile, [1])
    loop.on_arrival(0.0, make_request("r", cache_mode=cache_mode))
    loop.view.add_instance("fast", 4, profile)
    return loop


def test_migration_only_at_recompute_steps_when_caching(profile):
    loop = _one_request_then_faster_instance(profile)
    # the first step was the block's recompute; the next one is a cache step: stay
    decisions = loop.on_step_result(0.1, step_result("i0", outcome("r", 2, recompute=True)))
    assert decisions.migrations == [] and decisions.assignments[0].instance_id == "i0"
    decisions = loop.on_step_result(0.2, step_result("i0", outcome("r", 30, block_done=True)))
    (move,) = decisions.migrations
    assert (move.instance_id, move.from_instance_id, move.recompute) == ("fast", "i0", True)
    assert loop.view.requests["r"].status == RequestStatus.MIGRATING


def test_without_cache_migration_happens_at_any_step(profile):
    loop = _one_request_then_faster_instance(profile, cache_mode=CacheMode.NONE)
    decisions = loop.on_step_result(0.1, step_result("i0", outcome("r", 2, recompute=True)))
    assert [m.instance_id for m in decisions.migrations] == ["fast"]


def test_no_migration_ablation_never_moves(profile):
    loop = loop_for(profile, [1], policy="dilaserve-no-migration")
    loop.on_arrival(0.0, make_request("r", cache_mode=CacheMode.NONE))
    loop.view.add_instance("fast", 4, profile)
    decisions = loop.on_step_result(0.1, step_result("i0", outcome("r", 2)))
    assert decisions.migrations == []


def test_margin_keeps_requests_on_similar_instances(profile):
    loop = loop_for(profile, [1, 1], config={"migration_margin": 0.10})
    loop.on_arrivals(0.0, [make_request(f"r{i}", cache_mode=CacheMode.NONE) for i in range(3)])
    # 2 on i0, 1 on i1: for a request on i0, i1 would run at batch 2 = same latency -> stay
    result = step_result("i0", *(outcome(rid, 1) for rid in loop.view.instances["i0"].resident_ids))
    assert loop.on_step_result(0.1, result).migrations == []


def test_cooldown_prevents_ping_pong(profile):
    placer = Placer(PlacementConfig(cooldown_steps=4), rng=None)
    request = make_request("r", cache_mode=CacheMode.NONE)
    request.num_steps_done, request.last_migration_step = 10, 8
    assert not placer.may_migrate(request)
    request.num_steps_done = 12
    assert placer.may_migrate(request)


def test_moved_request_stays_put_for_the_cooldown(profile):
    loop = _one_request_then_faster_instance(profile, cache_mode=CacheMode.NONE)
    loop.on_step_result(0.1, step_result("i0", outcome("r", 1)))  # moves to the TP-4 instance
    assert loop.view.requests["r"].instance_id == "fast"
    for i in range(7):  # crowd "fast" (TP-4 at batch 8 still beats TP-1 at batch 1)
        loop.view.add_request(make_request(f"x{i}", cache_mode=CacheMode.NONE))
    loop.tick(0.1)
    assert loop.view.instances["fast"].batch == 8
    loop.view.add_instance("idle", 4, profile)  # now a much better place for r
    moved_at = []
    for step in range(6):
        decisions = loop.on_step_result(0.2 + step, step_result("fast", outcome("r", 1)))
        if decisions.migrations:
            moved_at.append(loop.view.requests["r"].num_steps_done)
            break
    # first move decided after step 1; the next only once 4 more steps have run
    assert moved_at == [5]
    assert loop.view.requests["r"].instance_id == "idle"


def test_draining_instance_sends_its_requests_elsewhere(profile):
    loop = loop_for(profile, [1, 1])
    loop.on_arrival(0.0, make_request("r"))
    source = loop.view.requests["r"].instance_id
    loop.view.drain_instance(source)
    decisions = loop.on_step_result(0.1, step_result(source, outcome("r", 1, recompute=True)))
    (move,) = decisions.migrations
    assert move.instance_id != source


def test_draining_everywhere_keeps_requests_running_in_place(profile):
    # every instance drains at once (a reconfiguration replacing them all): nowhere to move to, so
    # the request keeps stepping where it is instead of stalling the drain forever
    loop = loop_for(profile, [1, 1])
    loop.on_arrival(0.0, make_request("r"))
    source = loop.view.requests["r"].instance_id
    for instance_id in list(loop.view.instances):
        loop.view.drain_instance(instance_id)
    decisions = loop.on_step_result(0.1, step_result(source, outcome("r", 1, recompute=True)))
    (stay,) = decisions.assignments
    assert stay.instance_id == source and not stay.is_migration
    assert loop.view.requests["r"].status == RequestStatus.RUNNING


def test_threshold_uses_the_new_instance_after_a_move(profile):
    loop = _one_request_then_faster_instance(profile, cache_mode=CacheMode.NONE)
    (move,) = loop.on_step_result(0.1, step_result("i0", outcome("r", 2))).migrations
    # estimate at the TP-4 instance: 0.4x the TP-1 step time for the remaining steps
    remaining = loop.view.requests["r"]
    assert move.estimated_remaining_s > 0 and remaining.instance_id == "fast"
    assert move.estimated_remaining_s < 0.05 * 254  # TP-1 full steps are 0.1 s each
