"""``StepScheduler``: batch composition, overlap, pipelining and catch-up, decided in the core and tested
without NATS or Redis (the scheduler service and the simulator drive exactly these calls)."""

from __future__ import annotations

import dataclasses

from services.scheduler.core import (
    BatchOutcome,
    RequestStatus,
    SchedulingLoop,
    StepConfig,
    StepOutcome,
    StepScheduler,
    StoredProgress,
    make_policy,
)
from services.scheduler.core.load import BACKGROUND_PRIORITY
from tests.unit.scheduler.sched_builders import make_request, make_view, toy_profile, uniform_prediction

NO_OVERLAP = StepConfig(overlap_min_tokens=0, pipelining=False)
OVERLAP_ONLY = StepConfig(overlap_min_tokens=32, pipelining=False)
PIPELINED = StepConfig(overlap_min_tokens=32, pipelining=True)


# The step mechanics below follow requests from their first step on: DiLaServe's first step before any
# prediction (``unpredicted_at_max``) would hold their second steps for the pass, so these tests plan
# every step with Algorithm 1 (the rule for the first step is tested on its own, under "pipelining").
MECHANICS = {"unpredicted_at_max": False}


def make_core(config: StepConfig, num_instances: int = 1, policy: str = "dilaserve",
              policy_config: dict | None = None) -> StepScheduler:
    view = make_view(toy_profile(), [1] * num_instances)
    options = MECHANICS if policy_config is None and policy == "dilaserve" else policy_config
    return StepScheduler(SchedulingLoop(make_policy(policy, options, rng=0), view), config, first_step_id=100)


def arrive(core: StepScheduler, *ids: str, now: float = 0.0, **kwargs):
    return core.on_arrivals(now, [make_request(rid, now, state_version=1, **kwargs) for rid in ids])


def plain(decisions):
    """The commands that run on arrival (not held), with items."""
    return [c for c in decisions.commands if not c.after_step_id and c.items]


def held(decisions):
    return [c for c in decisions.commands if c.after_step_id]


def report(command, *, num: int = 1, block_done=(), finished=(), failed=(), continued: int = 0,
           awaits_held: bool = False, predicted_end: int | None = None) -> BatchOutcome:
    """What the worker says after running ``command``: each item stepped (one stored version more)."""
    outcomes = tuple(
        StepOutcome(it.request_id, num, it.request_id in block_done, it.request_id in finished, False,
                    state_version=it.state_version + 1, confidence=(0.5, 0.6, 0.7, 0.7, 0.8),
                    predicted_end=predicted_end)
        for it in command.items if it.request_id not in failed)
    return BatchOutcome(command.instance_id, outcomes, 0.1, step_id=command.step_id, failed_ids=tuple(failed),
                        continued_step_id=continued, awaits_held=awaits_held)


def step(core: StepScheduler, now: float, command, predictions=None, **kwargs):
    """One batch of results through both calls: (the critical path's decisions, the pass's)."""
    first = core.on_results(now, [report(command, **kwargs)])
    return first, core.finish_results(now, first.pending, predictions)


# --- batch composition ---------------------------------------------------------------------------


def test_an_idle_instance_gets_every_assigned_request_at_its_threshold_and_stored_version():
    core = make_core(NO_OVERLAP)
    [command] = plain(arrive(core, "r0", "r1"))
    assert command.instance_id == "i0" and command.step_id == 101
    assert [(it.request_id, it.state_version, it.load_state) for it in command.items] == [
        ("r0", 1, True), ("r1", 1, True)]  # no instance holds them yet: loaded from the store
    assert {it.threshold for it in command.items} == {core.view.requests["r0"].threshold}
    assert core.busy("i0")
    assert plain(arrive(core, "r2")) == []  # the instance is busy: r2 waits for the next step
    first, rest = step(core, 0.1, command)
    assert first.decisions.commands == []  # without overlap the pass comes first
    [nxt] = plain(rest)
    assert [(it.request_id, it.state_version, it.load_state) for it in nxt.items] == [
        ("r0", 2, False), ("r1", 2, False), ("r2", 1, True)]


