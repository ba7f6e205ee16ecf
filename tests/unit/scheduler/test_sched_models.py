"""Several models in one cluster, in the scheduling core: a request runs only on instances of its model.

A small harness plays the workers: it runs every step command the core emits (committing half a block
per step, so every other step starts a block and may migrate) and checks each command, each migration
and each preemption against the models the test gave the instances and the requests (its own record,
not the core's). The scenarios put requests of models A and B through migration (an instance of A
started: A's requests move to it, never to B's idle instances), preemption (memory freed only on an
instance of the head's model, by requests of that model), and reconfigurations that move instances
between the models (an instance of B drained and one of A started; an instance that leaves and joins
under the same id serving the other model). Every policy that places requests is driven the same way.
"""

from __future__ import annotations

import pytest

from services.scheduler.core import (
    BatchOutcome,
    PreemptionConfig,
    Preemptor,
    RejectReason,
    RequestStatus,
    SchedulingLoop,
    StepConfig,
    StepDecisions,
    StepOutcome,
    StepScheduler,
    StoredProgress,
    make_policy,
)
from services.scheduler.core.view import ClusterView
from tests.unit.scheduler.sched_builders import make_request, toy_profile

NO_OVERLAP = StepConfig(overlap_min_tokens=0, pipelining=False)
OVERLAP = StepConfig(overlap_min_tokens=4, pipelining=False)
PIPELINED = StepConfig(overlap_min_tokens=4, pipelining=True)
GEN, BLOCK, PER_STEP = 32, 8, 4  # half a block per step: every other step starts a block
CONTEXT = 64 + GEN  # prompt 64 + canvas


class ModelCluster:
    """The core under test, the workers it commands, and the test's own record of every model."""

    def __init__(self, config: StepConfig = NO_OVERLAP, policy: str = "dilaserve",
                 preemption: PreemptionConfig | None = None) -> None:
        loop = SchedulingLoop(make_policy(policy, rng=0), ClusterView(), Preemptor(preemption))
        self.core = StepScheduler(loop, config, first_step_id=100)
        self.view = self.core.view
        self.now = 0.0
        self.instance_model: dict[str, str] = {}  # instance id -> the model the test started it with
        self.request_model: dict[str, str] = {}  # request id -> the model the test gave it
        self.in_flight: dict[str, object] = {}  # instance id -> the command its worker runs
        self.ran: list[tuple[str, str, str]] = []  # (request id, instance id, its model then) of every step item
        self.migrations: list[tuple[str, str]] = []  # (request id, to instance id)
        self.preemptions = []

    # the test's events

    def start(self, instance_id: str, model: str, tp: int = 1, mem_tokens: int | None = None) -> None:
        self.instance_model[instance_id] = model
        self.carry(self.core.add_instance(self.now, instance_id, tp, toy_profile(), model=model,
                                          mem_limit_tokens=mem_tokens))

    def arrive(self, rid: str, model: str, **kwargs) -> StepDecisions:
        self.request_model[rid] = model
        fields = {"prompt_len": 64, "gen_len": GEN, "block_len": BLOCK, "state_version": 1, **kwargs}
        request = make_request(rid, self.now, model=model, **fields)
        return self.carry(self.core.on_arrivals(self.now, [request]))

    def drain(self, instance_id: str) -> None:
        self.carry(self.core.drain_instance(self.now, instance_id))

    def fail(self, instance_id: str) -> None:
        """Its lease expired: its step is lost; the requests whose step ran there are reloaded."""
        self.in_flight.pop(instance_id, None)
        self.carry(self.core.fail_instance(self.now, instance_id))

    def round(self) -> None:
        """Every instance's step ends, in id order; time moves on."""
        self.now += 0.1
        for iid in sorted(self.in_flight):
            command = self.in_flight.pop(iid, None)
            if command is not None:
                self._finish(command)

    def run_until_idle(self, max_rounds: int = 200) -> None:
        for _ in range(max_rounds):
            if not self.in_flight:
                return
            self.round()
        raise AssertionError("the cluster never went idle")

    # the checks, on everything the core emits

    def carry(self, decisions: StepDecisions) -> StepDecisions:
        for command in decisions.commands:
            for item in command.items:
                assert self.request_model[item.request_id] == self.instance_model[command.instance_id], (
                    f"{item.request_id} ({self.request_model[item.request_id]}) sent to {command.instance_id} "
                    f"({self.instance_model[command.instance_id]})")
                self.ran.append((item.request_id, command.instance_id, self.instance_model[command.instance_id]))
            if command.items and not command.after_step_id:
                self.in_flight[command.instance_id] = command
        for migration in decisions.migrations:
            assert self.request_model[migration.request_id] == self.instance_model[migration.instance_id]
            assert self.instance_model[migration.from_instance_id] == self.instance_model[migration.instance_id]
            self.migrations.append((migration.request_id, migration.instance_id))
        for preemption in decisions.preemptions:
            assert self.request_model[preemption.request_id] == self.request_model[preemption.for_request_id]
            assert self.instance_model[preemption.instance_id] == self.request_model[preemption.for_request_id]
            self.preemptions.append(preemption)
        for rid in decisions.reload_ids:  # the store's copy: the counters as the core last saw them
            r = self.view.requests.get(rid)
            stored = None if r is None else StoredProgress(r.state_version, r.num_steps_done,
                                                           r.num_tokens_committed, r.current_block)
            self.carry(self.core.reloaded(self.now, rid, stored))
        self._check_residents()
        return decisions

    def _check_residents(self) -> None:
        for iid, inst in self.view.instances.items():
            for rid in inst.resident_ids:
                assert self.request_model[rid] == self.instance_model[iid], f"{rid} resident on {iid}"

    def _finish(self, command) -> None:
        outcomes = []
        for item in command.items:
            r = self.view.requests[item.request_id]
            committed = min(PER_STEP, r.num_remaining_tokens)
            block_done = r.num_block_tokens + committed >= BLOCK
            outcomes.append(StepOutcome(item.request_id, committed, block_done,
                                        r.num_tokens_committed + committed >= GEN, r.next_step_is_recompute,
                                        state_version=item.state_version + 1))
        first = self.core.on_results(self.now, [BatchOutcome(command.instance_id, tuple(outcomes), 0.05,
                                                             step_id=command.step_id)])
        self.carry(first.decisions)
        self.carry(self.core.finish_results(self.now, first.pending))

    def models_ran_on(self, prefix: str) -> set[str]:
        return {model for rid, _, model in self.ran if rid.startswith(prefix)}


