"""Scale from zero in the reconfigurator service, against a real nats-server: a model kept at 0 instances
(``DLS_RECONFIGURATOR_MIN_INSTANCES``) whose arrivals show up in the workload stats is planned for at
once, out of period (the period here is an hour and the test never calls ``step``), and the plan starts
an instance of it. Arrivals of a model that runs already plan nothing out of period. The test stands in
for the scheduler (stats), the workers (heartbeats) and the node agent (acks)."""

from __future__ import annotations

import asyncio

import nats
import pytest

from services.reconfigurator.service import ReconfiguratorService
from shared.messages import decode, encode
from shared.messages.control import (
    Arrival,
    PlanAck,
    PlanAckStatus,
    ReconfigPlan,
    WorkerStatus,
    WorkloadStats,
)
from shared.profiles import LatencyProfile
from shared.settings import ReconfiguratorSettings
from shared.subjects import Subjects
from tests.integration.test_reconfigurator_models import PROFILE, WAIT_S, Clock, by_model, heartbeat, until

pytestmark = pytest.mark.integration

WINDOW_S = 5.0


def stats(model: str, now: float, count: int) -> bytes:
    arrivals = [Arrival(time_s=now - WINDOW_S + i * WINDOW_S / count, prompt_tokens=120, output_tokens=64,
                        model=model) for i in range(count)]
    return encode(WorkloadStats(window_start=now - WINDOW_S, window_end=now, arrivals=arrivals))


def test_arrivals_of_a_model_at_zero_plan_at_once_and_start_it(nats_server, unique_prefix):
    async def main():
        clock = Clock()
        config = ReconfiguratorSettings(
            nats_url=nats_server.url, subject_prefix=unique_prefix, model_dirs="/models/alpha,/models/beta",
            cluster='{"nodes": {"n1": 4}, "tp_degrees": [1]}', interval_s=3600.0, solver_time_limit_s=10.0,
            window_s=WINDOW_S, peak_windows=1, switch_s="alpha=1,beta=1", min_instances="alpha=1,beta=0")
        profile = LatencyProfile.load(PROFILE)
        nc = await nats.connect(nats_server.url)
        subjects = Subjects(unique_prefix)
        plans: asyncio.Queue = asyncio.Queue()

        async def on_plan(msg) -> None:
            plans.put_nowait(decode(ReconfigPlan, msg.data))

        await nc.subscribe(subjects.plans, cb=on_plan)
        service = ReconfiguratorService(config, nc, {"alpha": profile, "beta": profile}, clock)
        await service.start()  # periodic, but the period is an hour
        try:
            for gpu in range(4):  # beta is scaled to zero: every GPU runs alpha
                await nc.publish(subjects.heartbeat, heartbeat(f"n1-g{gpu}-alpha", "alpha", gpu, clock.now))
            clock.now += 2 * WINDOW_S
            await nc.publish(subjects.stats, stats("alpha", clock.now, 20))
            await until(lambda: len(service.leases) == 4 and service.num_arrivals == 20, "alpha's arrivals")
            await asyncio.sleep(0.2)  # room for a wrong out-of-period step to show
            assert service.num_out_of_period_steps == 0 and plans.empty()

            await nc.publish(subjects.stats, stats("beta", clock.now, 1))  # one request of beta
            plan = await asyncio.wait_for(plans.get(), WAIT_S)
            assert service.num_out_of_period_steps == 1
            assert plan.instances_by_model.get("beta", {}).get(1, 0) >= 1
            [node] = plan.nodes
            started = by_model(node.start)
            assert len(started["beta"]) == len(by_model(node.stop)["alpha"]) >= 1

            # the node agent starts it (and acknowledges once it is READY): beta runs, and its next arrivals
            # plan nothing out of period
            gpu = started["beta"][0]
            await nc.publish(subjects.heartbeat, heartbeat(f"n1-g{gpu}-alpha", "alpha", gpu, clock.now,
                                                           WorkerStatus.STOPPING))
            await nc.publish(subjects.heartbeat, heartbeat(f"n1-g{gpu}-beta", "beta", gpu, clock.now))
            await nc.publish(subjects.plans_ack, encode(PlanAck(plan_id=plan.plan_id, node="n1",
                                                                status=PlanAckStatus.APPLIED, acked_at=clock.now)))
            await until(lambda: service.num_plans_completed == 1, "the ack")
            assert "beta" in service.configuration()[1].values()
            await nc.publish(subjects.stats, stats("beta", clock.now, 1))
            await until(lambda: service.num_arrivals == 22, "beta's next arrival")
            await asyncio.sleep(0.2)
            assert service.num_out_of_period_steps == 1
        finally:
            await service.stop()
            await nc.close()

    asyncio.run(main())
