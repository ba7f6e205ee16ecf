"""The reconfigurator service against a real nats-server: workload stats and heartbeats in (the test stands
in for the scheduler and for the workers), plans out on ``plans``, acks complete them; the operator path
(``reconfig.apply`` and ``dls reconfig apply``) and the periodic one."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import pytest

from services.reconfigurator.cli import apply_configuration
from services.reconfigurator.service import ReconfiguratorService, parse_cluster_spec
from shared.cli import CliError
from shared.messages import decode, encode
from shared.messages.control import (
    ApplyConfiguration,
    ApplyConfigurationReply,
    Arrival,
    PlanAck,
    PlanAckStatus,
    ReconfigPlan,
    WorkerHeartbeat,
    WorkerStatus,
    WorkloadStats,
)
from shared.profiles import LatencyProfile
from shared.settings import ReconfiguratorSettings
from shared.subjects import Subjects

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "profiles" / "llada-8b-h100.json"
WAIT_S = 60.0  # generous upper bound on the shared CPU; conditions are polled, not timed


def settings(nats_url: str, prefix: str, **overrides) -> ReconfiguratorSettings:
    values = dict(nats_url=nats_url, subject_prefix=prefix, profile=str(PROFILE), cluster='{"nodes": {"n1": 4}}',
                  interval_s=3600.0, solver_time_limit_s=10.0)
    return ReconfiguratorSettings(**{**values, **overrides})


def heartbeat(instance_id: str, tp: int, gpu_ids: list[int], status=WorkerStatus.READY) -> bytes:
    """What a worker on node n1 would publish (the test stands in for it)."""
    now = time.time()
    return encode(WorkerHeartbeat(instance_id=instance_id, node="n1", tp=tp, gpu_ids=gpu_ids, max_batch=16,
                                  model="fake", status=status, ttl_s=600.0, sent_at=now, started_at=now))


def stats(num_arrivals: int) -> bytes:
    """What the scheduler would publish: a window of arrivals."""
    now = time.time()
    arrivals = [Arrival(time_s=now - 0.01 * i, prompt_tokens=120, output_tokens=64) for i in range(num_arrivals)]
    return encode(WorkloadStats(window_start=now - 1.0, window_end=now, arrivals=arrivals, num_finished=3))


def ack(plan_id: str, status=PlanAckStatus.APPLIED) -> bytes:
    return encode(PlanAck(plan_id=plan_id, node="n1", status=status, acked_at=time.time()))


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def plans_subscription(nc, subjects: Subjects) -> asyncio.Queue:
    queue: asyncio.Queue = asyncio.Queue()

    async def on_plan(msg) -> None:
        queue.put_nowait(decode(ReconfigPlan, msg.data))

    await nc.subscribe(subjects.plans, cb=on_plan)
    return queue


def slots(node_plan, kind: str) -> list[tuple[int, list[int]]]:
    return [(s.tp, s.gpu_ids) for s in getattr(node_plan, kind)]


def test_operator_plans_follow_the_running_configuration_and_wait_for_acks(nats_server, unique_prefix, capsys):
    async def main():
        config = settings(nats_server.url, unique_prefix)
        nc = await nats.connect(nats_server.url)
        subjects = Subjects(unique_prefix)
        service = ReconfiguratorService(config, nc, LatencyProfile.load(PROFILE))
        await service.start(periodic=False)
        plans = await plans_subscription(nc, subjects)

        await nc.publish(subjects.heartbeat, heartbeat("n1-tp1-g0-a", 1, [0]))
        await nc.publish(subjects.heartbeat, heartbeat("n1-tp1-g1-b", 1, [1]))
        await nc.publish(subjects.heartbeat, heartbeat("n1-tp1-g2-c", 1, [2], WorkerStatus.DRAINING))
        await nc.publish(subjects.stats, stats(5))
        await nc.publish(subjects.stats, b"not msgpack")
        await until(lambda: len(service.leases) == 3 and service.num_arrivals == 5, "heartbeats and stats")
        assert service.num_malformed == 1
        assert [(i.tp, i.gpu_ids) for i in service.cluster().placement] == [(1, (0,)), (1, (1,))]  # not draining

        async def apply(instances_by_tp) -> ApplyConfigurationReply:
            msg = await nc.request(subjects.reconfig_apply, encode(ApplyConfiguration(instances_by_tp=instances_by_tp)),
                                   timeout=WAIT_S)
            return decode(ApplyConfigurationReply, msg.data)

        reply = await apply({1: 2, 2: 1})
        assert reply.error is None and reply.plan_id
        plan = await asyncio.wait_for(plans.get(), WAIT_S)
        assert plan.plan_id == reply.plan_id and plan.instances_by_tp == {1: 2, 2: 1}
        [node] = plan.nodes
        assert node.node == "n1" and slots(node, "keep") == [(1, [0]), (1, [1])]
        assert slots(node, "stop") == [] and slots(node, "start") == [(2, [2, 3])]

        busy = await apply({1: 4})
        assert busy.error and reply.plan_id in busy.error and "acknowledgement" in busy.error

        await nc.publish(subjects.plans_ack, ack(reply.plan_id))
        await nc.publish(subjects.heartbeat, heartbeat("n1-tp1-g2-c", 1, [2], WorkerStatus.STOPPING))
        await nc.publish(subjects.heartbeat, heartbeat("n1-tp2-g2-d", 2, [2, 3]))
        await until(lambda: service.num_plans_completed == 1 and "n1-tp2-g2-d" in service.leases, "the ack")
        assert not service.awaited

        # The CLI path, with the test acking as node n1's agent would.
        async def on_plan_ack_it(msg) -> None:
            await nc.publish(subjects.plans_ack, ack(decode(ReconfigPlan, msg.data).plan_id))

        await nc.subscribe(subjects.plans, cb=on_plan_ack_it)
        capsys.readouterr()
        assert await apply_configuration(config, {2: 2}, timeout_s=WAIT_S, wait_s=WAIT_S) == 0
        printed = capsys.readouterr().out.splitlines()
        plan = await asyncio.wait_for(plans.get(), WAIT_S)
        assert printed[0] == plan.plan_id and plan.instances_by_tp == {2: 2}
        assert slots(plan.nodes[0], "stop") == [(1, [0]), (1, [1])] and slots(plan.nodes[0], "start") == [(2, [0, 1])]
        assert any("n1: APPLIED" in line for line in printed)
        await until(lambda: service.num_plans_completed == 2, "the second ack")

        with pytest.raises(CliError, match="Stage2Infeasible"):
            await apply_configuration(config, {4: 2}, timeout_s=WAIT_S)
        malformed = decode(ApplyConfigurationReply, (await nc.request(subjects.reconfig_apply, b"\x00",
                                                                      timeout=WAIT_S)).data)
        assert malformed.error and not malformed.plan_id
        assert service.num_plans_published == 2
        await service.stop()
        await nc.close()

    asyncio.run(main())


def test_periodic_plans_are_published_one_at_a_time_until_acked(nats_server, unique_prefix):
    async def main():
        config = settings(nats_server.url, unique_prefix, interval_s=0.2)
        nc = await nats.connect(nats_server.url)
        subjects = Subjects(unique_prefix)
        plans = await plans_subscription(nc, subjects)
        service = ReconfiguratorService(config, nc, LatencyProfile.load(PROFILE))
        await service.start()
        await nc.publish(subjects.stats, stats(20))

        first = await asyncio.wait_for(plans.get(), WAIT_S)  # nothing runs: the core applies its plan
        [node] = first.nodes
        assert node.node == "n1" and not node.stop and not node.keep
        started_by_tp: dict[int, int] = {}
        for slot in node.start:
            started_by_tp[slot.tp] = started_by_tp.get(slot.tp, 0) + 1
        assert started_by_tp == first.instances_by_tp
        assert sum(tp * n for tp, n in first.instances_by_tp.items()) <= 4
        assert (first.avg_threshold is None) == (first.fallback_reason is not None)

        await until(lambda: service.num_plans_published == 1 and first.plan_id in service.awaited, "the plan")
        assert plans.empty()  # held back while the first waits for its ack
        await nc.publish(subjects.plans_ack, ack(first.plan_id))
        second = await asyncio.wait_for(plans.get(), WAIT_S)  # still nothing runs (no heartbeats): again
        assert second.plan_id != first.plan_id and service.num_plans_completed == 1
        await service.stop()
        await nc.close()

    asyncio.run(main())


def test_observe_only_publishes_nothing(nats_server, unique_prefix):
    async def main():
        nc = await nats.connect(nats_server.url)
        service = ReconfiguratorService(settings(nats_server.url, unique_prefix, enabled=False), nc,
                                        LatencyProfile.load(PROFILE))
        await service.start(periodic=False)
        await nc.publish(Subjects(unique_prefix).stats, stats(20))  # nothing runs, and arrivals: a plan to start
        await until(lambda: service.num_arrivals == 20, "the stats")
        first, second = await service.step(), await service.step()
        assert first.plan_to_apply is not None and second.plan_to_apply is not None  # the core is never blocked
        assert service.num_plans_published == 0 and not service.awaited
        await service.stop()
        await nc.close()

    asyncio.run(main())


def test_cluster_spec_forms():
    degrees = (1, 2, 4, 8)
    short = parse_cluster_spec('{"nodes": {"a": 4, "b": [4, 5]}}', degrees)
    assert [(n.name, n.gpu_ids) for n in short.nodes] == [("a", (0, 1, 2, 3)), ("b", (4, 5))]
    assert short.tp_degrees == (1, 2, 4)
    full = parse_cluster_spec('{"nodes": [{"name": "a", "gpu_ids": [0, 1]}], "tp_degrees": [1]}', degrees)
    assert full.tp_degrees == (1,) and full.nodes[0].gpu_ids == (0, 1)
    with pytest.raises(ValueError, match="placement"):
        parse_cluster_spec('{"nodes": {"a": 2}, "placement": []}', degrees)
    with pytest.raises(ValueError, match="cannot read"):
        parse_cluster_spec("no/such/cluster.json", degrees)


def test_a_rolling_plan_goes_out_one_node_at_a_time(nats_server, unique_prefix):
    """Two nodes switch from four TP-1 each to one TP-4 each: the plan is published for one node,
    and for the other only once the first acknowledged (its new instance is up)."""
    async def main():
        config = settings(nats_server.url, unique_prefix, cluster='{"nodes": {"n1": 4, "n2": 4}}')
        nc = await nats.connect(nats_server.url)
        subjects = Subjects(unique_prefix)
        service = ReconfiguratorService(config, nc, LatencyProfile.load(PROFILE))
        await service.start(periodic=False)
        plans = await plans_subscription(nc, subjects)
        now = time.time()
        for node in ("n1", "n2"):
            for gpu in range(4):
                await nc.publish(subjects.heartbeat, encode(WorkerHeartbeat(
                    instance_id=f"{node}-tp1-g{gpu}", node=node, tp=1, gpu_ids=[gpu], max_batch=16, model="fake",
                    status=WorkerStatus.READY, ttl_s=600.0, sent_at=now, started_at=now)))
        await until(lambda: len(service.leases) == 8, "heartbeats")
        msg = await nc.request(subjects.reconfig_apply, encode(ApplyConfiguration(instances_by_tp={4: 2})),
                               timeout=WAIT_S)
        reply = decode(ApplyConfigurationReply, msg.data)
        assert reply.error is None and sorted(n.node for n in reply.nodes) == ["n1", "n2"]
        first = await asyncio.wait_for(plans.get(), WAIT_S)
        assert first.plan_id == reply.plan_id and [n.node for n in first.nodes] == ["n1"]
        assert slots(first.nodes[0], "start") == [(4, [0, 1, 2, 3])]
        await asyncio.sleep(0.3)
        assert plans.empty()  # n2 waits for n1
        await nc.publish(subjects.plans_ack, encode(PlanAck(plan_id=first.plan_id, node="n1",
                                                            status=PlanAckStatus.APPLIED, acked_at=time.time())))
        second = await asyncio.wait_for(plans.get(), WAIT_S)
        assert second.plan_id == first.plan_id and [n.node for n in second.nodes] == ["n2"]
        assert service.num_plans_completed == 0
        await nc.publish(subjects.plans_ack, encode(PlanAck(plan_id=first.plan_id, node="n2",
                                                            status=PlanAckStatus.APPLIED, acked_at=time.time())))
        await until(lambda: service.num_plans_completed == 1, "the second node's ack")
        assert service.num_plans_published == 1 and not service.awaited
        await service.stop()
        await nc.close()

    asyncio.run(main())
