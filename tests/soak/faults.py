"""The soak's fault injector: every few seconds (during storm windows, with calm windows between), a
fault picked at random (seeded) among the kinds that may go now, then watched until the cluster has
recovered from it.

| kind | what it does | recovered when |
|---|---|---|
| ``worker_kill`` | SIGKILL a READY worker the node agent runs | the agent restarted it (a new process READY under its instance id) and all are READY |
| ``worker_hang`` | SIGSTOP a READY worker (alive, silent: a hung process) | the node agent killed it and its new process is READY |
| ``worker_skew`` | start an extra worker whose clock is 60 s ahead or behind (``DLS_TEST_CLOCK_OFFSET_S``), stop it (SIGTERM, drained) after ``SKEW_LIFE_S`` | it serves steps (its /metrics) |
| ``scheduler_kill``, ``predictor_kill``, ``reconfigurator_kill`` | SIGKILL the service, start it again 0.5-3 s later | its /ready answers 200 |
| ``gateway_kill`` | SIGKILL one of the gateways, start it again | its /readyz answers 200 |
| ``nats_kill`` | SIGKILL one node of the 3-node NATS cluster, start it again 2-5 s later | it listens again |
| ``redis_failover`` | SIGKILL the Redis primary (Sentinels promote a replica) | the old primary is back as a synced replica |
| ``reconfig_plan`` | ask the reconfigurator (``reconfig.apply``) for 3 or 2 TP-1 instances, whichever differs | the node agent acked it and that many workers are READY |

Then, for every kind, the recovery lasts until a request completes after that point (the cluster
serves end to end again), so only a load can show it. Two things make sure one does:

- the quiet tail (``Schedule``): no fault starts in the last ``quiet_tail_s`` of the load, the longest
  of the kinds' recovery windows (``recovery_windows``: how long the cluster's own timeouts give the
  broken part to come back), so every fault's part is due back while the load still runs;
- the load goes on past its duration while a fault is still to be seen recovering
  (``OpenLoopLoad.run``'s ``keep_going``), at most ``RECOVERY_TIMEOUT_S`` more: longer than any fault
  injected before the tail is watched, so each one is judged.

A fault whose recovery no load could show all the same (its part came back, or for a skewed worker
could only come back by serving, after the load stopped) is reported apart (``Fault.judged`` False:
``faults_not_judged``), neither recovered nor unrecovered. Which workers are READY the injector hears
itself, from the heartbeats (``shared.leases.LeaseTable``, as the services do). Kinds share groups
(the node agent's workers: ``worker_*`` but skew, and plans; plans also need the reconfigurator): one
fault per group at a time, at most ``MAX_ACTIVE`` at once, and the kind least used so far goes first
among those that may go (ties: at random).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field

from shared.leases import LeaseTable
from shared.messages.control import WorkerStatus
from shared.settings import NodeAgentSettings
from tests.chaos.cluster import Cluster, gateway_name, listening
from tests.chaos.redis_ha import ReplicatedRedis
from tests.soak.load import OpenLoopLoad
from tests.soak.report import Fault

MAX_ACTIVE = 3  # faults unrecovered at once
RECOVERY_TIMEOUT_S = 240.0  # a fault not recovered within this is reported unrecovered
SKEW_LIFE_S = 40.0  # how long a skewed worker serves before it is stopped
SKEW_OFFSET_S = 60.0
WORKER_PREFIX = "local-"  # instance ids of the node agent's workers (node "local")
SERVICE_DOWN_S = (0.5, 3.0)  # a killed scheduler, predictor or reconfigurator is started again after this long
GATEWAY_DOWN_S = (0.2, 1.5)  # ... a gateway
NATS_DOWN_S = (2.0, 5.0)  # ... a NATS node

# kind -> the groups it occupies while it runs
KIND_GROUPS: dict[str, tuple[str, ...]] = {
    "worker_kill": ("workers",),
    "worker_hang": ("workers",),
    "worker_skew": ("skew",),
    "scheduler_kill": ("scheduler",),
    "predictor_kill": ("predictor",),
    "reconfigurator_kill": ("reconfigurator",),
    "gateway_kill": ("gateway",),
    "nats_kill": ("nats",),
    "redis_failover": ("redis",),
    "reconfig_plan": ("workers", "reconfigurator"),
}


def recovery_windows(env: Mapping[str, str],
                     redis_failover_s: float = (ReplicatedRedis.down_after_ms
                                                + ReplicatedRedis.failover_timeout_ms) / 1000) -> dict[str, float]:
    """kind -> how long the cluster's own timeouts (the settings in ``env``, the Sentinels' failover) give
    the part a fault broke to come back: the time it is down (the injector's restart delay, or what the
    cluster takes to notice and act) plus the node agent's ``start_timeout_s``, its bound on a process
    coming up (a worker not READY by then is killed and started again), taken for every process."""
    agent = {name: float(env.get(info.validation_alias, info.default))
             for name, info in NodeAgentSettings.model_fields.items()
             if name in ("start_timeout_s", "stop_timeout_s", "hang_timeout_s", "restart_backoff_s")}
    start = agent["start_timeout_s"]
    restarted = agent["restart_backoff_s"] + start  # the agent sees its child exit at once
    return {
        "worker_kill": restarted,
        "worker_hang": agent["hang_timeout_s"] + restarted,
        "worker_skew": start,  # READY, then its first step
        "scheduler_kill": SERVICE_DOWN_S[1] + start,
        "predictor_kill": SERVICE_DOWN_S[1] + start,
        "reconfigurator_kill": SERVICE_DOWN_S[1] + start,
        "gateway_kill": GATEWAY_DOWN_S[1] + start,
        "nats_kill": NATS_DOWN_S[1] + start,
        "redis_failover": redis_failover_s + start,  # a replica promoted, the old primary back and synced
        "reconfig_plan": max(agent["stop_timeout_s"], start),  # one worker stopped (SIGKILL by then) or started
    }


def quiet_tail_s(windows: Mapping[str, float]) -> float:
    """The last stretch of the load where no fault starts: the slowest kind's recovery window."""
    return max(windows.values())