def test_a_request_that_moved_is_loaded_where_it_goes_and_dropped_where_it_was():
    core = make_core(NO_OVERLAP)
    ids = [f"r{k}" for k in range(6)]
    [command] = plain(arrive(core, *ids))
    core.add_instance(0.05, "i1", 1, toy_profile(), node_id="n0")  # empty: 100 ms a step vs 150 ms at batch 6
    _, rest = step(core, 0.1, command, block_done=ids)  # block starts: where migration is decided
    by_instance = {c.instance_id: c for c in plain(rest)}
    moved = [it.request_id for it in by_instance["i1"].items]
    assert moved and all(it.load_state for it in by_instance["i1"].items)
    assert {m.request_id for m in rest.migrations} == set(moved)
    assert not any(it.load_state for it in by_instance["i0"].items)
    _, after = step(core, 0.2, by_instance["i0"])
    [i0_next] = [c for c in after.commands if c.instance_id == "i0"]
    assert sorted(i0_next.drop_request_ids) == sorted(moved)  # i0 frees their copies


def test_a_failed_step_is_rerun_once_its_state_is_reloaded():
    core = make_core(NO_OVERLAP)
    [command] = plain(arrive(core, "r0", "r1"))
    first, rest = step(core, 0.1, command, failed=("r1",))
    assert first.decisions.reload_ids == ["r1"]
    [nxt] = plain(rest)
    assert [it.request_id for it in nxt.items] == ["r0"]  # r1 waits for its state
    assert core.view.requests["r1"].reloading and core.view.requests["r1"].holder_id is None
    # the store holds two steps of r1 (a worker wrote the second and its result was lost)
    out = core.reloaded(0.15, "r1", StoredProgress(version=3, num_steps=2, num_committed=2, current_block=0))
    r1 = core.view.requests["r1"]
    assert (r1.num_steps_done, r1.num_tokens_committed, r1.state_version, r1.reloading) == (2, 2, 3, False)
    assert core.counters["recovered_steps"] == 2  # neither step of it was reported
    assert plain(out) == []  # i0 is busy with r0's step; r1 goes with the next one
    _, rest = step(core, 0.2, nxt)
    [again] = plain(rest)
    assert [(it.request_id, it.state_version, it.load_state) for it in again.items] == [
        ("r0", 3, False), ("r1", 3, True)]


def test_a_failed_instance_sends_its_requests_elsewhere_after_their_reload():
    core = make_core(NO_OVERLAP, num_instances=2)
    commands = plain(arrive(core, "r0"))
    [command] = commands
    lost_on = command.instance_id
    out = core.fail_instance(1.0, lost_on)
    assert out.reload_ids == ["r0"] and core.counters["lost_steps"] == 1
    assert plain(out) == []  # not before its state is read back
    out = core.reloaded(1.1, "r0", StoredProgress(version=1, num_steps=0, num_committed=0, current_block=0))
    [again] = plain(out)
    assert again.instance_id != lost_on and again.items[0].load_state


def test_results_that_are_not_the_step_in_flight_are_ignored():
    core = make_core(NO_OVERLAP)
    [command] = plain(arrive(core, "r0"))
    stale = BatchOutcome("i0", (StepOutcome("r0", 1),), step_id=command.step_id - 1)
    out = core.on_results(0.1, [stale])
    assert out.ignored == [("i0", command.step_id - 1)] and core.view.requests["r0"].num_steps_done == 0


def test_a_drained_instance_leaves_once_its_step_is_back_and_a_cancel_frees_the_copy():
    core = make_core(NO_OVERLAP, num_instances=2)
    [command] = plain(arrive(core, "r0"))
    where = command.instance_id
    assert core.drain_instance(0.05, where).removed_ids == []  # its step is in flight
    _, rest = step(core, 0.1, command)
    assert rest.removed_ids == [where] and where not in core.view.instances
    [moved] = plain(rest)
    assert moved.instance_id != where and moved.items[0].load_state
    _, rest = step(core, 0.2, moved)
    [nxt] = plain(rest)
    cancelled = core.cancel(0.25, "r0", "client left")
    assert "r0" not in core.view.requests and cancelled.commands == []  # its holder is busy: drop comes next
    _, rest = step(core, 0.3, nxt)
    [drop] = rest.commands
    assert drop.items == [] and drop.drop_request_ids == ["r0"]


# --- overlap and pipelining ----------------------------------------------------------------------


def test_overlap_sends_the_next_step_before_the_pass_and_replans_its_thresholds_after():
    core = make_core(OVERLAP_ONLY)
    [command] = plain(arrive(core, "r0", "r1", slo_s=60.0))
    top = command.items[0].threshold
    first = core.on_results(59.0, [report(command)])  # mid-block, 255 tokens to go, one second left
    [cont] = plain(first.decisions)
    assert [it.threshold for it in cont.items] == [top, top]  # continued at the thresholds it had
    rest = core.finish_results(59.0, first.pending)
    assert rest.commands == []  # nothing else to send, no held commands without pipelining
    assert core.view.requests["r0"].threshold < top  # replanned: the step after this one runs lower
    assert core.counters["continued_steps"] == 1


