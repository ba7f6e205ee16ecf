"""KV memory in the scheduling core, without NATS or Redis: placement never beyond an instance's
memory, queued requests wait, running ones yield to higher priority (or to an earlier deadline they
can afford to wait for) and resume from their stored state, a step the worker's budget refused goes
back to the queue, and a request no instance could ever hold is rejected."""

from __future__ import annotations

from services.scheduler.core import (
    BatchOutcome,
    PreemptionConfig,
    Preemptor,
    RejectReason,
    RequestStatus,
    SchedulingLoop,
    StepConfig,
    StepOutcome,
    StepScheduler,
    make_policy,
)
from services.scheduler.core.view import ClusterView
from tests.unit.scheduler.sched_builders import make_request, toy_profile

NO_OVERLAP = StepConfig(overlap_min_tokens=0, pipelining=False)
CONTEXT = 512  # make_request: 256 prompt + 256 canvas


def make_core(mem_tokens: int, num_instances: int = 1, preemption: PreemptionConfig | None = None) -> StepScheduler:
    view = ClusterView()
    for i in range(num_instances):
        view.add_instance(f"i{i}", 1, toy_profile(), mem_limit_tokens=mem_tokens)
    loop = SchedulingLoop(make_policy("dilaserve", rng=0), view, Preemptor(preemption))
    return StepScheduler(loop, NO_OVERLAP, first_step_id=100)


def arrive(core: StepScheduler, rid: str, now: float = 0.0, **kwargs):
    return core.on_arrivals(now, [make_request(rid, now, state_version=1, **kwargs)])


def commands(decisions):
    return [c for c in decisions.commands if c.items]


def run_step(core: StepScheduler, now: float, command, finished=(), kv_full=()):
    outcomes = tuple(StepOutcome(it.request_id, 1, False, it.request_id in finished, False,
                                 state_version=it.state_version + 1)
                     for it in command.items if it.request_id not in kv_full)
    first = core.on_results(now, [BatchOutcome(command.instance_id, outcomes, 0.1, step_id=command.step_id,
                                               kv_full_ids=tuple(kv_full))])
    return first.decisions.extend(core.finish_results(now, first.pending))


def resident(core: StepScheduler, instance_id: str = "i0") -> set[str]:
    return set(core.view.instances[instance_id].resident_ids)


def test_placement_never_exceeds_an_instances_memory_and_queued_requests_wait_for_it():
    core = make_core(mem_tokens=2 * CONTEXT, num_instances=2)
    for rid in "abcde":
        arrive(core, rid)
    assert all(len(resident(core, iid)) == 2 for iid in ("i0", "i1"))  # 8 batch slots, memory for 2 each
    assert core.view.num_queued == 1
    table = core.view.table
    assert (table.mem_free[:2] == 0).all()
    # a request finishes: the queued one takes its memory
    inst = core.view.requests["a"].instance_id
    out = run_step(core, 1.0, _in_flight(core, inst), finished={"a"})
    assert core.view.requests["e"].status == RequestStatus.RUNNING and core.view.requests["e"].instance_id == inst
    assert any("e" in [it.request_id for it in c.items] for c in out.commands)
    assert not out.preemptions


def _in_flight(core: StepScheduler, instance_id: str):
    """The command in flight on ``instance_id``, rebuilt from the core's record of it."""
    from shared.messages.steps import StepCommand, StepItem

    st = core._instances[instance_id]
    items = [StepItem(request_id=rid, threshold=float(core.view.requests[rid].threshold or 0.9),
                      state_version=core.view.requests[rid].state_version) for rid in st.in_flight_ids]
    return StepCommand(instance_id=instance_id, step_id=st.busy_step_id, items=items, issued_at=0.0)