@dataclass(frozen=True)
class Schedule:
    """When a fault may start, in seconds since the load started (pure: no clock): during the first
    ``storm_s`` of each ``storm_s + calm_s`` cycle, and never in the last ``quiet_tail_s`` of the load's
    ``duration_s`` (a fault started there could not be due back while the load runs). The quiet tail is
    a calm itself: the last cycle before it has none of its own (its storm lasts until the tail), so a
    3-minute soak, whose second storm would begin in the tail, injects for all of its first 113.5 s."""

    duration_s: float
    storm_s: float
    calm_s: float
    quiet_tail_s: float

    @property
    def last_start_s(self) -> float:
        """No fault starts at or after this."""
        return self.duration_s - self.quiet_tail_s

    def may_start(self, elapsed_s: float) -> bool:
        if not 0.0 <= elapsed_s < self.last_start_s:
            return False
        cycle_s = self.storm_s + self.calm_s
        into_s = elapsed_s % cycle_s
        return into_s < self.storm_s or elapsed_s - into_s + cycle_s >= self.last_start_s  # the last cycle: no calm

    def attempts(self, rng: random.Random, gap_s: tuple[float, float]) -> Iterator[float]:
        """The times to try a fault at: one every ``gap_s`` (uniform) from 0, those where one may start."""
        at = 0.0
        while at < self.last_start_s:
            if self.may_start(at):
                yield at
            at += rng.uniform(*gap_s)


@dataclass
class Injected:
    """A fault just injected: what it hit and how to tell it is over."""

    target: str
    recovered: Callable[[], bool]  # polled in a thread
    detail: dict = field(default_factory=dict)
    after: Callable[[], Awaitable[None]] | None = None  # runs once recovered (the group stays busy)
    needs_load: bool = False  # its part can only come back under load (a worker shows it by serving a step)