def test_no_overlap_at_a_block_start():
    core = make_core(OVERLAP_ONLY)
    [command] = plain(arrive(core, "r0", "r1"))
    first = core.on_results(0.1, [report(command, block_done=("r0",))])
    assert plain(first.decisions) == []
    assert [c.instance_id for c in plain(core.finish_results(0.1, first.pending))] == ["i0"]


def test_pipelining_holds_the_step_after_the_running_one_where_no_pass_could_change_the_batch():
    core = make_core(PIPELINED)
    out = arrive(core, "r0", "r1")
    [command], [nxt] = plain(out), held(out)
    assert nxt.after_step_id == command.step_id and nxt.step_id == command.step_id + 1 + command.repeats
    assert [(it.request_id, it.threshold, it.state_version) for it in nxt.items] == [
        (it.request_id, it.threshold, it.state_version + 1) for it in command.items]  # the version the step writes
    assert nxt.drop_finished  # nobody queues for a finished request's slot
    assert all(it.may_start_block for it in nxt.items)  # one instance: nowhere to move at a block start

    busy = make_core(PIPELINED)
    busy.view.instances["i0"].max_batch = 4
    busy.loop.view.table.max_batch[0] = 4
    out = arrive(busy, "a", "b", "c")
    assert held(out)  # room but no queue
    more = arrive(busy, "d", "e")  # d fills the instance (RUNNING, not in the step), e queues
    [nxt] = held(more)  # a pass could place nothing else there: d joins the held step, loaded from the store
    assert [(it.request_id, it.load_state) for it in nxt.items] == [
        ("a", False), ("b", False), ("c", False), ("d", True)]
    assert nxt.items[-1].state_version == 1  # its stored version: it did not step
    assert not nxt.drop_finished  # e waits for a finished request's slot


def test_a_short_answer_at_a_provisional_threshold_holds_no_step_after_its_first_until_its_pass():
    """The first step runs at load control's cap before any prediction (``unpredicted_at_max``). For a
    short answer (fewer tokens than overlap continues) the step after it is not sent ahead at that
    cap, which would be most of its block: the pass after the first step plans it with the first
    prediction, and from there on steps are held ahead as usual. A long answer goes on at once."""
    core = make_core(PIPELINED, policy_config={})  # DiLaServe's defaults
    out = arrive(core, "r0", "r1", slo_s=2.0, gen_len=16, block_len=8)
    [first], [wait] = plain(out), held(out)
    top = first.items[0].threshold
    assert wait.items == [] and wait.after_step_id == first.step_id  # wait for the pass, do not repeat
    assert all(core.loop.provisional(core.view.requests[r]) for r in ("r0", "r1"))
    early = core.on_results(0.1, [report(first)])
    assert plain(early.decisions) == []
    values = core.loop.policy.grid.values  # the top takes many steps, the lowest few
    steep = uniform_prediction({t: (0, 2 + int(400 * (t - min(values)))) for t in values})
    rest = core.finish_results(0.1, early.pending, {"r0": steep, "r1": steep})
    [second] = plain(rest)
    assert all(it.threshold < top for it in second.items)  # planned: the SLO is tight
    assert not any(core.loop.provisional(core.view.requests[r]) for r in ("r0", "r1"))
    [after] = held(rest)  # the third step goes ahead again, at the planned thresholds
    assert after.after_step_id == second.step_id and [it.threshold for it in after.items] == [
        it.threshold for it in second.items]

    hold_anyway = make_core(dataclasses.replace(PIPELINED, first_step_waits=False), policy_config={})
    out = arrive(hold_anyway, "a", slo_s=2.0, gen_len=16, block_len=8)  # DLS_SCHEDULER_FIRST_STEP_WAITS=false
    assert [len(c.items) for c in held(out)] == [1]
    long = make_core(PIPELINED, policy_config={})
    out = arrive(long, "a", slo_s=2.0)  # 256 tokens: one stale step among many
    assert [len(c.items) for c in held(out)] == [1]
    fixed = make_core(PIPELINED, policy="infaas")  # thresholds that no pass changes: held at once
    out = arrive(fixed, "a", gen_len=16, block_len=8)
    assert [len(c.items) for c in held(out)] == [1]