@pytest.mark.parametrize("config", [NO_OVERLAP, OVERLAP, PIPELINED], ids=["plain", "overlap", "pipelined"])
def test_requests_run_only_on_their_models_instances_through_migration_and_reconfiguration(config):
    cluster = ModelCluster(config)
    cluster.start("a0", "A")
    cluster.start("a1", "A")
    cluster.start("b0", "B", tp=4)  # the fastest instance, idle: A's requests must not go there
    for k in range(6):
        cluster.arrive(f"A{k}", "A")
    for k in range(2):
        cluster.arrive(f"B{k}", "B")
    cluster.round()
    cluster.round()
    # an instance of A starts (TP 4: faster): A's requests move to it at their block starts
    cluster.start("a2", "A", tp=4)
    for _ in range(3):
        cluster.round()
    assert any(iid == "a2" for _, iid in cluster.migrations)
    # a reconfiguration moves GPUs from B to A: b0 drains (its requests keep running there: no other B)
    # and b1 starts; A gains an instance through a leave and join under the same id
    for k in range(2, 4):
        cluster.arrive(f"B{k}", "B")
    cluster.drain("b0")
    cluster.round()
    cluster.start("b1", "B", tp=2)
    cluster.round()
    cluster.fail("a1")  # a1 leaves; its A requests resume on A's instances only
    cluster.start("a1", "B")  # and joins again, serving B
    for k in range(6, 10):
        cluster.arrive(f"A{k}", "A")
    for k in range(4, 8):
        cluster.arrive(f"B{k}", "B")
    cluster.run_until_idle()
    assert not cluster.view.requests and cluster.view.num_queued == 0  # every request finished
    assert cluster.models_ran_on("A") == {"A"} and cluster.models_ran_on("B") == {"B"}
    assert {iid for rid, iid, _ in cluster.ran if rid.startswith("B")} >= {"b0", "b1", "a1"}
    assert {iid for rid, iid, _ in cluster.ran if rid.startswith("A")} >= {"a0", "a1", "a2"}
    assert "b0" not in cluster.view.instances  # drained and removed
    assert cluster.migrations  # the scenario did move requests


@pytest.mark.parametrize("policy", ["fixed", "infaas", "llumnix", "infaas++"])
def test_every_placing_policy_keeps_requests_on_their_models_instances(policy):
    cluster = ModelCluster(policy=policy)
    cluster.start("a0", "A")
    cluster.start("b0", "B", tp=4)
    cluster.start("b1", "B")
    for k in range(10):
        cluster.arrive(f"A{k}", "A")
        cluster.arrive(f"B{k}", "B")
    cluster.round()
    cluster.drain("b1")
    cluster.start("a1", "A", tp=2)
    cluster.run_until_idle()
    assert not cluster.view.requests
    assert cluster.models_ran_on("A") == {"A"} and cluster.models_ran_on("B") == {"B"}