def test_a_higher_priority_arrival_preempts_and_the_victim_resumes_from_its_stored_state():
    core = make_core(mem_tokens=2 * CONTEXT)
    arrive(core, "low1")
    arrive(core, "low2")
    out = arrive(core, "high", now=0.1, priority=5)
    assert core.view.requests["high"].status == RequestStatus.QUEUED  # the instance is busy: nobody yields mid-step
    assert not out.preemptions
    out = run_step(core, 0.5, _in_flight(core, "i0"))  # between steps: low2 yields (the least slack lost: latest)
    assert [p.for_request_id for p in out.preemptions] == ["high"]
    victim = out.preemptions[0].request_id
    assert core.view.requests[victim].status == RequestStatus.QUEUED
    assert "high" in resident(core) and victim not in resident(core)
    sent = commands(out)[0]
    assert victim in sent.drop_request_ids  # its holder drops its copy and KV cache
    assert {it.request_id for it in sent.items} == {"high"} | ({"low1", "low2"} - {victim})
    assert core.counters["preemptions"] == 1
    # the other finishes; the victim comes back, its state loaded from the store
    survivor = ({"low1", "low2"} - {victim}).pop()
    out = run_step(core, 1.0, sent, finished={survivor})
    back = [it for c in commands(out) for it in c.items if it.request_id == victim]
    assert back and back[0].load_state and back[0].state_version == 2
    assert core.view.requests[victim].num_preemptions == 1


def test_same_priority_yields_only_to_an_earlier_deadline_it_can_afford_to_wait_for():
    core = make_core(mem_tokens=2 * CONTEXT)
    arrive(core, "relaxed1", slo_s=600.0)
    arrive(core, "relaxed2", slo_s=600.0)
    arrive(core, "urgent", now=0.1, slo_s=30.0)
    out = run_step(core, 0.5, _in_flight(core, "i0"))
    assert [p.for_request_id for p in out.preemptions] == ["urgent"]
    assert "urgent" in resident(core)

    core = make_core(mem_tokens=2 * CONTEXT)
    arrive(core, "tight1", slo_s=6.0)
    arrive(core, "tight2", slo_s=6.0)
    arrive(core, "later", now=0.1, slo_s=5.0)  # earlier deadline, but neither resident can wait for it
    out = run_step(core, 0.5, _in_flight(core, "i0"))
    assert not out.preemptions and core.view.requests["later"].status == RequestStatus.QUEUED


def test_a_request_yields_at_most_max_per_request_times():
    core = make_core(mem_tokens=CONTEXT, preemption=PreemptionConfig(max_per_request=1))
    arrive(core, "low")
    arrive(core, "mid", now=0.1, priority=1)
    out = run_step(core, 0.2, _in_flight(core, "i0"))
    assert [p.request_id for p in out.preemptions] == ["low"]
    arrive(core, "high", now=0.3, priority=2)
    out = run_step(core, 0.4, _in_flight(core, "i0"), finished={"mid"})
    # mid finished: low (preempted once) and high compete for the memory; high is first in the queue
    assert "high" in resident(core) and core.view.requests["low"].status == RequestStatus.QUEUED
    assert not out.preemptions


def test_a_step_the_workers_budget_refused_goes_back_to_the_queue_and_runs_again():
    core = make_core(mem_tokens=2 * CONTEXT)
    arrive(core, "a")
    arrive(core, "b")
    out = run_step(core, 0.5, _in_flight(core, "i0"), kv_full={"b"})
    assert core.counters["kv_refused_steps"] == 1 and core.view.requests["b"].num_preemptions == 1
    again = [it for c in commands(out) for it in c.items if it.request_id == "b"]
    assert again and again[0].load_state  # placed again (memory allows it), from the stored state
    assert [p.request_id for p in out.preemptions] == [] and core.counters["preemptions"] == 1


def test_a_request_no_instance_could_ever_hold_is_rejected():
    core = make_core(mem_tokens=CONTEXT, num_instances=2)
    out = arrive(core, "huge", prompt_len=2000)
    assert [(r.request_id, r.reason) for r in out.rejections] == [("huge", RejectReason.NO_INSTANCE)]
    assert "2256 tokens" in out.rejections[0].detail and "holds 512" in out.rejections[0].detail
    assert "huge" not in core.view.requests
    out = arrive(core, "fits", now=1.0)
    assert not out.rejections and core.view.requests["fits"].status == RequestStatus.RUNNING