def test_a_request_placed_while_an_instance_runs_joins_its_held_step():
    """Not a round trip for every arrival: the held command is sent again with the new request."""
    core = make_core(PIPELINED)
    out = arrive(core, "a", "b")
    [step_a], [first_held] = plain(out), held(out)
    more = arrive(core, "c", now=0.05)
    assert plain(more) == []  # the instance is busy
    [nxt] = held(more)  # replaces the first one
    assert nxt.after_step_id == step_a.step_id and nxt.step_id > first_held.step_id
    assert [(it.request_id, it.load_state) for it in nxt.items] == [("a", False), ("b", False), ("c", True)]
    # the worker went on to it: c is in flight with the others, and mirrored as such
    first = core.on_results(0.1, [report(step_a, continued=nxt.step_id)])
    assert core._instances["i0"].in_flight_ids == ["a", "b", "c"] and core.busy("i0")
    assert core.view.requests["c"].status == RequestStatus.RUNNING
    [after] = held(first.decisions)  # the step after it goes at once, on the critical path
    assert after.after_step_id == nxt.step_id and not any(it.load_state for it in after.items)
    core.finish_results(0.1, first.pending)
    second = core.on_results(0.2, [report(nxt)])  # c's first step reported: READY, held by i0
    assert core.view.requests["c"].holder_id == "i0" and second.ignored == []



def test_a_command_says_how_many_requests_the_scheduler_had_queued_when_it_composed_it():
    """``StepCommand.num_queued`` (kept in the step records: the live side of a deep queue's batch)."""
    core = make_core(PIPELINED)
    [full] = plain(arrive(core, *(f"r{i}" for i in range(10))))  # the toy profile's max batch is 8
    assert (len(full.items), full.num_queued) == (8, 2)
    core2 = make_core(PIPELINED)
    out = arrive(core2, "a")
    assert [c.num_queued for c in out.commands] == [0, 0]  # the step and the one held after it

def test_a_pipelined_step_runs_at_the_threshold_replanned_after_the_step_before_last():
    core = make_core(PIPELINED)
    out = arrive(core, "r0", "r1", slo_s=60.0)
    [step_a], [step_b] = plain(out), held(out)
    top = step_a.items[0].threshold
    # step A ends at t=59: the worker goes straight on to B (at A's thresholds) and reports A
    first = core.on_results(59.0, [report(step_a, continued=step_b.step_id)])
    assert plain(first.decisions) == []  # nothing to send: i0 is busy with B
    assert core.busy("i0") and core.counters["pipelined_steps"] == 1
    assert {core.view.requests[r].threshold for r in ("r0", "r1")} == {top}  # the core mirrors B
    rest = core.finish_results(59.0, first.pending)
    [step_c] = held(rest)  # the step after B, replanned with A's results
    assert step_c.after_step_id == step_b.step_id
    assert all(it.threshold < top for it in step_c.items)
    assert [it.state_version for it in step_c.items] == [it.state_version + 2 for it in step_a.items]


def test_a_held_command_that_came_late_is_expected_where_the_rule_lets_it_run():
    """The worker had none in hand when its step ended (``awaits_held``): it runs the first held command
    for that step that passes the rule when it comes; the core judges the same and waits for it."""
    core = make_core(PIPELINED)
    out = arrive(core, "r0", "r1")
    [step_a], [step_b] = plain(out), held(out)
    first = core.on_results(0.1, [report(step_a, awaits_held=True)])
    assert core.busy("i0") and core._instances["i0"].busy_step_id == step_b.step_id
    assert core.counters["late_held_steps"] == 1 and core.counters["pipelined_steps"] == 0
    assert {core.view.requests[r].status for r in ("r0", "r1")} == {RequestStatus.RUNNING}
    [step_c] = held(first.decisions)  # and the step after it, on the critical path
    assert step_c.after_step_id == step_b.step_id
    assert plain(core.finish_results(0.1, first.pending)) == []

    # a request of the step failed: no held command passes, the instance waits for the pass
    core = make_core(PIPELINED)
    out = arrive(core, "r0", "r1")
    [step_a] = plain(out)
    first = core.on_results(0.1, [report(step_a, failed=("r1",), awaits_held=True)])
    assert core.counters["late_held_steps"] == 0 and held(first.decisions) == []