class Injector:
    def __init__(self, cluster: Cluster, load: OpenLoopLoad, rng: random.Random, log=print) -> None:
        self.cluster = cluster
        self.load = load
        self.rng = rng
        self.log = log
        self.faults: list[Fault] = []
        self.expected_workers = cluster.workers  # READY workers of the node agent when all is well
        self.busy: set[str] = set()  # groups with a fault in progress
        self.tasks: list[asyncio.Task] = []
        self.skipped: dict[str, int] = {}  # kind -> injections that did not happen (e.g. plan refused)
        self.skew: list[dict] = []  # per skewed worker: offset, steps served, dropped while alive
        self._num_skew = 0
        self._plan_acks: dict[str, object] = {}  # plan id -> PlanAck
        self._nc = None
        self.leases = LeaseTable()  # the workers heard, on time.monotonic()

    # --- the loop --------------------------------------------------------------------------------

    async def run(self, schedule: Schedule, gap_s: tuple[float, float], started: float) -> None:
        """Try a fault at each of ``schedule``'s attempts (``started``: the load's start, on
        ``time.monotonic()``); then wait for the faults in progress to recover."""
        try:
            for at in schedule.attempts(self.rng, gap_s):
                await asyncio.sleep(max(0.0, started + at - time.monotonic()))
                # NOTE: the clock, not the plan: an event loop running late must not start one in the quiet tail
                now = time.monotonic()
                if schedule.may_start(now - started) and (kind := self._pick()) is not None:
                    self._launch(kind, now)
            await asyncio.gather(*self.tasks)
        finally:
            await self._nc.close()

    def _pick(self) -> str | None:
        if len([t for t in self.tasks if not t.done()]) >= MAX_ACTIVE:
            return None
        free = [k for k, groups in KIND_GROUPS.items() if not self.busy.intersection(groups)]
        if not free:
            return None
        used = {k: sum(f.kind == k for f in self.faults) + (k in self._running) for k in free}
        least = min(used.values())
        return self.rng.choice(sorted(k for k in free if used[k] == least))

    @property
    def _running(self) -> set[str]:
        return {t.get_name() for t in self.tasks if not t.done()}

    def _launch(self, kind: str, at: float) -> None:
        self.busy.update(KIND_GROUPS[kind])
        self.tasks.append(asyncio.create_task(self._fault(kind, at), name=kind))

    async def _fault(self, kind: str, at: float) -> None:
        try:
            injected = await getattr(self, f"_{kind}")()
            if injected is None:
                self.skipped[kind] = self.skipped.get(kind, 0) + 1
                return
            self.log(f"soak: fault {kind} on {injected.target}")
            recovered_at = await self._recovery(injected)
            judged = recovered_at is not False
            recovered_at = recovered_at or None
            self.faults.append(Fault(kind, injected.target, at, recovered_at, injected.detail, judged))
            self.log(f"soak: {kind} on {injected.target}: " + (
                f"recovered in {recovered_at - at:.1f} s" if recovered_at
                else f"NOT RECOVERED {injected.detail}" if judged
                else "back after the load stopped: not judged (no request could show it)"))
            if injected.after is not None:
                await injected.after()
        except Exception as exc:  # noqa: BLE001 (reported; the soak goes on)
            self.log(f"soak: fault {kind} could not run: {type(exc).__name__}: {exc}")
            self.skipped[kind] = self.skipped.get(kind, 0) + 1
        finally:
            self.busy.difference_update(KIND_GROUPS[kind])

    @property
    def active(self) -> bool:
        """A fault is injected and not yet seen recovering."""
        return any(not t.done() for t in self.tasks)

    async def _recovery(self, injected: Injected) -> float | None | bool:
        """When the broken part serves again and a request completed after that; None past the timeout;
        False when no load was left to show it (the part came back, or needs load to, after it stopped)."""
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while not await asyncio.to_thread(injected.recovered):
            if injected.needs_load and self.load.idle:
                return False
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.25)
        back = time.monotonic()
        while self.load.last_completion_at <= back:
            if self.load.idle:
                return False
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.1)
        return self.load.last_completion_at

    # --- helpers ---------------------------------------------------------------------------------

    async def connect(self) -> None:
        """Hear the heartbeats and plan acks (before ``run``)."""
        import nats

        from shared.messages.codec import CodecError, decode
        from shared.messages.control import PlanAck, WorkerHeartbeat
        from shared.subjects import Subjects

        async def on_heartbeat(msg) -> None:
            try:
                self.leases.observe(decode(WorkerHeartbeat, msg.data), time.monotonic())
            except CodecError:
                return

        async def on_ack(msg) -> None:
            try:
                ack = decode(PlanAck, msg.data)
            except CodecError:
                return
            self._plan_acks[ack.plan_id] = ack

        async def quiet(exc: Exception) -> None:
            pass

        self._nc = await nats.connect(self.cluster.nats_urls, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                      error_cb=quiet)
        await self._nc.subscribe(Subjects().plans_ack, cb=on_ack)
        await self._nc.subscribe(Subjects().heartbeat, cb=on_heartbeat)

    def ready_workers(self) -> dict[str, float]:
        """The node agent's workers READY now: instance id -> started_at of the process heard."""
        return {hb.instance_id: hb.started_at for hb in self.leases.live(time.monotonic())
                if hb.status == WorkerStatus.READY and hb.instance_id.startswith(WORKER_PREFIX)}

    def _ready_victim(self) -> tuple[int, str, float] | None:
        """A worker process of the node agent that is READY: (pid, instance id, its started_at)."""
        ready = self.ready_workers()
        candidates = [(pid, iid) for pid in self.cluster.worker_pids() if (iid := _instance_of(pid)) in ready]
        if not candidates:
            return None
        pid, instance_id = self.rng.choice(sorted(candidates))
        return pid, instance_id, ready[instance_id]

    def _replaced(self, pid: int, instance_id: str, started_at: float) -> bool:
        """The victim process is gone, its instance READY again as a new process, and all workers READY."""
        ready = self.ready_workers()
        return (not _alive(pid) and ready.get(instance_id, started_at) != started_at
                and len(ready) >= self.expected_workers)

    async def _restart(self, name: str, down_s: tuple[float, float], start: Callable[[], None]) -> None:
        await asyncio.to_thread(self.cluster.kill, name)
        await asyncio.sleep(self.rng.uniform(*down_s))
        await asyncio.to_thread(start)

    # --- the kinds -------------------------------------------------------------------------------

    async def _worker_kill(self) -> Injected | None:
        found = self._ready_victim()
        if found is None:
            return None
        victim, instance_id, started_at = found
        os.kill(victim, signal.SIGKILL)
        return Injected(f"{instance_id} (pid {victim})", lambda: self._replaced(victim, instance_id, started_at))

    async def _worker_hang(self) -> Injected | None:
        found = self._ready_victim()
        if found is None:
            return None
        victim, instance_id, started_at = found
        os.kill(victim, signal.SIGSTOP)  # alive, but neither steps nor heartbeats: the agent must replace it

        async def cleanup() -> None:  # the agent should have killed it; never leave a stopped process
            if _alive(victim):
                self.log(f"soak: hung worker {victim} still there after its recovery; killing it")
                os.kill(victim, signal.SIGKILL)

        return Injected(f"{instance_id} (pid {victim})", lambda: self._replaced(victim, instance_id, started_at),
                        after=cleanup)

    async def _worker_skew(self) -> Injected | None:
        from shared.runtime import free_port

        self._num_skew += 1
        instance_id = f"skew-{self._num_skew}"
        offset = self.rng.choice([-SKEW_OFFSET_S, SKEW_OFFSET_S])
        port = free_port()
        env = {**self.cluster.env, "DLS_WORKER_INSTANCE_ID": instance_id, "DLS_WORKER_NODE": "skew",
               "DLS_TEST_CLOCK_OFFSET_S": str(offset), "DLS_METRICS_PORT": str(port),
               "DLS_WORKER_DRAIN_TIMEOUT_S": "10"}
        await asyncio.to_thread(self.cluster.spawn, instance_id, [sys.executable, "-m", "services.worker"], env)
        detail = {"instance_id": instance_id, "offset_s": offset}

        async def retire() -> None:
            await asyncio.sleep(SKEW_LIFE_S)
            detail["steps"] = _worker_steps(port)
            await asyncio.to_thread(self.cluster.kill, instance_id, signal.SIGTERM)  # drains, then exits
            detail["dropped_while_alive"] = self._scheduler_dropped(instance_id)
            self.skew.append(detail)

        return Injected(f"{instance_id} ({offset:+.0f} s)", lambda: _worker_steps(port) > 0, detail, after=retire,
                        needs_load=True)

    def _scheduler_dropped(self, instance_id: str) -> int:
        """Times the scheduler logged the instance's lease as expired (it must never, while it beats)."""
        path = self.cluster.run_dir / "logs" / "scheduler.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return text.count(f"instance {instance_id}: lease expired")

    async def _service_kill(self, name: str) -> Injected:
        await self._restart(name, SERVICE_DOWN_S, lambda: self.cluster.start_service(name))
        detail: dict = {}

        def recovered() -> bool:
            if not self.cluster.alive(name):  # started again, then exited: its log says why
                detail["exited"] = f"see logs/{name}.log"
            return self.cluster.probe(name)

        return Injected(name, recovered, detail)

    async def _scheduler_kill(self) -> Injected:
        return await self._service_kill("scheduler")

    async def _predictor_kill(self) -> Injected:
        return await self._service_kill("predictor")

    async def _reconfigurator_kill(self) -> Injected:
        return await self._service_kill("reconfigurator")

    async def _gateway_kill(self) -> Injected:
        name = gateway_name(self.rng.randrange(self.cluster.gateways))
        await self._restart(name, GATEWAY_DOWN_S, lambda: self.cluster.start_service(name))
        return Injected(name, lambda: self.cluster.probe(name, "/readyz"))

    async def _nats_kill(self) -> Injected:
        i = self.rng.randrange(len(self.cluster.nats_ports))
        await self._restart(f"nats-{i}", NATS_DOWN_S, lambda: self.cluster.start_nats_node(i))
        return Injected(f"nats-{i}", lambda: listening(self.cluster.nats_ports[i]))

    async def _redis_failover(self) -> Injected:
        redis = self.cluster.redis_ha
        old = await asyncio.to_thread(redis.kill_primary)
        detail: dict = {"killed": f"redis-{old}"}

        def recovered() -> bool:
            if "promoted" not in detail:
                detail["promoted"] = f"redis-{redis.wait_failover(old)}"
                redis.restart(old)  # back as a replica of the new primary
            return redis.alive(old) and redis.replication(old).get("master_link_status") == "up"

        return Injected(f"redis-{old} (primary)", recovered, detail)

    async def _reconfig_plan(self) -> Injected | None:
        from shared.messages.codec import decode, encode
        from shared.messages.control import ApplyConfiguration, ApplyConfigurationReply, PlanAckStatus
        from shared.subjects import Subjects

        wanted = 3 if len(self.ready_workers()) <= 2 else 2
        request = ApplyConfiguration(instances_by_tp={1: wanted}, requested_by="soak")
        try:
            msg = await self._nc.request(Subjects().reconfig_apply, encode(request), timeout=30)
        except Exception as exc:  # noqa: BLE001 (no reconfigurator answering: no plan, nothing injected)
            self.log(f"soak: reconfig_plan: no answer ({type(exc).__name__})")
            return None
        reply = decode(ApplyConfigurationReply, msg.data)
        if not reply.plan_id:
            self.log(f"soak: reconfig_plan: no plan published ({reply.error})")
            return None
        detail = {"plan_id": reply.plan_id, "instances_tp1": wanted}

        def recovered() -> bool:
            ack = self._plan_acks.get(reply.plan_id)
            if ack is None:
                return False
            detail["ack"] = PlanAckStatus(ack.status).name
            applied = ack.status == PlanAckStatus.APPLIED
            self.expected_workers = wanted if applied else len(self.ready_workers())
            return len(self.ready_workers()) == self.expected_workers

        return Injected(f"plan {reply.plan_id}: {wanted} x TP-1", recovered, detail)


def _instance_of(pid: int) -> str:
    """The instance id a worker process was started with ("" when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return ""
    return env.get(b"DLS_WORKER_INSTANCE_ID", b"").decode()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _worker_steps(port: int) -> float:
    """``dls_worker_steps_total`` of the worker serving metrics on ``port`` (0 when it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            text = reply.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dls_worker_steps_total"))

