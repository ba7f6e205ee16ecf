"""The reconfigurator service dividing one node's GPUs between two models, against a real nats-server:
the test stands in for the scheduler (arrivals naming their model), the workers (heartbeats naming
theirs) and the node agent (acks). Load on one model moves slots to it from the other, which keeps
its minimum; the load flipping moves them back once the first plan is acknowledged."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import pytest

from services.reconfigurator.service import ReconfiguratorService
from shared.messages import decode, encode
from shared.messages.control import (
    ApplyConfiguration,
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
WINDOW_S = 5.0
RATE_RPS = 80.0  # more than two TP-1 instances of the profile serve within the SLO, less than three


class Clock:
    """The service's clock, moved by the test (leases, monitors and acks all read it)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def heartbeat(instance_id: str, model: str, gpu: int, now: float, status=WorkerStatus.READY) -> bytes:
    return encode(WorkerHeartbeat(instance_id=instance_id, node="n1", tp=1, gpu_ids=[gpu], max_batch=16, model=model,
                                  status=status, ttl_s=600.0, sent_at=now, started_at=now))


def arrivals_of(model: str, now: float) -> bytes:
    """The last window's arrivals, every one naming ``model``."""
    count = int(RATE_RPS * WINDOW_S)
    arrivals = [Arrival(time_s=now - WINDOW_S + i / RATE_RPS, prompt_tokens=120, output_tokens=64, model=model)
                for i in range(count)]
    return encode(WorkloadStats(window_start=now - WINDOW_S, window_end=now, arrivals=arrivals))


def by_model(slots) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for slot in slots:
        assert slot.tp == 1
        out.setdefault(slot.model, []).extend(slot.gpu_ids)
    return {model: sorted(gpus) for model, gpus in sorted(out.items())}


def test_load_moves_slots_between_two_models_and_back(nats_server, unique_prefix):
    async def main():
        clock = Clock()
        config = ReconfiguratorSettings(
            nats_url=nats_server.url, subject_prefix=unique_prefix, model_dirs="/models/alpha,/models/beta",
            cluster='{"nodes": {"n1": 4}, "tp_degrees": [1]}', interval_s=3600.0, solver_time_limit_s=10.0,
            window_s=WINDOW_S, peak_windows=1, switch_s="alpha=1,beta=1")  # min_instances: 1 each by default
        profile = LatencyProfile.load(PROFILE)
        nc = await nats.connect(nats_server.url)
        subjects = Subjects(unique_prefix)
        plans: asyncio.Queue = asyncio.Queue()

        async def on_plan(msg) -> None:
            plans.put_nowait(decode(ReconfigPlan, msg.data))

        await nc.subscribe(subjects.plans, cb=on_plan)
        service = ReconfiguratorService(config, nc, {"alpha": profile, "beta": profile}, clock)
        await service.start(periodic=False)
        assert service.models == ("alpha", "beta")

        for gpu, model in enumerate(("alpha", "alpha", "beta", "beta")):
            await nc.publish(subjects.heartbeat, heartbeat(f"n1-g{gpu}-{model}", model, gpu, clock.now))
        clock.now += 2 * WINDOW_S  # the monitors have watched their whole memory
        await nc.publish(subjects.stats, arrivals_of("alpha", clock.now))
        await until(lambda: len(service.leases) == 4 and service.num_arrivals == RATE_RPS * WINDOW_S, "inputs")
        refused = await service.apply(ApplyConfiguration(instances_by_tp={1: 4}))
        assert refused.error and "names no model" in refused.error and not refused.plan_id

        # alpha's load: a slot of beta's becomes alpha's, beta keeps its one
        first = await published(service, plans)
        assert first.instances_by_model == {"alpha": {1: 3}, "beta": {1: 1}} and first.instances_by_tp == {1: 4}
        [node] = first.nodes
        assert node.node == "n1"
        assert list(by_model(node.stop)) == ["beta"] and list(by_model(node.start)) == ["alpha"]
        [moved] = by_model(node.stop)["beta"]
        assert by_model(node.start)["alpha"] == [moved] and moved in (2, 3)
        assert by_model(node.keep) == {"alpha": [0, 1], "beta": [5 - moved]}

        assert await service.step() is None  # held back until the node acknowledges
        await nc.publish(subjects.plans_ack, encode(PlanAck(plan_id=first.plan_id, node="n1",
                                                            status=PlanAckStatus.APPLIED, acked_at=clock.now)))
        await until(lambda: service.num_plans_completed == 1, "the ack")
        await nc.publish(subjects.heartbeat, heartbeat(f"n1-g{moved}-beta", "beta", moved, clock.now,
                                                       WorkerStatus.STOPPING))
        await nc.publish(subjects.heartbeat, heartbeat(f"n1-g{moved}-alpha", "alpha", moved, clock.now))
        await until(lambda: f"n1-g{moved}-alpha" in service.leases, "the new worker")
        assert sorted(service.configuration()[1].values()) == ["alpha", "alpha", "alpha", "beta"]

        # the load flips to beta: two of alpha's slots go back, alpha keeps its one
        clock.now += 2 * WINDOW_S  # alpha's arrivals have left the window
        await nc.publish(subjects.stats, arrivals_of("beta", clock.now))
        await until(lambda: service.num_arrivals == 2 * RATE_RPS * WINDOW_S, "beta's arrivals")
        second = await published(service, plans)
        assert second.plan_id != first.plan_id
        assert second.instances_by_model == {"alpha": {1: 1}, "beta": {1: 3}}
        [node] = second.nodes
        assert list(by_model(node.stop)) == ["alpha"] and list(by_model(node.start)) == ["beta"]
        assert by_model(node.start)["beta"] == by_model(node.stop)["alpha"]
        assert len(by_model(node.keep)["alpha"]) == 1 and by_model(node.keep)["beta"] == [5 - moved]
        await service.stop()
        await nc.close()

    asyncio.run(main())


async def published(service: ReconfiguratorService, plans: asyncio.Queue) -> ReconfigPlan:
    """One period's plan, as the node agents receive it."""
    result = await service.step()
    assert result is not None and result.plan_to_apply is not None, result and result.decision
    plan = await asyncio.wait_for(plans.get(), WAIT_S)
    assert plan.plan_id == result.plan_to_apply.plan_id
    return plan


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