def test_requests_that_left_an_instance_go_with_its_held_command_until_one_runs():
    """An instance that goes from one held step to the next never gets a plain command: what left it
    (migrated, preempted, cancelled) is dropped by the held command that runs, and kept for the next
    command while none has run."""
    core = make_core(PIPELINED)
    out = arrive(core, "a", "b")
    [step_a], [step_b] = plain(out), held(out)
    core._instances["i0"].drop_ids.append("gone")  # a request that left i0 while its step ran
    first = core.on_results(0.1, [report(step_a, continued=step_b.step_id)])
    [step_c] = held(first.decisions)
    assert step_c.drop_request_ids == ["gone"]
    core.finish_results(0.1, first.pending)
    assert core._instances["i0"].drop_ids == ["gone"]  # not known to have run yet
    second = core.on_results(0.2, [report(step_b)])  # the worker did not go on to it
    [step_d] = plain(second.decisions) + plain(core.finish_results(0.2, second.pending))
    assert step_d.drop_request_ids == ["gone"] and core._instances["i0"].drop_ids == []

    core = make_core(PIPELINED)
    out = arrive(core, "a", "b")
    [step_a], [step_b] = plain(out), held(out)
    core._instances["i0"].drop_ids.append("gone")
    first = core.on_results(0.1, [report(step_a, continued=step_b.step_id)])
    [step_c] = held(first.decisions)
    core.finish_results(0.1, first.pending)
    second = core.on_results(0.2, [report(step_b, continued=step_c.step_id)])  # it ran: dropped
    assert core._instances["i0"].drop_ids == []
    assert all(c.drop_request_ids == [] for c in second.decisions.commands)


def test_results_handled_before_their_pass_ran_owe_one_pass():
    core = make_core(PIPELINED, num_instances=2)
    out = arrive(core, "a", "b", "c", "d")
    commands = plain(out)
    assert len(commands) == 2
    passes = [core.on_results(0.1, [report(c, block_done=[it.request_id for it in c.items])]) for c in commands]
    owed = passes[0].pending
    owed.merge(passes[1].pending)
    assert owed.instance_ids == ["i0", "i1"]
    nxt = plain(core.finish_results(0.1, owed))
    assert sorted(c.instance_id for c in nxt) == ["i0", "i1"]  # both freed by the one pass


def test_a_continued_step_leaves_out_the_requests_that_finished():
    core = make_core(PIPELINED)
    out = arrive(core, "r0", "r1", "r2")
    [step_a], [step_b] = plain(out), held(out)
    first = core.on_results(0.1, [report(step_a, finished=("r1",), continued=step_b.step_id)])
    assert "r1" not in core.view.requests
    assert core._instances["i0"].in_flight_ids == ["r0", "r2"]
    assert {r: core.view.requests[r].status for r in ("r0", "r2")} == {"r0": RequestStatus.RUNNING,
                                                                       "r2": RequestStatus.RUNNING}
    assert first.pending.stepped_ids == ["r0", "r2"]


def test_a_continued_step_this_scheduler_never_sent_is_mirrored_from_the_step_and_noted():
    core = make_core(PIPELINED)
    [step_a] = plain(arrive(core, "r0"))
    first = core.on_results(0.1, [report(step_a, continued=999)])
    assert first.notes and core._instances["i0"].busy_step_id == 999
    assert core.view.requests["r0"].status == RequestStatus.RUNNING


def test_predictions_reach_the_pass_and_queries_describe_the_request_between_steps():
    core = make_core(NO_OVERLAP)
    [command] = plain(arrive(core, "r0", gen_len=64, block_len=32))
    first = core.on_results(0.1, [report(command, num=3, predicted_end=40)])
    [query] = core.queries(first.pending.stepped_ids)
    assert (query.num_steps_done, query.num_committed, query.block_index, query.block_committed, query.block_size) \
        == (1, 3, 0, 3, 32)
    assert query.confidence == (0.5, 0.6, 0.7, 0.7, 0.8) and query.uses_cache and query.prompt_length == 256
    assert query.predicted_end == 40  # where the engine expects the EOS, as its last full forward said
    from services.scheduler.core import Prediction

    prediction = Prediction({t: (0, 1) for t in core.loop.policy.grid.values}, made_at_step=1)
    core.finish_results(0.1, first.pending, {"r0": prediction})
    assert core.view.requests["r0"].prediction is prediction