def test_preemption_frees_memory_only_on_an_instance_of_the_heads_model():
    cluster = ModelCluster()
    cluster.start("a0", "A", mem_tokens=2 * CONTEXT)  # room for two A requests
    cluster.start("b0", "B", mem_tokens=8 * CONTEXT)  # room to spare, for B only
    cluster.arrive("A-low1", "A")
    cluster.arrive("A-low2", "A")
    cluster.arrive("B-low", "B")
    cluster.arrive("A-high", "A", priority=5)
    assert cluster.view.requests["A-high"].status == RequestStatus.QUEUED  # b0's memory is not A's
    cluster.round()  # between steps: an A request on a0 yields to it
    assert [(p.for_request_id, p.instance_id) for p in cluster.preemptions] == [("A-high", "a0")]
    assert cluster.preemptions[0].request_id in {"A-low1", "A-low2"}
    assert cluster.view.requests["A-high"].instance_id == "a0"
    assert cluster.view.requests["B-low"].num_preemptions == 0
    cluster.run_until_idle()
    assert not cluster.view.requests
    assert cluster.models_ran_on("A") == {"A"} and cluster.models_ran_on("B") == {"B"}


def test_a_request_whose_model_has_no_instance_waits_and_one_too_large_for_its_model_is_rejected():
    cluster = ModelCluster()
    cluster.start("a0", "A", mem_tokens=2 * CONTEXT)
    cluster.start("b0", "B", mem_tokens=64 * CONTEXT)
    out = cluster.arrive("C0", "C")  # no instance of C: it waits (one may yet join), as with no instance at all
    assert not out.rejections and cluster.view.requests["C0"].status == RequestStatus.QUEUED
    out = cluster.arrive("A-huge", "A", prompt_len=4 * CONTEXT)  # b0 could hold it; no A instance ever could
    assert [(r.request_id, r.reason) for r in out.rejections] == [("A-huge", RejectReason.NO_INSTANCE)]
    assert f"holds {2 * CONTEXT}" in out.rejections[0].detail
    cluster.run_until_idle()
    assert cluster.view.requests["C0"].status == RequestStatus.QUEUED
    cluster.start("c0", "C")
    assert cluster.view.requests["C0"].instance_id == "c0"
    cluster.run_until_idle()
    assert not cluster.view.requests


def test_the_view_refuses_an_assignment_to_another_models_instance():
    from services.scheduler.core import Decisions, StepAssignment

    view = ClusterView()
    view.add_instance("b0", 1, toy_profile(), model="B")
    view.add_request(make_request("A0", model="A"))
    with pytest.raises(ValueError, match="model 'A' assigned to instance b0 of model 'B'"):
        view.apply(0.0, Decisions(assignments=[StepAssignment("A0", "b0", 0.9)]))


def test_one_model_everywhere_masks_nothing():
    view = ClusterView()
    view.add_instance("i0", 1, toy_profile(), model="m")
    view.add_instance("i1", 1, toy_profile(), model="m")
    assert view.table.serving_rows("m") is None and view.table.serving_rows("") is None
    view.add_instance("i2", 1, toy_profile(), model="n")
    assert view.table.serving_rows("m").tolist() == [True, True, False]
    assert view.table.serving_rows("") is None  # a request that names no model runs anywhere


def test_the_service_gives_the_core_each_heartbeats_model_and_each_records_model():
    import asyncio
    from types import SimpleNamespace

    from services.scheduler.service import SchedulerService
    from shared.messages import codec
    from shared.messages.control import WorkerHeartbeat
    from shared.settings import SchedulerSettings
    from shared.state import InMemoryStateStore, RequestRecord
    from tests.unit.scheduler.sched_builders import REPO

    profile = str(REPO / "models" / "dls-tiny" / "calibration" / "profile.json")
    service = SchedulerService(SchedulerSettings(), nc=None, js=None, store=InMemoryStateStore(),
                               clock=lambda: 100.0, policy=make_policy("fixed", {}))

    def beat(instance_id: str, model: str, seq: int) -> None:
        hb = WorkerHeartbeat(instance_id=instance_id, node="local", tp=1, max_batch=4, model=model, ttl_s=6.0,
                             sent_at=float(seq), seq=seq, started_at=1.0, profile=profile)
        asyncio.run(service._on_heartbeat(SimpleNamespace(data=codec.encode(hb))))

    beat("w0", "A", 1)
    beat("w1", "B", 1)
    assert {iid: inst.model for iid, inst in service.view.instances.items()} == {"w0": "A", "w1": "B"}
    first_row = service.view.instances["w0"].row
    beat("w0", "B", 2)  # the same id, now serving B: it left and joined again
    assert service.view.instances["w0"].model == "B" and service.view.instances["w0"].row != first_row
    record = RequestRecord(request_id="r", prompt_token_ids=[1, 2], canvas=[0] * 8, mask_token_id=0, gen_length=8,
                           block_length=8, arrival_time=99.0, deadline=160.0, slo_ms=60_000.0, model="A")
    assert service._track(record).model == "A"
