"""Chaos scenarios 1-6 (issue: reliability): each breaks one part of a running ``Cluster`` while
requests are in flight, then counts what the clients got.

Every scenario returns ``{sent, completed, lost, duplicated, ...}``: ``sent`` logical requests;
``completed`` answered (streamed to the end, or read back by id after the stream broke); ``refused``
got a 429 with ``Retry-After`` and were not sent again (overload only); ``lost`` = sent - completed -
refused (accepted and never answered: must be 0); ``duplicated``: finished requests whose stored
steps commit a position twice or repeat a step, or that had more than one ``RequestFinished`` on the
bus (must be 0).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from tests.chaos.client import Tracked, check_no_duplicates, run_request
from tests.chaos.cluster import ChaosError, Cluster, listening, wait_until

SCENARIO_TIMEOUT_S = 180.0


class FinishedCounter:
    """Counts ``RequestFinished`` events per request id on ``<prefix>.events.>`` (duplicates show here)."""

    def __init__(self, nats_urls: list[str]) -> None:
        self.nats_urls = nats_urls
        self.counts: Counter[str] = Counter()
        self._nc = None

    async def start(self) -> None:
        import nats

        from shared.messages.codec import CodecError, decode
        from shared.messages.events import RequestEvent, RequestFinished
        from shared.subjects import Subjects

        async def on_event(msg) -> None:
            try:
                event = decode(RequestEvent, msg.data)
            except CodecError:
                return
            if isinstance(event, RequestFinished):
                self.counts[event.request_id] += 1

        async def quiet(exc: Exception) -> None:  # the node it talks to may be the one killed
            pass

        self._nc = await nats.connect(self.nats_urls, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                      error_cb=quiet)
        await self._nc.subscribe(f"{Subjects().prefix}.events.>", cb=on_event)

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()


class Scenario:
    """One run: launches clients, tallies them."""

    def __init__(self, cluster: Cluster, finished: FinishedCounter) -> None:
        self.cluster = cluster
        self.finished = finished
        self.tracked: list[Tracked] = []
        self.tasks: list[asyncio.Task] = []
        self.deadline = time.monotonic() + SCENARIO_TIMEOUT_S
        self.extra: dict = {}

    def launch(self, n: int, retry_429: bool = True) -> list[Tracked]:
        out = []
        for _ in range(n):
            tracked = Tracked(index=len(self.tracked), retry_429=retry_429)
            self.tracked.append(tracked)
            self.tasks.append(asyncio.create_task(run_request(self.cluster.url, tracked, self.deadline)))
            out.append(tracked)
        return out

    async def wait_ids(self, tracked: list[Tracked], count: int, timeout_s: float = 90.0) -> None:
        """Until ``count`` of ``tracked`` are streaming (their id known: generation has begun)."""
        deadline = time.monotonic() + timeout_s
        while sum(t.request_id is not None for t in tracked) < min(count, len(tracked)):
            if time.monotonic() > deadline:
                raise ChaosError(f"only {sum(t.request_id is not None for t in tracked)} of {len(tracked)} "
                                 f"requests started within {timeout_s:.0f} s")
            await asyncio.sleep(0.1)

    async def report(self) -> dict:
        await asyncio.gather(*self.tasks)
        await asyncio.sleep(1.0)  # late duplicate events, if any, reach the counter
        completed = [t for t in self.tracked if t.outcome == "completed"]
        refused = [t for t in self.tracked if t.outcome == "refused"]
        duplicated = 0
        problems = []
        for t in completed:
            problem = await check_no_duplicates(self.cluster.url, t.request_id)
            if problem or self.finished.counts[t.request_id] > 1:
                duplicated += 1
                problems.append(f"{t.request_id}: {problem or 'RequestFinished published more than once'}")
        lost = [t for t in self.tracked if t.outcome not in ("completed", "refused")]
        out = {"sent": len(self.tracked), "completed": len(completed), "lost": len(lost),
               "duplicated": duplicated}
        if refused:
            out["refused"] = len(refused)
        out.update(self.extra)
        if lost:
            out["lost_detail"] = [f"{t.request_id or '#' + str(t.index)}: {t.outcome} {t.detail}" for t in lost][:10]
        if problems:
            out["duplicated_detail"] = problems[:10]
        broke = sum(t.stream_broke for t in self.tracked)
        if broke:
            out["answered_by_id"] = broke
        return out


async def worker_kill(cluster: Cluster, finished: FinishedCounter) -> dict:
    """1. A worker SIGKILLed mid-step: the node agent restarts it, the lost steps run again from Redis."""
    s = Scenario(cluster, finished)
    first = s.launch(8)
    await s.wait_ids(first, 3)
    before = cluster.worker_pids()
    if not before:
        raise ChaosError("the node agent runs no worker")
    victim = before[0]
    os.kill(victim, signal.SIGKILL)
    s.extra["killed_worker_pid"] = victim
    result = await s.report()
    await asyncio.to_thread(wait_until, lambda: victim not in cluster.worker_pids()
                            and len(cluster.worker_pids()) == len(before), 60, "the node agent to restart the worker")
    await asyncio.to_thread(cluster.wait_ready, 120)
    result["worker_restarted"] = True
    return result


async def scheduler_restart(cluster: Cluster, finished: FinishedCounter) -> dict:
    """2. The scheduler SIGKILLed and restarted: in-flight requests resume from Redis, arrivals
    made while it was down wait in the JetStream intake and are served after it returns."""
    s = Scenario(cluster, finished)
    first = s.launch(6)
    await s.wait_ids(first, 2)
    cluster.kill("scheduler")
    s.launch(4)  # arrive while no scheduler runs
    await asyncio.sleep(3.0)
    cluster.restart_service("scheduler")
    s.extra["arrived_while_down"] = 4
    return await s.report()


async def gateway_restart(cluster: Cluster, finished: FinishedCounter) -> dict:
    """3. The gateway SIGKILLed mid-stream and restarted: the requests go on; their clients read the
    results by id from the new gateway; new requests are served by it."""
    s = Scenario(cluster, finished)
    first = s.launch(6)
    await s.wait_ids(first, 6)
    cluster.kill("gateway")
    cluster.restart_service("gateway")
    await asyncio.to_thread(cluster.wait_ready, 120)
    s.launch(2)
    return await s.report()


async def nats_node_loss(cluster: Cluster, finished: FinishedCounter) -> dict:
    """4. One node of the 3-node NATS cluster (intake at 3 replicas) SIGKILLed: clients of that node
    reconnect to the others, the intake keeps its quorum, lost events are made up from Redis."""
    s = Scenario(cluster, finished)
    first = s.launch(6)
    await s.wait_ids(first, 2)
    cluster.kill("nats-0")
    s.launch(4)
    result = await s.report()
    cluster.start_nats_node(0)  # rejoin for whatever runs next
    await asyncio.to_thread(wait_until, lambda: listening(cluster.nats_ports[0]), 30, "nats-0 to restart")
    result["nats_nodes_killed"] = 1
    return result


async def redis_restart(cluster: Cluster, finished: FinishedCounter) -> dict:
    """5. Redis SIGKILLed and restarted from its AOF: services ride out the outage with back-off."""
    s = Scenario(cluster, finished)
    first = s.launch(6)
    await s.wait_ids(first, 2)
    cluster.kill("redis")
    await asyncio.sleep(3.0)
    cluster.start_redis()
    s.launch(2)
    return await s.report()


async def overload(cluster: Cluster, finished: FinishedCounter) -> dict:
    """6. A burst far beyond what the cluster serves: admission is bounded (429 + Retry-After at once,
    nothing queued without bound); every admitted request is served; the gateway's memory stays put."""
    s = Scenario(cluster, finished)
    gateway_pid = cluster.processes["gateway"].pid
    rss_before = _rss_mib(gateway_pid)
    burst = s.launch(int(cluster.env.get("DLS_GATEWAY_MAX_IN_FLIGHT", "24")) * 3, retry_429=False)
    await asyncio.gather(*s.tasks)
    refused = [t for t in burst if t.outcome == "refused"]
    if not refused:
        raise ChaosError("the burst got no 429: admission is not bounded")
    if any(not t.retry_after or not all(r.isdigit() for r in t.retry_after) for t in refused):
        raise ChaosError("a 429 came without a Retry-After in seconds")
    s.launch(3)  # still serving afterwards
    result = await s.report()
    result["rss_mib_before"], result["rss_mib_after"] = rss_before, _rss_mib(gateway_pid)
    return result


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


SCENARIOS: dict[str, Callable[[Cluster, FinishedCounter], Awaitable[dict]]] = {
    "1_worker_kill": worker_kill,
    "2_scheduler_restart": scheduler_restart,
    "3_gateway_restart": gateway_restart,
    "4_nats_node_loss": nats_node_loss,
    "5_redis_restart": redis_restart,
    "6_overload": overload,
}
RUN_ORDER = ("1_worker_kill", "2_scheduler_restart", "3_gateway_restart", "5_redis_restart", "6_overload",
             "4_nats_node_loss")  # the NATS node last: the others run on a whole cluster