def test_requests_placed_while_an_instance_ran_go_with_its_returning_ones_in_one_batch():
    """Not two half batches taking turns: the instance waits for the pass that places its returning requests."""
    core = make_core(OVERLAP_ONLY)
    [command] = plain(arrive(core, "a", "b"))
    arrive(core, "c", now=0.05)  # placed on the busy instance: it waits
    first = core.on_results(0.1, [report(command)])
    assert first.decisions.commands == []  # c alone would go now, and a, b a step later
    [nxt] = plain(core.finish_results(0.1, first.pending))
    assert sorted(it.request_id for it in nxt.items) == ["a", "b", "c"]


def test_the_service_holds_wiring_only():
    """The scheduler service decides no step: batch composition, overlap, pipelining and catch-up are here."""
    from pathlib import Path

    service = (Path(__file__).resolve().parents[3] / "services/scheduler/service.py").read_text()
    for step_logic in ("resident_ids", "continue_steps", "replan(", "would_stay", "RequestStatus.RUNNING",
                       "RequestStatus.READY", "requeue_request", "apply_step_result", "policy.schedule"):
        assert step_logic not in service, step_logic
    assert "StepScheduler(" in service


# --- repeats: a worker that steps faster than the scheduler answers ------------------------------


def _repeat(command, results):
    """The step a worker runs when ``command`` ends with no held command in hand."""
    from shared.pipelining import repeat_step
    return repeat_step(command, results.outcomes)


def test_a_repeated_step_is_mirrored_and_the_command_sent_for_an_earlier_step_of_the_chain_runs_after_it():
    core = make_core(PIPELINED)
    out = arrive(core, "r0", "r1", "r2")
    [step_a], [step_b] = plain(out), held(out)
    assert step_a.repeats == step_b.repeats == PIPELINED.held_repeats > 0
    first = core.on_results(0.1, [report(step_a, continued=step_b.step_id)])
    [step_c] = held(first.decisions)  # sent after B; the worker will not have it in hand in time
    core.finish_results(0.1, first.pending)
    # B ends with nothing in hand: the worker runs B again (r1 finished in B), as the reserved next id
    results_b = report(step_b, finished=("r1",))
    again = _repeat(step_b, results_b)
    assert again.step_id == step_b.step_id + 1 and [it.request_id for it in again.items] == ["r0", "r2"]
    second = core.on_results(0.2, [dataclasses.replace(results_b, continued_step_id=again.step_id)])
    st = core._instances["i0"]
    assert st.busy_step_id == again.step_id and st.in_flight_ids == ["r0", "r2"]
    assert core.counters["repeated_steps"] == 1 and st.repeats_left == step_b.repeats - 1
    assert {core.view.requests[r].threshold for r in ("r0", "r2")} == {step_b.items[0].threshold}
    assert step_c.step_id in st.next_sent  # it still applies: to the chain's latest step
    core.finish_results(0.2, second.pending)
    # C came while the repeat ran: the worker goes on to it (less r1), and a new chain starts there
    third = core.on_results(0.3, [report(again, continued=step_c.step_id)])
    assert st.busy_step_id == step_c.step_id and st.in_flight_ids == ["r0", "r2"]
    assert st.repeats_left == step_c.repeats and core.counters["pipelined_steps"] == 2
    assert not third.ignored


def test_a_late_command_for_an_earlier_step_of_the_chain_is_judged_rebased_onto_its_latest():
    core = make_core(PIPELINED)
    out = arrive(core, "r0", "r1")
    [step_a], [step_b] = plain(out), held(out)
    first = core.on_results(0.1, [report(step_a, continued=step_b.step_id)])
    [step_c] = held(first.decisions)
    core.finish_results(0.1, first.pending)
    results_b = report(step_b)
    again = _repeat(step_b, results_b)
    second = core.on_results(0.2, [dataclasses.replace(results_b, continued_step_id=again.step_id)])
    core.finish_results(0.2, second.pending)
    # the repeat ends with nothing in hand (awaits_held): C, sent after B, runs when it comes
    core.on_results(0.3, [report(again, awaits_held=True)])
    st = core._instances["i0"]
    assert st.busy_step_id == step_c.step_id and core.counters["late_held_steps"] == 1


