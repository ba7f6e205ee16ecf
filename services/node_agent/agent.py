"""The node agent: starts, stops and restarts the worker processes on one node's GPU slots.

- Models: the agent serves ``served_model_dirs`` (one model, or several: ``model_dirs``); a model's
  name is its directory's basename. Each worker serves one of them, for its whole life (restarts too).
- Boot: one worker per TP degree in ``initial_instances``, each on the first free aligned slot (slot
  k of degree d is the sorted GPUs ``[k*d, (k+1)*d)``, as the reconfigurator's Stage 2 counts them),
  serving the model ``initial_models`` names in the same place (unset: the served models in turn).
- ``plans``: the ``NodePlan`` of this node (plans for other nodes are ignored). Stops first
  (SIGTERM to the worker holding exactly those GPUs, which drains and exits; SIGKILL to its process
  group after ``stop_timeout_s``), then starts (spawn, wait for its READY heartbeat up to
  ``start_timeout_s``; a slot's ``model`` names the model its worker serves, "" the first, one this
  agent does not serve fails that start), then a ``PlanAck`` on ``plans.ack``: APPLIED, PARTIAL (``detail`` says what
  failed) or FAILED, with the instance ids started and stopped. A plan that arrives while another is
  being applied is REJECTED.
- Switches made before break (``overlap_switch``, ``switch_on``): a start on GPUs where a stop's worker serves
  another model is spawned at once beside the workers it replaces (``replaced_by``), which serve on until it
  is READY and are stopped then; if it does not come up they serve on, and the ack says so. Its time from
  the plan to the replaced workers stopped is logged and observed (``dls_node_agent_switch_seconds``).
- Restarts: a worker that exits without being asked is logged and started again on the same GPUs,
  under the same instance id (its heartbeat's ``started_at`` changes), after a back-off that doubles
  per consecutive crash (``restart_backoff_s`` up to ``restart_backoff_max_s``; reset once READY).
- Hung workers: a worker that has been READY and then sends no heartbeat for ``hang_timeout_s`` (a
  stopped or wedged process), or whose heartbeats report a step computing for longer than that (a
  step that never returns while its heartbeat task lives), or a restarted worker not READY within
  ``start_timeout_s``, is SIGKILLed with its process group and so restarted as above. Silence is only counted while the agent's own NATS connection is up. The
  scheduler has already moved its requests away (its lease ran out, or ``shared.leases.step_stuck``).
- SIGTERM / SIGINT: every worker is stopped as above, then the agent exits.

A worker is ``worker_command`` (a leading ``python`` is this interpreter) in its own session and
process group, with the agent's environment plus the connection settings and ``DLS_WORKER_INSTANCE_ID``,
``DLS_WORKER_NODE``, ``DLS_WORKER_GPU_IDS`` (JSON list), ``DLS_WORKER_TP``, ``DLS_WORKER_MODEL_DIR`` (its
model's directory) and ``DLS_CALIBRATION_DIR`` (the agent's for the first model's workers, "" for the others':
``shared.served``), pinned to its slot's GPUs with ``CUDA_VISIBLE_DEVICES`` (the agent's GPU ids are
positions in the ``CUDA_VISIBLE_DEVICES`` the agent was given, if any): it sees them as
``cuda:0 .. cuda:tp-1``, where ``DLS_WORKER_DEVICE=cuda`` puts its ranks. Its stdout and stderr go to ``<log_dir>/<instance id>.log`` (appended across
restarts). On a CPU machine the GPU ids are emulated slots: nothing here touches a device.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shlex
import signal
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shared.devices import VISIBLE_DEVICES, DeviceError, is_cuda, pin
from shared.messages import codec
from shared.messages.control import (
    InstanceSlot,
    NodePlan,
    PlanAck,
    PlanAckStatus,
    ReconfigPlan,
    WorkerHeartbeat,
    WorkerStatus,
)
from shared.metrics import NodeAgentMetrics, serve_metrics
from shared.runtime import connect_nats, on_stop_signals
from shared.served import DuplicateModelName, ServedModelDir, served_models_of
from shared.settings import NodeAgentSettings
from shared.subjects import SubjectError, Subjects, check_id
from shared.telemetry import extract_context, setup_tracing, shutdown_tracing, tracer

logger = logging.getLogger("dls.node_agent")

WORKER_SCRAPE_TIMEOUT_S = 2.0  # a worker's /metrics slower than this is left out of the agent's scrape
# the workers' settings the agent reads from the environment it passes them (WorkerSettings' variables)
WORKER_DEVICE_ENV = "DLS_WORKER_DEVICE"
WORKER_KV_BUDGET_ENV = "DLS_WORKER_KV_BUDGET_BYTES"


class AgentError(ValueError):
    """Settings the agent cannot work with (bad node name, GPUs, command or initial instances)."""


# --- pure helpers -----------------------------------------------------------------------------------


def worker_argv(command: str, python: str = sys.executable) -> list[str]:
    """``command`` split like a shell would, a leading ``python`` replaced by this interpreter."""
    argv = shlex.split(command)
    if not argv:
        raise AgentError("worker command is empty (set DLS_NODE_AGENT_WORKER_COMMAND)")
    return [python, *argv[1:]] if argv[0] == "python" else argv


def new_instance_id(node: str, tp: int, gpu_ids: Iterable[int]) -> str:
    """``<node>-tp<d>-g<first gpu>-<4 hex>``: readable, unique, a valid subject token."""
    return check_id(f"{node}-tp{tp}-g{min(gpu_ids)}-{secrets.token_hex(2)}", "instance id")


def served_models(settings: NodeAgentSettings) -> dict[str, ServedModelDir]:
    """Model name -> the served model (``shared.served``: its directory, the calibration its workers read);
    ``AgentError`` naming the setting when two directories share a name."""
    try:
        return {m.name: m for m in served_models_of(settings, "DLS_NODE_AGENT_MODEL_DIRS (or DLS_MODEL_DIRS)")}
    except DuplicateModelName as exc:
        raise AgentError(str(exc)) from None


def boot_models(initial_models: list[str], num_instances: int, served: list[str]) -> list[str]:
    """The model of each boot-time worker: ``initial_models`` checked against the ``served`` names, or
    (empty) the served models in turn; ``AgentError`` naming the setting otherwise."""
    if not initial_models:
        return [served[i % len(served)] for i in range(num_instances)]
    if len(initial_models) != num_instances:
        raise AgentError(f"DLS_NODE_AGENT_INITIAL_MODELS {initial_models} names {len(initial_models)} models for "
                         f"{num_instances} initial instances (DLS_NODE_AGENT_INITIAL_INSTANCES): one per instance")
    unknown = sorted(set(initial_models) - set(served))
    if unknown:
        raise AgentError(f"DLS_NODE_AGENT_INITIAL_MODELS: {', '.join(map(repr, unknown))} not served by this agent "
                         f"(it serves {', '.join(served)}: DLS_NODE_AGENT_MODEL_DIRS, else DLS_MODEL_DIRS)")
    return list(initial_models)


def first_free_slot(gpu_ids: Iterable[int], busy_gpu_ids: set[int], tp: int) -> tuple[int, ...] | None:
    """The first aligned slot of degree ``tp`` (sorted GPUs ``[k*tp, (k+1)*tp)``) with no busy GPU."""
    gpus = sorted(gpu_ids)
    for k in range(len(gpus) // tp):
        slot = tuple(gpus[k * tp : (k + 1) * tp])
        if not busy_gpu_ids.intersection(slot):
            return slot
    return None


def initial_slots(gpu_ids: Iterable[int], degrees: Iterable[int]) -> list[tuple[int, ...]]:
    """Slots of the boot-time workers, in order; ``AgentError`` when they do not fit."""
    busy: set[int] = set()
    slots = []
    for tp in degrees:
        if tp < 1:
            raise AgentError(f"initial instance TP degree {tp} must be at least 1")
        slot = first_free_slot(gpu_ids, busy, tp)
        if slot is None:
            raise AgentError(f"initial instances {list(degrees)} do not fit on GPUs {sorted(gpu_ids)}: "
                             f"no free aligned slot left for TP-{tp}")
        busy.update(slot)
        slots.append(slot)
    return slots


def hang_problem(worker: Worker, now: float, timeout_s: float, start_timeout_s: float) -> str | None:
    """Why ``worker`` counts as hung at ``now`` (``time.monotonic()``), or None: a worker that has been
    READY in its current process and then went silent, or reports a step computing, for over ``timeout_s``;
    or a restartable one (booted, restarted) not READY ``start_timeout_s`` after it was spawned (a worker
    a plan starts is waited for, and stopped, by the plan: ``_wait_ready``)."""
    process = worker.process
    if worker.stopping or process is None or process.returncode is not None:
        return None
    if not worker.ready.is_set():
        starting_s = now - worker.spawned_mono
        if worker.restartable and starting_s > start_timeout_s:
            return f"not READY {starting_s:.0f} s after it started"
        return None
    silent_s = now - worker.last_heard
    if silent_s > timeout_s:
        return f"no heartbeat for {silent_s:.1f} s"
    if worker.step_running_s > timeout_s:
        return f"a step computing for {worker.step_running_s:.1f} s"
    return None


def switch_on(setting: str, worker_env: Mapping[str, str]) -> bool:
    """Whether a plan's change of a slot's model is made before break (``DLS_NODE_AGENT_OVERLAP_SWITCH``),
    for workers given ``worker_env``: ``auto`` is on unless they run on CUDA. On CUDA the incoming worker
    loads while the outgoing one holds its weights and its KV pool, and a worker sizes its pool when it
    starts (a share of the memory free then, unless ``DLS_WORKER_KV_BUDGET_BYTES`` caps it): ``on`` there
    needs that budget set, ``AgentError`` otherwise."""
    cuda = is_cuda(worker_env.get(WORKER_DEVICE_ENV, "cpu"))
    if setting == "off" or (setting == "auto" and cuda):
        return False
    if cuda:
        try:
            budget = int(worker_env.get(WORKER_KV_BUDGET_ENV, "0") or 0)
        except ValueError:
            raise AgentError(f"{WORKER_KV_BUDGET_ENV}={worker_env[WORKER_KV_BUDGET_ENV]!r} is not a byte count") from None
        if budget <= 0:
            raise AgentError(f"DLS_NODE_AGENT_OVERLAP_SWITCH=on with CUDA workers ({WORKER_DEVICE_ENV}="
                             f"{worker_env[WORKER_DEVICE_ENV]}) needs {WORKER_KV_BUDGET_ENV} set: two workers share a "
                             f"GPU while a slot changes model, so both models' weights and two KV budgets must fit it "
                             f"(each worker otherwise takes a share of the memory free when it starts)")
    return True


def replaced_by(slots: list[InstanceSlot], stopping: list[Worker], default_model: str) -> list[list[Worker]]:
    """For each start slot, the stopping workers it replaces, made before break: those on its GPUs, when
    any start on their GPUs serves another model than theirs (a slot that changes model). The others
    (a slot that merely stops, or changes TP degree within one model) are stopped first."""
    def overlaps(worker: Worker, slot: InstanceSlot) -> bool:
        return not set(worker.gpu_ids).isdisjoint(slot.gpu_ids)

    switched_ids = {w.instance_id for w in stopping for slot in slots
                    if overlaps(w, slot) and (slot.model or default_model) != (w.model or default_model)}
    return [[w for w in stopping if w.instance_id in switched_ids and overlaps(w, slot)] for slot in slots]


def ack_status(num_done: int, problems: list[str]) -> PlanAckStatus:
    if not problems:
        return PlanAckStatus.APPLIED
    return PlanAckStatus.PARTIAL if num_done else PlanAckStatus.FAILED


# --- the agent --------------------------------------------------------------------------------------


@dataclass
class Worker:
    """One worker process slot: an instance id on fixed GPUs, and its current process."""

    instance_id: str
    tp: int
    gpu_ids: tuple[int, ...]
    restartable: bool  # restart it when it exits unasked (plan-started workers: once READY)
    model: str = ""  # the served model's name, kept across restarts ("": the agent's first, as in InstanceSlot)
    metrics_port: int = 0  # its /metrics port (NodeAgent.free_metrics_port; 0: none)
    process: asyncio.subprocess.Process | None = None
    spawned_at: float = 0.0  # unix time of the current process's spawn
    stopping: bool = False  # the agent asked it to stop: its exit is expected
    num_crashes: int = 0  # consecutive unasked exits (reset once READY)
    status: WorkerStatus | None = None  # from its last heartbeat
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # READY heartbeat of the current process
    watcher: asyncio.Task | None = None  # waits for the current process to exit (and restarts it)
    last_heard: float = 0.0  # time.monotonic() of its current process's latest heartbeat (or spawn)
    spawned_mono: float = 0.0  # time.monotonic() of its current process's spawn
    killed_pid: int | None = None  # the process the watchdog killed as hung (once)
    started_at: float | None = None  # its current process's started_at, from its heartbeats (its clock)
    previous_started_at: float | None = None  # the process before it's (a late heartbeat of that one is ignored)
    step_running_s: float = 0.0  # as its latest heartbeat reported
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # a restart and a stop never interleave

    def holds(self, slot: InstanceSlot) -> bool:
        return self.tp == slot.tp and self.gpu_ids == tuple(sorted(slot.gpu_ids))

    def describe(self) -> str:
        return f"{self.instance_id} ({self.model}, TP-{self.tp} on GPUs {list(self.gpu_ids)})"


def describe_slot(slot: InstanceSlot) -> str:
    return f"TP-{slot.tp} on GPUs {list(slot.gpu_ids)}" + (f" of model {slot.model!r}" if slot.model else "")


class NodeAgent:
    """Manages the workers of ``settings.node``; ``nc`` is a connected NATS client (set before ``start``)."""

    def __init__(self, settings: NodeAgentSettings, nc, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.nc = nc
        self.clock = clock
        try:
            self.node = check_id(settings.node, "node name")  # it is part of every instance id
        except SubjectError as exc:
            raise AgentError(str(exc)) from None
        if not settings.gpu_ids or len(set(settings.gpu_ids)) != len(settings.gpu_ids):
            raise AgentError(f"GPU ids {settings.gpu_ids} must be a non-empty list without repeats")
        self.gpu_ids = tuple(sorted(settings.gpu_ids))
        try:
            pin(self.gpu_ids, os.environ.get(VISIBLE_DEVICES))  # every GPU id must be one this agent sees
        except DeviceError as exc:
            raise AgentError(f"DLS_NODE_AGENT_GPU_IDS {list(self.gpu_ids)}: {exc}") from None
        self.argv = worker_argv(settings.worker_command)
        self.models = served_models(settings)  # model name -> the served model
        self.model_dirs = {name: m.directory for name, m in self.models.items()}  # model name -> its directory
        self.default_model = next(iter(self.model_dirs))  # a plan's slot that names no model serves this one
        self.boot_slots = initial_slots(self.gpu_ids, settings.initial_instances)
        self.boot_models = boot_models(settings.initial_models, len(self.boot_slots), list(self.model_dirs))
        self.overlap_switch = switch_on(settings.overlap_switch, os.environ)  # the workers get this environment
        self.log_dir = Path(settings.log_dir)
        self.subjects = Subjects(settings.subject_prefix)
        self.workers: dict[str, Worker] = {}  # instance id -> worker (running, starting or awaiting restart)
        self.applying: str | None = None  # id of the plan being applied
        self.num_restarts = 0
        self.num_malformed = 0
        self._closing = False
        self._plan_task: asyncio.Task | None = None
        self._watchdog_task: asyncio.Task | None = None
        self.num_hung_killed = 0
        self._subscriptions: list = []
        self.metrics = NodeAgentMetrics()
        self.metrics.workers.set_function(lambda: len(self.workers))
        for model in self.model_dirs:
            self.metrics.model_workers.labels(model=model).set_function(
                lambda model=model: sum((w.model or self.default_model) == model for w in self.workers.values()))
        # its /metrics also carries its workers' (one scrape target per node, as pod annotations allow)
        own = frozenset(family.name for family in self.metrics.registry.collect())
        self.metrics.registry.register(WorkerMetricsCollector(self.worker_metrics_urls, skip=own))
        self._tracer = tracer("dls.node_agent")

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._subscriptions.append(await self.nc.subscribe(self.subjects.heartbeat, cb=self._on_heartbeat))
        self._subscriptions.append(await self.nc.subscribe(self.subjects.plans, cb=self._on_plan))
        for slot, model in zip(self.boot_slots, self.boot_models, strict=True):
            worker = Worker(new_instance_id(self.node, len(slot), slot), len(slot), slot, restartable=True,
                            model=model, metrics_port=self.free_metrics_port(slot))
            self.workers[worker.instance_id] = worker
            try:
                await self._spawn(worker)
            except OSError as exc:
                raise AgentError(f"cannot run the worker command {shlex.join(self.argv)}: {exc}") from None
        self._watchdog_task = asyncio.create_task(self._watchdog(), name="watchdog")
        logger.info("node agent %s up: GPUs %s, models %s, workers %s, command %s; a slot changing model is %s",
                    self.node, list(self.gpu_ids), self.model_dirs, [w.describe() for w in self.workers.values()],
                    shlex.join(self.argv), "made before break" if self.overlap_switch else "stopped first")

    async def shutdown(self) -> None:
        """Stop taking plans, stop every worker (SIGTERM, then SIGKILL after ``stop_timeout_s``)."""
        self._closing = True
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
            await asyncio.gather(self._watchdog_task, return_exceptions=True)
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        self._subscriptions.clear()
        if self._plan_task is not None and not self._plan_task.done():
            self._plan_task.cancel()
            await asyncio.gather(self._plan_task, return_exceptions=True)
        workers = list(self.workers.values())
        await asyncio.gather(*(self._stop(w) for w in workers))
        self.workers.clear()
        logger.info("node agent %s stopped %d workers", self.node, len(workers))

    # --- processes -------------------------------------------------------------------------------

    def worker_env(self, worker: Worker) -> dict[str, str]:
        """The agent's environment, its connection settings, and the worker's own variables; pinned to
        its GPUs (``CUDA_VISIBLE_DEVICES``: the slot's GPUs, through the agent's own if it has one)."""
        s = self.settings
        model = self.models[worker.model or self.default_model]
        env = dict(os.environ)
        env.update({
            "DLS_NATS_URL": s.nats_url,
            "DLS_REDIS_URL": s.redis_url,
            "DLS_SUBJECT_PREFIX": s.subject_prefix,
            "DLS_REDIS_KEY_PREFIX": s.redis_key_prefix,
            "DLS_MAX_PAYLOAD_BYTES": str(s.max_payload_bytes),
            "DLS_LOG_LEVEL": s.log_level,
            "DLS_TRUST_REMOTE_CODE": str(s.trust_remote_code).lower(),  # workers load the tokenizer too
            "DLS_WORKER_INSTANCE_ID": worker.instance_id,
            "DLS_WORKER_NODE": self.node,
            "DLS_WORKER_GPU_IDS": json.dumps(list(worker.gpu_ids)),
            "DLS_WORKER_TP": str(worker.tp),
            "DLS_WORKER_MODEL_DIR": model.directory,
            "DLS_CALIBRATION_DIR": model.calibration_dir,  # the first model's setting; "": inside its directory
            VISIBLE_DEVICES: pin(worker.gpu_ids, os.environ.get(VISIBLE_DEVICES)),
            # scheduler shards take the node's slots in turn (a hash of a few instance ids can leave one empty)
            "DLS_WORKER_SHARD": str((worker.gpu_ids[0] // worker.tp if worker.gpu_ids else 0) % s.scheduler_shards),
        })
        if s.otel_endpoint:
            env["DLS_OTEL_ENDPOINT"] = s.otel_endpoint
        if "OTEL_SERVICE_NAME" in env:  # the agent's own name is inherited otherwise
            env["OTEL_SERVICE_NAME"] = "dls-worker"
        env["DLS_METRICS_PORT"] = str(worker.metrics_port)
        env["DLS_METRICS_HOST"] = s.metrics_host
        return env

    def free_metrics_port(self, gpu_ids: tuple[int, ...]) -> int:
        """A new worker's /metrics port: the agent's plus one plus its first GPU's position among the agent's
        GPUs; where a worker has that one (the outgoing one of a switch, beside which it starts), the same
        plus the agent's GPU count. Running slots never share a GPU, and a switch puts two workers on it at
        most, so no two workers share a port. 0 when the agent serves none."""
        if not self.settings.metrics_port:
            return 0
        taken = {w.metrics_port for w in self.workers.values()}
        first = self.settings.metrics_port + 1 + self.gpu_ids.index(min(gpu_ids))
        return first if first not in taken else first + len(self.gpu_ids)

    def worker_metrics_urls(self) -> list[str]:
        """The /metrics URLs of the workers running now (on this host)."""
        return [f"http://127.0.0.1:{w.metrics_port}/metrics" for w in self.workers.values()
                if w.metrics_port and w.process is not None and w.process.returncode is None]

    def log_path(self, worker: Worker) -> Path:
        return self.log_dir / f"{worker.instance_id}.log"

    async def _spawn(self, worker: Worker) -> None:
        path = self.log_path(worker)
        with path.open("ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} node agent {self.node}: starting "
                      f"{worker.describe()}: {shlex.join(self.argv)}\n".encode())
            log.flush()
            # NOTE: a session of its own, so a Ctrl-C at the agent's terminal reaches only the agent, which
            # then stops the workers in order; and the worker's whole process group can be killed.
            worker.process = await asyncio.create_subprocess_exec(
                *self.argv, env=self.worker_env(worker), stdin=asyncio.subprocess.DEVNULL, stdout=log,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            )
        worker.spawned_at = self.clock()
        worker.ready.clear()
        worker.status = None
        if worker.started_at is not None:
            worker.previous_started_at = worker.started_at
        worker.started_at, worker.step_running_s = None, 0.0
        worker.last_heard = worker.spawned_mono = time.monotonic()
        worker.watcher = asyncio.create_task(self._watch(worker, worker.process), name=f"watch {worker.instance_id}")
        logger.info("started %s as pid %d (log %s)", worker.describe(), worker.process.pid, path)

    async def _watch(self, worker: Worker, process: asyncio.subprocess.Process) -> None:
        """Wait for ``process`` to exit; restart the worker when it was not asked to stop."""
        code = await process.wait()
        if worker.stopping or self._closing:
            return
        if not worker.restartable:
            logger.warning("%s exited with code %s before it was READY (log %s)", worker.describe(), code,
                           self.log_path(worker))
            return
        worker.num_crashes += 1
        delay = min(self.settings.restart_backoff_max_s, self.settings.restart_backoff_s * 2 ** (worker.num_crashes - 1))
        logger.warning("%s exited unasked with code %s (crash %d in a row; log %s); restarting in %.1f s",
                       worker.describe(), code, worker.num_crashes, self.log_path(worker), delay)
        await asyncio.sleep(delay)
        async with worker.lock:
            if worker.stopping or self._closing or self.workers.get(worker.instance_id) is not worker:
                return
            self.num_restarts += 1
            self.metrics.restarts.inc()
            await self._spawn(worker)

    # --- hung workers ----------------------------------------------------------------------------

    async def _watchdog(self) -> None:
        period = min(1.0, self.settings.hang_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for worker in list(self.workers.values()):
                if self.nc is None or not self.nc.is_connected:
                    worker.last_heard = now  # the agent cannot hear anyone: it judges nobody
                    continue
                problem = hang_problem(worker, now, self.settings.hang_timeout_s, self.settings.start_timeout_s)
                if problem is not None:
                    self._kill_hung(worker, problem)

    def _kill_hung(self, worker: Worker, problem: str) -> None:
        """SIGKILL a hung worker's process group; its watcher restarts it (an unasked exit)."""
        process = worker.process
        if process is None or process.returncode is not None or worker.killed_pid == process.pid:
            return
        logger.warning("%s is hung (%s): killing pid %d; it restarts", worker.describe(), problem, process.pid)
        worker.killed_pid = process.pid  # judged once per process
        self.num_hung_killed += 1
        self.metrics.hung.inc()
        _signal(process.pid, signal.SIGKILL, group=True)

    async def _stop(self, worker: Worker) -> None:
        """SIGTERM (the worker drains and exits), SIGKILL to its process group after ``stop_timeout_s``."""
        worker.stopping = True  # from now on its watcher restarts nothing
        async with worker.lock:  # a restart in progress finishes first, so this stops the latest process
            process = worker.process
            if process is not None and process.returncode is None:
                _signal(process.pid, signal.SIGTERM, group=False)
                try:
                    await asyncio.wait_for(process.wait(), self.settings.stop_timeout_s)
                except TimeoutError:
                    logger.warning("%s still running %g s after SIGTERM: killing it", worker.describe(),
                                   self.settings.stop_timeout_s)
                    _signal(process.pid, signal.SIGKILL, group=True)
                    await process.wait()
            if process is not None:
                _signal(process.pid, signal.SIGKILL, group=True)  # whatever it left behind in its group
                logger.info("stopped %s (exit code %s)", worker.describe(), process.returncode)
        if worker.watcher is not None:
            worker.watcher.cancel()  # it may be sleeping out a restart back-off

    async def _start(self, slot: InstanceSlot, after: Iterable[asyncio.Future] = ()) -> tuple[str | None, str | None]:
        """Once ``after`` (the stops freeing its GPUs) are done, spawn a worker on ``slot`` and wait for it to be
        READY: (instance id, None) or (None, problem)."""
        await asyncio.gather(*after)
        gpu_ids = tuple(sorted(slot.gpu_ids))
        worker = Worker(new_instance_id(self.node, slot.tp, gpu_ids), slot.tp, gpu_ids, restartable=False,
                        model=slot.model or self.default_model, metrics_port=self.free_metrics_port(gpu_ids))
        self.workers[worker.instance_id] = worker
        try:
            await self._spawn(worker)
        except OSError as exc:
            del self.workers[worker.instance_id]
            return None, f"start {describe_slot(slot)}: cannot run {shlex.join(self.argv)} ({exc})"
        problem = await self._wait_ready(worker)
        if problem is None:
            worker.restartable = True
            return worker.instance_id, None
        await self._stop(worker)
        self.workers.pop(worker.instance_id, None)
        return None, f"start {describe_slot(slot)}: {worker.instance_id} {problem} (log {self.log_path(worker)})"

    async def _wait_ready(self, worker: Worker) -> str | None:
        ready = asyncio.ensure_future(worker.ready.wait())
        exited = asyncio.ensure_future(worker.process.wait())
        done, pending = await asyncio.wait({ready, exited}, timeout=self.settings.start_timeout_s,
                                           return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if exited in done:
            return f"exited with code {worker.process.returncode} before it was READY"
        if ready not in done:
            return f"sent no READY heartbeat within {self.settings.start_timeout_s:g} s"
        return None

    # --- messages --------------------------------------------------------------------------------

    async def _on_heartbeat(self, msg) -> None:
        try:
            beat = codec.decode(WorkerHeartbeat, msg.data, self.settings.max_payload_bytes)
        except codec.CodecError as exc:
            self.num_malformed += 1
            self.metrics.malformed.labels(subject="heartbeat").inc()
            logger.debug("ignoring a malformed heartbeat: %s", exc)
            return
        worker = self.workers.get(beat.instance_id)
        if beat.node != self.node or worker is None:
            return
        if worker.previous_started_at is not None and beat.started_at <= worker.previous_started_at:
            return  # a late heartbeat of the process before a restart (both on this node's clock)
        worker.started_at, worker.status = beat.started_at, beat.status
        worker.last_heard, worker.step_running_s = time.monotonic(), beat.step_running_s
        if beat.status == WorkerStatus.READY and not worker.ready.is_set():
            worker.ready.set()
            worker.num_crashes = 0
            logger.info("%s is READY", worker.describe())
            if beat.model != (worker.model or self.default_model):  # a command that ignores DLS_WORKER_MODEL_DIR
                logger.warning("%s says it serves %r, not the model it was started for", worker.describe(), beat.model)

    async def _on_plan(self, msg) -> None:
        try:
            plan = codec.decode(ReconfigPlan, msg.data, self.settings.max_payload_bytes)
        except codec.CodecError as exc:
            self.num_malformed += 1
            self.metrics.malformed.labels(subject="plans").inc()
            logger.error("dropping a malformed plan: %s", exc)
            return
        node_plan = next((n for n in plan.nodes if n.node == self.node), None)
        if node_plan is None:
            return  # a plan for other nodes
        if self._closing or self.applying is not None:
            reason = "the agent is shutting down" if self._closing else f"plan {self.applying} is being applied"
            await self._ack(plan.plan_id, PlanAckStatus.REJECTED, detail=reason)
            return
        self.applying = plan.plan_id
        self._plan_task = asyncio.create_task(self._run_plan(plan.plan_id, node_plan, extract_context(msg.headers)),
                                              name=f"plan {plan.plan_id}")

    async def _run_plan(self, plan_id: str, node_plan: NodePlan, parent=None) -> None:
        # a child of the reconfigurator's plan span (NATS headers)
        span = self._tracer.start_span("node_agent.apply_plan", context=parent,
                                       attributes={"dls.plan_id": plan_id, "dls.node": self.node})
        try:
            started, stopped, problems = await self.apply(node_plan)
            status = ack_status(len(started) + len(stopped), problems)
            span.set_attribute("dls.ack_status", PlanAckStatus(status).name)
            await self._ack(plan_id, status, started, stopped, "; ".join(problems))
        except asyncio.CancelledError:
            await self._ack(plan_id, PlanAckStatus.PARTIAL, detail="the agent shut down while applying the plan")
            raise
        except Exception as exc:  # noqa: BLE001 (the reconfigurator must get an answer)
            logger.exception("plan %s failed", plan_id)
            await self._ack(plan_id, PlanAckStatus.FAILED, detail=f"{type(exc).__name__}: {exc}")
        finally:
            self.applying = None
            span.end()

    async def apply(self, node_plan: NodePlan) -> tuple[list[str], list[str], list[str]]:
        """Stops, then starts: (started instance ids, stopped instance ids, problems). With ``overlap_switch``,
        a start that replaces workers (``replaced_by``) is a switch (``_switch``): it waits for none of the
        other stops, and its replaced workers are stopped only once it is READY."""
        problems: list[str] = []
        to_stop = self._stoppable(node_plan.stop, problems)
        for slot in node_plan.keep:
            if not any(w.holds(slot) for w in self.workers.values()):
                logger.warning("plan keeps %s, but no worker holds it", describe_slot(slot))
        startable = self._startable(node_plan.start, problems, freed={gpu for w in to_stop for gpu in w.gpu_ids})
        replaced = (replaced_by(startable, to_stop, self.default_model) if self.overlap_switch
                    else [[] for _ in startable])
        decided = time.monotonic()
        stops: dict[str, asyncio.Future] = {}  # instance id -> its stop (once, however many starts replace it)

        def stop(worker: Worker) -> asyncio.Future:
            if worker.instance_id not in stops:
                stops[worker.instance_id] = asyncio.ensure_future(self._stop_and_forget(worker))
            return stops[worker.instance_id]

        switched_ids = {w.instance_id for workers in replaced for w in workers}
        first = [stop(w) for w in to_stop if w.instance_id not in switched_ids]  # the GPUs they free idle
        outcomes = await asyncio.gather(*(
            self._switch(slot, workers, stop, decided) if workers else self._start(slot, after=first)
            for slot, workers in zip(startable, replaced, strict=True)))
        await asyncio.gather(*stops.values())
        problems.extend(problem for _, problem in outcomes if problem)
        started = [instance_id for instance_id, _ in outcomes if instance_id]
        return started, list(stops), problems

    def _stoppable(self, slots: list[InstanceSlot], problems: list[str]) -> list[Worker]:
        """The workers the stop slots name; a problem for each slot that names none."""
        to_stop = []
        for slot in slots:
            worker = next((w for w in self.workers.values() if w.holds(slot) and not w.stopping), None)
            if worker is None:
                problems.append(f"stop {describe_slot(slot)}: no worker holds exactly these GPUs")
            elif slot.model and slot.model != worker.model:  # never stop another model's instance
                problems.append(f"stop {describe_slot(slot)}: the worker there, {worker.instance_id}, serves "
                                f"{worker.model!r}")
            else:
                to_stop.append(worker)
        return to_stop

    async def _stop_and_forget(self, worker: Worker) -> None:
        await self._stop(worker)
        self.workers.pop(worker.instance_id, None)

    async def _switch(self, slot: InstanceSlot, replaced: list[Worker], stop: Callable[[Worker], asyncio.Future],
                      decided: float) -> tuple[str | None, str | None]:
        """Make before break: start ``slot`` beside the ``replaced`` workers, which serve meanwhile, and stop them
        (``stop``) once it is READY; where it does not come up they serve on. Its time from the plan's
        decision (``decided``, ``time.monotonic()``) to them stopped is logged and observed."""
        old = ", ".join(w.describe() for w in replaced)
        instance_id, problem = await self._start(slot)
        if instance_id is None:
            return None, f"{problem}; {old} kept serving (not stopped)"
        ready_s = time.monotonic() - decided
        await asyncio.gather(*(stop(w) for w in replaced))
        switch_s = time.monotonic() - decided
        self.metrics.switch_seconds.labels(model=slot.model or self.default_model).observe(switch_s)
        logger.info("switched %s to %s (%s), made before break: READY %.1f s after the plan, the old stopped "
                    "%.1f s later (%.1f s in all)", old, instance_id, describe_slot(slot), ready_s, switch_s - ready_s,
                    switch_s)
        return instance_id, None

    def _startable(self, slots: list[InstanceSlot], problems: list[str], freed: set[int]) -> list[InstanceSlot]:
        """The slots that can be started (``freed``: GPUs of workers the plan stops); a problem for each other."""
        busy = {gpu for w in self.workers.values() for gpu in w.gpu_ids} - freed
        startable = []
        for slot in slots:
            gpus = set(slot.gpu_ids)
            if slot.tp < 1 or len(slot.gpu_ids) != slot.tp or len(gpus) != slot.tp:
                problems.append(f"start {describe_slot(slot)}: a TP-{slot.tp} instance needs {slot.tp} distinct GPUs")
            elif not gpus <= set(self.gpu_ids):
                problems.append(f"start {describe_slot(slot)}: GPUs {sorted(gpus - set(self.gpu_ids))} are not "
                                f"managed by this agent (it has {list(self.gpu_ids)})")
            elif gpus & busy:
                problems.append(f"start {describe_slot(slot)}: GPUs {sorted(gpus & busy)} are in use")
            elif slot.model and slot.model not in self.model_dirs:
                problems.append(f"start {describe_slot(slot)}: model {slot.model!r} is not served by this agent "
                                f"(it serves {', '.join(self.model_dirs)})")
            else:
                busy |= gpus
                startable.append(slot)
        return startable

    async def _ack(self, plan_id: str, status: PlanAckStatus, started: Iterable[str] = (),
                   stopped: Iterable[str] = (), detail: str = "") -> None:
        ack = PlanAck(plan_id=plan_id, node=self.node, status=status, started_instance_ids=list(started),
                      stopped_instance_ids=list(stopped), detail=detail, acked_at=self.clock())
        await self.nc.publish(self.subjects.plans_ack, codec.encode(ack, self.settings.max_payload_bytes))
        log = logger.info if status == PlanAckStatus.APPLIED else logger.warning
        log("plan %s: %s (started %s, stopped %s)%s", plan_id, status.name, ack.started_instance_ids,
            ack.stopped_instance_ids, f": {detail}" if detail else "")


class WorkerMetricsCollector:
    """The node agent's workers' metrics, fetched from their /metrics at each scrape of the agent's, so
    one scrape target per node (``prometheus.io/port`` names one port per pod) covers every worker.
    Families the agent itself has (``dls_malformed_messages``) are left out; a worker that does not
    answer within ``WORKER_SCRAPE_TIMEOUT_S`` is left out of that scrape."""

    def __init__(self, urls: Callable[[], list[str]], skip: frozenset[str] = frozenset()) -> None:
        self.urls = urls  # the workers' /metrics now
        self.skip = skip  # family names not to take from them

    def describe(self) -> list:
        return []  # unknown until scraped (and the registry must not collect at registration)

    def collect(self):
        from prometheus_client.parser import text_string_to_metric_families

        merged: dict[str, object] = {}  # family name -> its samples from every worker
        for url in self.urls():
            try:
                with urllib.request.urlopen(url, timeout=WORKER_SCRAPE_TIMEOUT_S) as reply:
                    text = reply.read().decode()
            except (OSError, ValueError):
                continue
            for family in text_string_to_metric_families(text):
                if family.name in self.skip:
                    continue
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        yield from merged.values()


def _signal(pid: int, sig: signal.Signals, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)  # the worker leads its own process group (start_new_session)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass  # already gone


async def serve(settings: NodeAgentSettings) -> None:
    """Run until SIGTERM or SIGINT, then stop every worker."""

    agent = NodeAgent(settings, None)  # bad settings fail before anything starts
    setup_tracing("dls-node-agent", settings)
    serve_metrics(agent.metrics.registry, settings.metrics_port, settings.metrics_host)
    agent.nc = await connect_nats(settings, f"dls-node-agent-{settings.node}")
    stop = on_stop_signals()
    try:
        await agent.start()
        await stop.wait()
    finally:
        await agent.shutdown()
        await agent.nc.drain()
        shutdown_tracing()