def test_where_no_held_command_may_go_out_a_step_that_could_repeat_is_told_to_wait():
    """An instance drained while its worker repeats: no held command passes the checks, so a held
    command of no items goes out in its place; the worker waits for the pass instead of repeating."""
    core = make_core(PIPELINED, num_instances=2)
    out = arrive(core, "r0", "r1")
    [step_a] = [c for c in plain(out) if len(c.items) == 2] or plain(out)[:1]
    [step_b] = [c for c in held(out) if c.instance_id == step_a.instance_id]
    first = core.on_results(0.1, [report(step_a, continued=step_b.step_id)])
    core.finish_results(0.1, first.pending)
    core.drain_instance(0.15, step_a.instance_id)
    results_b = report(step_b)
    again = _repeat(step_b, results_b)
    second = core.on_results(0.2, [dataclasses.replace(results_b, continued_step_id=again.step_id)])
    stops = [c for c in held(second.decisions) if c.instance_id == step_a.instance_id]
    assert [(c.after_step_id, c.items, c.repeats) for c in stops] == [(again.step_id, [], 0)]
    assert _repeat(again, report(again)) is not None  # the worker would repeat again, but holds the stop:
    from shared.pipelining import next_step
    assert next_step(again, stops[0], report(again).outcomes) is None


# --- the recompute budget ------------------------------------------------------------------------


def test_block_starts_over_the_recompute_budget_wait_for_the_next_steps_in_order_of_deadline():
    """A block start is a compute-bound full forward: a step carries them up to the budget's context
    tokens (two requests of 512 here), earliest deadline first, those that can no longer make theirs
    last; the rest go with the next step, beside the cache steps of those that went first."""
    core = make_core(StepConfig(overlap_min_tokens=0, pipelining=False, recompute_tokens=1024))
    out = core.on_arrivals(0.0, [make_request(rid, 0.0, state_version=1, slo_s=slo)
                                 for rid, slo in (("a", 40.0), ("b", 10.0), ("late", 0.05), ("c", 30.0))])
    [first] = plain(out)
    assert [it.request_id for it in first.items] == ["b", "c"]  # the two earliest that can still make it
    assert core.counters["recomputes_deferred"] == 2
    assert core.view.requests["late"].status == RequestStatus.RUNNING  # placed, served in turn
    _, rest = step(core, 0.1, first)
    [second] = plain(rest)  # a and late start their blocks, b and c step on (cache steps)
    assert sorted(it.request_id for it in second.items) == ["a", "b", "c", "late"]

    uncapped = make_core(StepConfig(overlap_min_tokens=0, pipelining=False, recompute_tokens=0))
    [every] = plain(arrive(uncapped, "a", "b", "c", "d"))
    assert len(every.items) == 4 and uncapped.counters["recomputes_deferred"] == 0
    derived = make_core(NO_OVERLAP)  # the toy profile's recomputes never saturate within its batch of 8
    assert derived.recompute_budget("i0") == 8 * 512


def test_late_requests_yield_their_places_to_those_that_can_still_make_their_deadlines():
    """DiLaServe leaves out of a step the requests that can no longer make their deadlines, but for
    the one with the earliest deadline (``late_per_step``: none starves); where every request is late
    they all go, and a baseline policy steps them like any other."""
    slos = (("a", 40.0), ("late1", 0.02), ("b", 30.0), ("late2", 0.01), ("late3", 0.03))
    core = make_core(StepConfig(overlap_min_tokens=0, pipelining=False, recompute_tokens=0))
    out = core.on_arrivals(0.0, [make_request(rid, 0.0, state_version=1, slo_s=slo) for rid, slo in slos])
    [first] = plain(out)
    assert sorted(it.request_id for it in first.items) == ["a", "b", "late2"]
    assert core.counters["late_yields"] == 2
    assert core.view.requests["late1"].status == RequestStatus.RUNNING  # placed, waiting for its turn
    _, rest = step(core, 0.1, first, finished=("a", "b"))
    [second] = plain(rest)  # no one left who can make it: the late ones all go
    assert sorted(it.request_id for it in second.items) == ["late1", "late2", "late3"]

    every = make_core(StepConfig(overlap_min_tokens=0, pipelining=False, recompute_tokens=0),
                      policy_config={**MECHANICS, "late_per_step": None})
    [first] = plain(every.on_arrivals(0.0, [make_request(rid, 0.0, state_version=1, slo_s=slo) for rid, slo in slos]))
    assert len(first.items) == 5 and every.counters["late_yields"] == 0
    baseline = make_core(StepConfig(overlap_min_tokens=0, pipelining=False, recompute_tokens=0), policy="infaas")
    [first] = plain(baseline.on_arrivals(0.0, [make_request(rid, 0.0, state_version=1, slo_s=slo)
                                                for rid, slo in slos]))
    assert len(first.items) == 5


def test_late_requests_do_not_yield_to_background_work():
    """A shadow decode (background priority, an hour's SLO) on the instance is not a request that can
    still make its deadline: with it and late client requests alone, the late ones all go."""
    slos = (("late1", 0.02), ("late2", 0.01), ("late3", 0.03))
    core = make_core(StepConfig(overlap_min_tokens=0, pipelining=False, recompute_tokens=0))
    shadow = make_request("shadow", 0.0, state_version=1, slo_s=3600.0, priority=BACKGROUND_PRIORITY)
    out = core.on_arrivals(0.0, [shadow, *(make_request(rid, 0.0, state_version=1, slo_s=slo) for rid, slo in slos)])
    [first] = plain(out)
    assert sorted(it.request_id for it in first.items) == ["late1", "late2", "late3", "shadow"]
    assert core.counters["late_yields"] == 0


def test_a_request_overdue_by_more_than_its_slos_yields_no_more():
    """Yielding is bounded (``late_yield_slos``): a late request overdue by more than that many of its
    own SLOs steps beside the on-time ones, so a sustained overload, where new arrivals are always on
    time for a while, does not hold the late ones to one per step until their clients give up."""
    slos = (("a", 40.0), ("late1", 0.02), ("b", 30.0), ("late2", 0.01), ("late3", 0.03))
    config = StepConfig(overlap_min_tokens=0, pipelining=False, recompute_tokens=0)

    def first_step(now: float, cap: float):
        core = make_core(config, policy_config={**MECHANICS, "late_yield_slos": cap})
        [first] = plain(core.on_arrivals(now, [make_request(rid, 0.0, state_version=1, slo_s=slo) for rid, slo in slos]))
        return sorted(it.request_id for it in first.items)

    assert first_step(0.05, 3.0) == ["a", "b", "late1", "late2"]  # late2 overdue by 4 of its SLOs, late3 by 0.7
    assert first_step(0.5, 3.0) == ["a", "b", "late1", "late2", "late3"]  # all long overdue
    assert first_step(0.5, 1000.0) == ["a", "b", "late2"]  # unbounded: one late per step


def test_a_held_command_leaves_out_the_requests_that_yield():
    """A late request placed while a step runs does not join the held step (it yields there as in the
    pass's), and the held command still goes out for those that can make their deadlines."""
    core = make_core(StepConfig(overlap_min_tokens=32, pipelining=True, recompute_tokens=0))
    out = core.on_arrivals(0.0, [make_request(rid, 0.0, state_version=1, slo_s=40.0) for rid in ("a", "b")])
    [first] = plain(out)
    late = held(core.on_arrivals(0.01, [make_request("late", 0.01, state_version=1, slo_s=0.005),
                                        make_request("later", 0.01, state_version=1, slo_s=0.001)]))
    assert late, "a held command still goes out"
    assert [it.request_id for it in late[-1].items] == ["a", "b", "later"]  # one late joins: the earliest deadline
    assert late[-1].after_step_id == first.step_id


def test_a_held_command_carries_the_recompute_room_its_worker_judges_block_starts_by():
    """Requests joining the held step start their blocks there and take the budget first; what is left
    (``recompute_tokens``) bounds the block starts of the running step's requests, which only the
    worker knows when its step ends (``shared.pipelining``: one always goes); joiners over the budget
    leave the step to a later pass."""
    core = make_core(StepConfig(overlap_min_tokens=32, pipelining=True, recompute_tokens=1024))

    def join(rid: str, slo: float):
        return held(core.on_arrivals(0.01, [make_request(rid, 0.01, state_version=1, slo_s=slo)]))

    out = core.on_arrivals(0.0, [make_request("x", 0.0, state_version=1, slo_s=20.0)])
    [nxt] = held(out)
    assert nxt.recompute_tokens == 1024 and [it.context_tokens for it in nxt.items] == [512]
    [nxt] = join("y", 50.0)  # y's block start takes 512 of it
    assert nxt.recompute_tokens == 512 and [it.request_id for it in nxt.items] == ["x", "y"]
    [nxt] = join("z", 30.0)  # y and z take it all: x may still start a block alone (one always may)
    assert nxt.recompute_tokens == 1 and [it.request_id for it in nxt.items] == ["x", "y", "z"]
    assert join("w", 40.0) == []  # three block starts are over it: the held step sent stands, w waits for a pass
    uncapped = make_core(StepConfig(overlap_min_tokens=32, pipelining=True, recompute_tokens=0))
    [nxt] = held(arrive(uncapped, "a"))
    assert nxt.recompute_tokens == 0
