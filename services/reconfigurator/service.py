"""The reconfigurator service: a periodic loop around the core ``Reconfigurator`` (``core/reconfigurator.py``).

- ``stats``: each ``WorkloadStats`` arrival goes to the core's workload monitor (``observe``).
- ``heartbeat``: the workers' leases are the running configuration: every STARTING or READY instance
  whose lease has not run out is an ``Instance(node, tp, gpu_ids)`` of the cluster's placement
  (DRAINING and STOPPING ones are on their way out).
- Every ``interval_s``: the core's ``step`` on the current cluster (Stage 1, Stage 2, trigger rule, in
  a thread so the loop keeps receiving). A plan the core says to apply is published on ``plans`` as a
  ``ReconfigPlan`` (with ``enabled = false`` it is only logged). Rolling (``rolling``, the default):
  one changed node at a time (``PlacementPlan.waves``), the same plan id with only that node in
  ``nodes``; the next once it acknowledged, i.e. once its new instances are READY, so a shape switch
  never drains more than one node's capacity at once (the simulator applies plans the same way).
- ``plans.ack``: once every node with something to stop or start has answered its ``PlanAck``, the
  plan is done and the core's ``acknowledge`` lets the next one go. Until then (or ``ack_timeout_s``,
  per wave), no other plan is published.
- ``reconfig.apply`` (request/reply, the operator path, ``dls reconfig apply``): an
  ``ApplyConfiguration`` names the instances wanted per TP degree; the core's Stage 2 places them
  with the fewest changes to the running configuration and the plan is published whatever
  ``enabled`` says. The periodic loop may later move away from that shape again: run with
  ``enabled = false`` to keep a manual configuration.

No plan while the service is stopping, nor while no instance is READY (the cluster starting, or
draining at shutdown) and a plan would serve no one: some instance is DRAINING, no arrival came within
the monitor's memory, or (several models) no model with arrivals lacks a running instance
(``_idle_reason``). The plans cost requests with the profile times ``profile_scale`` and the monitor's
block length and cache mode (``monitor_settings``: the settings, else each model's default block).

The cluster (nodes and their GPUs) comes from the ``cluster`` setting (see ``parse_cluster_spec``) or,
when unset, from the nodes and GPUs seen in heartbeats.

Several served models (``model_dirs``): the core is ``ModelsReconfigurator``, one ``ModelDemand`` per
model (its profile, ``switch_s`` and ``min_instances`` settings), and every arrival goes to its
model's monitor (``Arrival.model``). The running instances' models come from their heartbeats (an
instance of a model not served is left out, said once). A plan is a division: each node's plan holds
every model's keep, stop and start slots, each slot naming its model (the node agent stops every
stop before any start), ``instances_by_model`` each model's shape and ``instances_by_tp`` their sum.
Rolling waves, acks and the one-plan-in-flight rule are as with one model. The operator path names
no model, so with several models it is refused.

Scale from zero (several models): a model kept at 0 instances with no load gets requests again when
the gateway admits them (a cold start) and the scheduler queues them. When ``stats`` carry arrivals
of a served model that has no running (STARTING or READY) instance, the service plans at once (an
out-of-period step, ``_plan_now``) rather than at its next period; so it does when a plan completes
while such a model is still waiting (its arrivals came while that plan was in flight). The core
applies a division that starts the model whatever the margin rule says
(``ModelsReconfigurator.models_to_start``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from opentelemetry.trace import SpanKind

from services.reconfigurator.core.files import SpecError, parse_cluster
from services.reconfigurator.core.monitor import ArrivalEvent, MonitorSettings
from services.reconfigurator.core.plan import DivisionPlan, ModelPlacement, PlacementPlan, rolling_waves
from services.reconfigurator.core.plan import ReconfigPlan as CorePlan
from services.reconfigurator.core.planner import ModelsOutcome, PlannerOptions
from services.reconfigurator.core.reconfigurator import (
    ModelsReconfigurator,
    ModelsRound,
    PlanningRound,
    Reconfigurator,
)
from services.reconfigurator.core.solver import SolverOptions
from services.reconfigurator.core.spec import Cluster, Instance, ModelDemand, Workload
from services.reconfigurator.core.stage1 import Stage1Options
from services.reconfigurator.core.stage2 import Stage2Options, solve_stage2
from shared.calibration import uncalibrated_message
from shared.generation import read_generation_limits
from shared.leases import LeaseTable
from shared.messages import codec
from shared.messages.base import CacheMode
from shared.messages.control import (
    ApplyConfiguration,
    ApplyConfigurationReply,
    InstanceSlot,
    NodePlan,
    PlanAck,
    PlanAckStatus,
    ReconfigPlan,
    WorkerHeartbeat,
    WorkerStatus,
    WorkloadStats,
)
from shared.metrics import ReconfiguratorMetrics, serve_metrics
from shared.profiles import LatencyProfile
from shared.runtime import connect_nats, on_stop_signals
from shared.served import model_name, served_models_of
from shared.settings import DEFAULT_MIN_INSTANCES, DEFAULT_SWITCH_S, ReconfiguratorSettings
from shared.subjects import Subjects
from shared.telemetry import inject_headers, setup_tracing, shutdown_tracing, tracer

logger = logging.getLogger("dls.reconfigurator")

CLUSTER_SETTING = "DLS_RECONFIGURATOR_CLUSTER"
_LIVE = (WorkerStatus.STARTING, WorkerStatus.READY)  # statuses that hold their GPUs in the configuration


# --- conversions and the cluster spec --------------------------------------------------------------


def parse_cluster_spec(spec: str, profile_tp_degrees: tuple[int, ...]) -> Cluster:
    """The cluster named by the ``cluster`` setting: inline JSON, or the path of a JSON file.

    Two forms: ``{"nodes": {"local": 4}}`` (node -> number of GPUs, ids 0..n-1, or -> list of GPU
    ids), or the cluster file of ``dls reconfig solve`` (``{"nodes": [{"name": ..., "gpu_ids": [...]}]}``).
    Both may add ``tp_degrees`` (default: the profile's degrees that fit on a node). A ``placement``
    is refused: the running instances come from heartbeats. ``SpecError`` names what is wrong.
    """
    text, source = spec.strip(), CLUSTER_SETTING
    if not text.startswith("{"):
        source = text
        try:
            text = Path(text).read_text()
        except OSError as exc:
            raise SpecError(f"{source}: cannot read the cluster spec ({exc.strerror}); give a JSON object "
                            'such as {"nodes": {"local": 4}} or the path of a JSON file') from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a JSON object with 'nodes'")
    if "placement" in data:
        raise SpecError(f"{source}: placement: leave it out, the running instances come from heartbeats")
    nodes = data.get("nodes")
    if isinstance(nodes, dict):  # the short form: node -> GPU count or GPU ids
        data["nodes"] = [
            {"name": name, "gpu_ids": list(range(gpus)) if isinstance(gpus, int) else gpus}
            for name, gpus in nodes.items()
        ]
    return parse_cluster(data, profile_tp_degrees, source)


def arrival_event(arrival) -> ArrivalEvent:
    """A wire ``Arrival`` as the monitor's ``ArrivalEvent`` (the two mirror each other)."""
    return ArrivalEvent(time_s=arrival.time_s, prompt_tokens=arrival.prompt_tokens,
                        output_tokens=arrival.output_tokens, slo_s=arrival.slo_s)


def wire_node_plans(placement: PlacementPlan, model: str = "") -> list[NodePlan]:
    """One model's per-node lists as the wire's, each slot naming ``model`` ("": the agent's own)."""
    def slots(instances: tuple[Instance, ...]) -> list[InstanceSlot]:
        return [InstanceSlot(tp=i.tp, gpu_ids=list(i.gpu_ids), model=model) for i in instances]

    return [NodePlan(node=n.node, keep=slots(n.keep), stop=slots(n.stop), start=slots(n.start))
            for n in placement.nodes]


def wire_model_node_plans(placement: ModelPlacement) -> list[NodePlan]:
    """Every model's per-node lists merged into one plan per node (sorted by node), each slot naming
    its model: a slot that changes model is one model's stop and another's start on the same node."""
    node_to_parts: dict[str, list[NodePlan]] = {}  # node -> each model's plan there
    for model, plan in placement.by_model.items():
        for part in wire_node_plans(plan, model):
            node_to_parts.setdefault(part.node, []).append(part)
    return [NodePlan(node=node, keep=[s for p in parts for s in p.keep], stop=[s for p in parts for s in p.stop],
                     start=[s for p in parts for s in p.start])
            for node, parts in sorted(node_to_parts.items())]


def wire_plan(plan: CorePlan, created_at: float) -> ReconfigPlan:
    """The core's plan (Stage 1 capacity + Stage 2 placement) as published on ``plans``."""
    capacity = plan.capacity
    instances_by_tp = {tp: n for tp, n in sorted(capacity.instances_by_tp.items()) if n}
    return ReconfigPlan(
        plan_id=plan.plan_id,
        created_at=created_at,
        nodes=wire_node_plans(plan.placement),
        instances_by_tp=instances_by_tp,
        batch_by_tp={tp: capacity.batch_by_tp[tp] for tp in instances_by_tp if tp in capacity.batch_by_tp},
        avg_threshold=capacity.avg_threshold,
        fallback_reason=capacity.fallback_reason,
    )


def wire_division(outcome: ModelsOutcome, created_at: float) -> ReconfigPlan:
    """A division between models (``ModelsReconfigurator``) as published on ``plans``: no
    ``batch_by_tp`` (each model has its own batches, in the division's per-model plans)."""
    division = outcome.division
    instances_by_model = {model: {tp: n for tp, n in sorted(by_tp.items()) if n}
                          for model, by_tp in division.instances_by_model_tp.items()}
    instances_by_tp: Counter[int] = Counter()  # tp degree -> every model's instances
    for by_tp in instances_by_model.values():
        instances_by_tp.update(by_tp)
    return ReconfigPlan(
        plan_id=outcome.plan_id,
        created_at=created_at,
        nodes=wire_model_node_plans(outcome.placement),
        instances_by_tp=dict(sorted(instances_by_tp.items())),
        instances_by_model=instances_by_model,
        avg_threshold=division.objective.avg_threshold if division.objective else None,
        fallback_reason=division.fallback_reason,
    )


def division_summary(division: DivisionPlan | None) -> str:
    """``a 3 GPUs {1: 3}, b 1 GPUs {1: 1}``: each model's GPUs and instances per degree (for logs)."""
    if division is None:
        return "nothing running"
    return ", ".join(f"{model} {division.gpus_by_model[model]} GPUs "
                     f"{ {tp: n for tp, n in sorted(by_tp.items()) if n} }"
                     for model, by_tp in division.instances_by_model_tp.items())


def model_demands(settings: ReconfiguratorSettings, profiles: Mapping[str, LatencyProfile]) -> list[ModelDemand]:
    """One ``ModelDemand`` per served model (its workload empty: the core fills it from the model's
    monitor): its profile and degrees, its ``switch_s`` and ``min_instances`` settings, the one KV budget.
    ``ValueError`` when ``profiles`` are not of the served models."""
    served = [model_name(d) for d in settings.served_model_dirs]
    if list(profiles) != served:
        raise ValueError(f"profiles of {', '.join(profiles)}, but DLS_RECONFIGURATOR_MODEL_DIRS serves "
                         f"{', '.join(served)}")
    switch_s, min_instances = settings.switch_s_by_model, settings.min_instances_by_model
    return [ModelDemand(model, Workload(()), profile, switch_s=switch_s.get(model, DEFAULT_SWITCH_S),
                        min_instances=min_instances.get(model, DEFAULT_MIN_INSTANCES),
                        tp_degrees=profile.tp_degrees, kv_budget_bytes=None)
            for model, profile in profiles.items()]


def monitor_settings(settings: ReconfiguratorSettings) -> dict[str, MonitorSettings]:
    """Each served model's workload monitor settings (model name -> them), in serving order: the window
    settings, the cache mode (``DLS_RECONFIGURATOR_CACHE``) and the block length the planner counts steps
    in (``DLS_RECONFIGURATOR_BLOCK_LENGTH``, else the model's default block from its directory, as the
    gateway gives a request that sets none). ``ValueError`` naming a model's unusable lengths file."""
    common = dict(window_s=settings.window_s, min_window_s=min(10.0, settings.window_s),
                  kv_cache=settings.cache != CacheMode.NONE,  # prefix is planned as dual: one cache-step curve
                  **({} if settings.peak_windows is None else {"peak_windows": settings.peak_windows}))
    return {model_name(d): MonitorSettings(block_length=settings.block_length or
                                           read_generation_limits(d).block_length, **common)
            for d in settings.served_model_dirs}


def operator_plan(plan_id: str, instances_by_tp: dict[int, int], placement: PlacementPlan,
                  created_at: float) -> ReconfigPlan:
    """An operator's shape placed by Stage 2 (no Stage 1: no batch sizes or objective)."""
    return ReconfigPlan(plan_id=plan_id, created_at=created_at, nodes=wire_node_plans(placement),
                        instances_by_tp={tp: n for tp, n in sorted(instances_by_tp.items()) if n})


# --- the service ------------------------------------------------------------------------------------


@dataclass
class AwaitedPlan:
    """A published plan waiting for the acks of the nodes it changes."""

    plan_id: str
    issued_at: float
    node_ids: set[str]  # nodes still to answer
    operator: bool  # published on an operator's request (the core does not track it)
    node_to_status: dict[str, PlanAckStatus] = field(default_factory=dict)  # node -> its answer
    plan: ReconfigPlan | None = None  # the whole plan (rolling: published one wave at a time)
    waves: list[list[NodePlan]] = field(default_factory=list)  # rolling: the waves not published yet


def plan_ids() -> Iterator[str]:
    """Unique across restarts of the service: ``plan-<run token>-<n>``."""
    run = uuid.uuid4().hex[:6]
    return (f"plan-{run}-{n}" for n in itertools.count(1))


def tp_degrees_of(profiles: Mapping[str, LatencyProfile]) -> tuple[int, ...]:
    """The degrees the cluster is planned at: every degree some model's profile knows (each model is
    held to its own profile's, ``ModelDemand.tp_degrees``)."""
    return tuple(sorted({d for p in profiles.values() for d in p.tp_degrees}))


class ReconfiguratorService:
    """Feeds the core from ``stats`` and ``heartbeat``, publishes its plans, collects the acks.

    ``profile``: the one served model's profile, or model name -> profile, one per served model (more
    than one: the GPUs are divided between them, ``ModelsReconfigurator``)."""

    def __init__(self, settings: ReconfiguratorSettings, nc, profile: LatencyProfile | Mapping[str, LatencyProfile],
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.nc = nc
        self.profiles = dict(profile) if isinstance(profile, Mapping) else {"": profile}  # model -> its profile
        self.profile = next(iter(self.profiles.values()))  # one model's (several: the first's)
        self.models = tuple(self.profiles) if len(self.profiles) > 1 else ()  # the models divided; (): one model
        self.clock = clock
        self.subjects = Subjects(settings.subject_prefix)
        self.tp_degrees = tp_degrees_of(self.profiles)
        self.configured = parse_cluster_spec(settings.cluster, self.tp_degrees) if settings.cluster else None
        self.plan_ids = plan_ids()
        self.stage2 = Stage2Options(SolverOptions(time_limit_s=settings.solver_time_limit_s, mip_rel_gap=0.0))
        self.model_to_monitor = monitor_settings(settings)  # served model name -> its workload monitor's settings
        self.core = self._make_core()
        self.leases = LeaseTable()  # the instances heard within their lease (counted from receipt)
        self.node_to_seen_gpu_ids: dict[str, set[int]] = {}  # node -> GPUs its instances held (default cluster)
        self.awaited: dict[str, AwaitedPlan] = {}  # plan id -> plan waiting for acks
        self.num_arrivals = 0
        self.num_plans_published = 0
        self.num_plans_completed = 0  # every node it changes acknowledged it
        self.num_malformed = 0
        self._planning = asyncio.Lock()  # one step or operator plan at a time
        # arrivals (each with its model) held while the core steps in a thread
        self._held_arrivals: list[tuple[ArrivalEvent, str]] | None = None
        self._warned: set[str] = set()  # instance ids already warned about
        self._subscriptions: list = []
        self._tasks: list[asyncio.Task] = []
        self._out_of_period: asyncio.Task | None = None  # a step for a model to start, pending or running
        self.num_out_of_period_steps = 0
        self.last_arrival_at: float | None = None  # when the latest arrival (of any model) was received
        self.stopping = False  # stop() began: no more plans
        self.metrics = ReconfiguratorMetrics()
        self._tracer = tracer("dls.reconfigurator")

    def _make_core(self) -> Reconfigurator | ModelsReconfigurator:
        settings = self.settings
        model_to_monitor = self.model_to_monitor
        options = PlannerOptions(stage1=Stage1Options(solver=SolverOptions(time_limit_s=settings.solver_time_limit_s),
                                                      kv_budget_bytes=settings.kv_budget_bytes),
                                 stage2=self.stage2)
        common = dict(margin=settings.improvement_margin, ack_timeout_s=settings.ack_timeout_s, plan_ids=self.plan_ids)
        if not self.models:
            monitor = next(iter(model_to_monitor.values()))
            return Reconfigurator(self.profile, self.clock, monitor, options, **common)
        return ModelsReconfigurator(model_demands(settings, self.profiles), self.clock, model_to_monitor, options,
                                    hedge_share=settings.hedge_share, **common)

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self, periodic: bool = True) -> None:
        for subject, handler in ((self.subjects.stats, self._on_stats), (self.subjects.heartbeat, self._on_heartbeat),
                                 (self.subjects.plans_ack, self._on_ack),
                                 (self.subjects.reconfig_apply, self._on_apply)):
            self._subscriptions.append(await self.nc.subscribe(subject, cb=handler))
        if periodic:
            self._tasks.append(asyncio.create_task(self._periodic(), name="reconfigure"))
        cluster = "heartbeats" if self.configured is None else f"{len(self.configured.nodes)} configured nodes"
        logger.info("reconfigurator up: every %.0f s, cluster from %s, %s%s", self.settings.interval_s, cluster,
                    "publishing plans" if self.settings.enabled else "observe only", self._models_said())

    def _models_said(self) -> str:
        if not self.models:
            return ""
        demands = self.core.models.values()
        return ", dividing the GPUs between " + ", ".join(
            f"{d.name} (switch {d.switch_s:g} s, at least {d.min_instances})" for d in demands)

    async def stop(self) -> None:
        self.stopping = True  # a step in flight publishes nothing now
        tasks = [*self._tasks, *([self._out_of_period] if self._out_of_period else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        self._subscriptions.clear()

    async def _periodic(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.step()
            except Exception:  # noqa: BLE001 (a failed solve must not end the loop; the next period retries)
                logger.exception("reconfiguration step failed")

    # --- inputs ----------------------------------------------------------------------------------

    def _decode(self, type_, data: bytes):
        try:
            return codec.decode(type_, data, self.settings.max_payload_bytes)
        except codec.CodecError as exc:
            self.num_malformed += 1
            self.metrics.malformed.labels(subject=type_.__name__).inc()
            logger.error("dropping a malformed message: %s", exc)
            return None

    async def _on_stats(self, msg) -> None:
        stats = self._decode(WorkloadStats, msg.data)
        if stats is None:
            return
        events = [(arrival_event(a), a.model) for a in stats.arrivals]
        self.num_arrivals += len(events)
        if events:
            self.last_arrival_at = self.clock()
        if self._held_arrivals is not None:  # the core is stepping in a thread: feed them afterwards
            self._held_arrivals.extend(events)
        else:
            for event, model in events:
                self.core.observe(event, model)  # one model: the model is not looked at
        self._start_models_now({model for _, model in events})

    def _start_models_now(self, arrived: set[str] | None = None) -> None:
        """Plan now (not at the next period) when a served model has arrivals (``arrived``: the models of
        the stats just received; None: those the core has in its window) and no running instance: its
        requests wait for one (scale from zero)."""
        if not self.models:
            return
        running_models = self.configuration()[1]
        if arrived is None:
            if self._held_arrivals is not None:
                return  # a step is running, and plans with them
            arrived = set(self.core.models_to_start(running_models))
        waiting = sorted(arrived & set(self.models) - set(running_models.values()))
        if waiting:
            self._plan_now(f"{', '.join(waiting)}: arrivals and no running instance")

    def _plan_now(self, why: str) -> None:
        """One out-of-period step, unless one is pending already (it sees every arrival held so far)."""
        if self.stopping or (self._out_of_period is not None and not self._out_of_period.done()):
            return
        self.num_out_of_period_steps += 1
        logger.info("planning now, out of period: %s", why)
        self._out_of_period = asyncio.create_task(self._step_logged(), name="reconfigure-now")

    async def _step_logged(self) -> None:
        try:
            await self.step()
        except Exception:  # noqa: BLE001 (as a periodic step: the next trigger retries)
            logger.exception("out-of-period reconfiguration step failed")

    async def _on_heartbeat(self, msg) -> None:
        beat = self._decode(WorkerHeartbeat, msg.data)
        if beat is None:
            return
        self.leases.observe(beat, self.clock())
        self.node_to_seen_gpu_ids.setdefault(beat.node, set()).update(beat.gpu_ids)

    async def _on_ack(self, msg) -> None:
        ack = self._decode(PlanAck, msg.data)
        if ack is None:
            return
        awaited = self.awaited.get(ack.plan_id)
        if awaited is None:
            logger.info("ack from %s for plan %s, which is not awaited (done or timed out): %s", ack.node,
                        ack.plan_id, ack.status.name)
            return
        awaited.node_to_status[ack.node] = ack.status
        awaited.node_ids.discard(ack.node)
        log = logger.info if ack.status == PlanAckStatus.APPLIED else logger.warning
        log("plan %s on %s: %s (started %s, stopped %s)%s", ack.plan_id, ack.node, ack.status.name,
            ack.started_instance_ids, ack.stopped_instance_ids, f": {ack.detail}" if ack.detail else "")
        if not awaited.node_ids:
            if awaited.waves:
                await self._publish_wave(awaited)
            else:
                self._complete(awaited)

    def _complete(self, awaited: AwaitedPlan) -> None:
        del self.awaited[awaited.plan_id]
        self.core.acknowledge(awaited.plan_id)  # False for operator plans: the core never issued them
        self.num_plans_completed += 1
        outcome = {node: status.name for node, status in sorted(awaited.node_to_status.items())}
        logger.info("plan %s answered by every node it changes: %s", awaited.plan_id, outcome or "nothing to do")
        self._start_models_now()  # arrivals of a model to start that came while this plan was in flight

    # --- the configuration -----------------------------------------------------------------------

    def cluster(self) -> Cluster | None:
        """Nodes, GPUs and the running instances now; None while no node is known."""
        return self.configuration()[0]

    def configuration(self) -> tuple[Cluster | None, dict[Instance, str]]:
        """The cluster with its running instances, and the model of each (instance -> the model its
        heartbeats name); (None, {}) while no node is known."""
        base = self.configured or self._seen_cluster()
        if base is None:
            return None, {}
        running_models = self._placement(base)
        return base.with_placement(tuple(sorted(running_models))), running_models

    def _seen_cluster(self) -> Cluster | None:
        nodes = [{"name": node, "gpu_ids": sorted(gpus)} for node, gpus in sorted(self.node_to_seen_gpu_ids.items())
                 if gpus]
        return parse_cluster({"nodes": nodes}, self.tp_degrees, "GPUs seen in heartbeats") if nodes else None

    def _placement(self, cluster: Cluster) -> dict[Instance, str]:
        """The live instances that fit ``cluster`` (instance -> its model); the others are said once."""
        now = self.clock()
        self.leases.expire(now)  # silent for longer than their lease: gone
        name_to_gpus = {n.name: set(n.gpu_ids) for n in cluster.nodes}
        placement: dict[Instance, str] = {}  # instance -> its model
        for lease in self.leases:
            beat, instance_id = lease.heartbeat, lease.instance_id
            if beat.status not in _LIVE:
                continue
            problem = self._misfit(beat, name_to_gpus, cluster.tp_degrees)
            if problem is None:
                placement[Instance(beat.node, beat.tp, tuple(sorted(beat.gpu_ids)))] = beat.model
            elif instance_id not in self._warned:
                self._warned.add(instance_id)
                logger.warning("instance %s left out of the configuration: %s", instance_id, problem)
        return placement

    def _misfit(self, beat: WorkerHeartbeat, name_to_gpus: dict[str, set[int]],
                tp_degrees: tuple[int, ...]) -> str | None:
        if beat.node not in name_to_gpus:
            return f"node {beat.node!r} is not in the cluster spec"
        if beat.tp not in tp_degrees:
            return f"TP degree {beat.tp} is not planned for (degrees {list(tp_degrees)})"
        if len(beat.gpu_ids) != beat.tp or not set(beat.gpu_ids) <= name_to_gpus[beat.node]:
            return f"GPUs {list(beat.gpu_ids)} are not {beat.tp} GPUs of node {beat.node!r}"
        if self.models and beat.model not in self.models:
            return f"its model {beat.model!r} is not served (served: {', '.join(self.models)})"
        if self.models and beat.tp not in self.profiles[beat.model].tp_degrees:
            return f"TP degree {beat.tp} is not in {beat.model}'s profile"
        return None

    def _expire_awaited(self) -> None:
        now = self.clock()
        for awaited in [a for a in self.awaited.values() if now - a.issued_at >= self.settings.ack_timeout_s]:
            del self.awaited[awaited.plan_id]
            logger.warning("plan %s timed out waiting for acks from %s", awaited.plan_id, sorted(awaited.node_ids))

    def _in_flight_reason(self) -> str | None:
        self._expire_awaited()
        if not self.awaited:
            return None
        plan = next(iter(self.awaited.values()))
        return f"plan {plan.plan_id} is still waiting for acknowledgement from {sorted(plan.node_ids)}"

    def _idle_reason(self, running_models: dict[Instance, str]) -> str | None:
        """Why no plan is made although the cluster is known: the service is stopping, or no instance is
        READY (the cluster is starting, draining at shutdown, or empty) and a plan would serve no one: no
        arrivals, or (several models) no model with arrivals that lacks an instance (on an empty cluster,
        only such a model is planned for: scale from zero). None: plan."""
        if self.stopping:
            return "the service is stopping"
        num_by_status = Counter(lease.heartbeat.status for lease in self.leases)  # status -> live instances
        if num_by_status[WorkerStatus.READY]:
            return None
        if num_by_status[WorkerStatus.DRAINING]:
            return f"no instance is READY and {num_by_status[WorkerStatus.DRAINING]} are draining"
        if self.models:
            if self.core.models_to_start(running_models):
                return None
            return "no instance is READY and every model with arrivals has one starting, or none has arrivals"
        if self._has_arrivals():
            return None
        return "no instance is READY and no arrivals"

    def _has_arrivals(self) -> bool:
        """An arrival received within the monitor's memory (``peak_windows`` windows), whose rates plan."""
        if self.last_arrival_at is None:
            return False
        monitor = next(iter(self.model_to_monitor.values()))
        return self.clock() - self.last_arrival_at < monitor.window_s * max(1, monitor.peak_windows)

    # --- plans -----------------------------------------------------------------------------------

    async def step(self) -> PlanningRound | ModelsRound | None:
        """One period: the core's step on the current cluster; publish the plan it says to apply."""
        async with self._planning:
            waiting = self._in_flight_reason()
            if waiting is not None:
                logger.info("no reconfiguration this period: %s", waiting)
                return None
            cluster, running_models = self.configuration()
            if cluster is None:
                logger.info("no reconfiguration this period: no node known yet (set %s or start workers)",
                            CLUSTER_SETTING)
                return None
            idle = self._idle_reason(running_models)
            if idle is not None:
                logger.info("no reconfiguration this period: %s", idle)
                return None
            self._held_arrivals = []
            try:
                result = await asyncio.to_thread(self._core_step, cluster, running_models)
            finally:
                held, self._held_arrivals = self._held_arrivals, None
                for event, model in held:
                    self.core.observe(event, model)
            plan = result.plan_to_apply
            if plan is not None and self.stopping:  # stop() came while the core stepped
                logger.info("plan %s not published: the service is stopping", plan.plan_id)
                self.core.acknowledge(plan.plan_id)
                return result
            logger.info("reconfiguration: %s (%s)", "apply " + plan.plan_id if plan else "keep", result.decision.reason)
            if plan is not None:
                wire = self._wire(plan)
                if self.models:
                    logger.info("plan %s divides the GPUs: %s (running: %s)", plan.plan_id,
                                division_summary(plan.division), division_summary(plan.current))
                    hedge = getattr(self.core, "last_hedge", None)
                    if hedge is not None:
                        logger.info("plan %s planned each model for: %s", plan.plan_id, hedge.describe())
                if self.settings.enabled:
                    await self._publish(wire, operator=False)
                    if self.models and plan.division is not None:
                        self.metrics.set_division({m: plan.division.gpus_by_model.get(m, 0) for m in self.models})
                else:
                    # Observe only: nothing will acknowledge the plan, so free the core's in-flight slot now.
                    self.core.acknowledge(plan.plan_id)
                    logger.info("observe only: plan %s not published (%s)", plan.plan_id, wire.instances_by_tp)
            return result

    def _core_step(self, cluster: Cluster, running_models: dict[Instance, str]) -> PlanningRound | ModelsRound:
        if self.models:
            return self.core.step(cluster, running_models)
        return self.core.step(cluster)

    def _wire(self, plan: CorePlan | ModelsOutcome) -> ReconfigPlan:
        if isinstance(plan, ModelsOutcome):
            return wire_division(plan, self.clock())
        return wire_plan(plan, self.clock())

    async def apply(self, request: ApplyConfiguration) -> ApplyConfigurationReply:
        """The operator path: place ``request.instances_by_tp`` with Stage 2 and publish it."""
        async with self._planning:
            waiting = self._in_flight_reason()
            if waiting is not None:
                return ApplyConfigurationReply(error=waiting)
            if self.models:
                return ApplyConfigurationReply(error=f"the cluster is divided between {', '.join(self.models)}, and "
                                                     "an ApplyConfiguration names no model: not supported with "
                                                     "several models")
            cluster = self.cluster()
            if cluster is None:
                return ApplyConfigurationReply(error=f"no node known yet: set {CLUSTER_SETTING} or start workers")
            bad = {tp: n for tp, n in request.instances_by_tp.items() if n < 0}
            if bad:
                return ApplyConfigurationReply(error=f"negative instance counts: {bad}")
            try:
                placement = await asyncio.to_thread(solve_stage2, request.instances_by_tp, cluster, self.stage2)
            except Exception as exc:  # noqa: BLE001 (Stage2Infeasible, solver failures: the operator reads why)
                return ApplyConfigurationReply(error=f"{type(exc).__name__}: {exc}")
            plan = operator_plan(next(self.plan_ids), request.instances_by_tp, placement, self.clock())
            logger.info("operator plan %s%s: %s", plan.plan_id,
                        f" (requested by {request.requested_by})" if request.requested_by else "", plan.instances_by_tp)
            await self._publish(plan, operator=True)
            return ApplyConfigurationReply(plan_id=plan.plan_id, nodes=plan.nodes)

    async def _on_apply(self, msg) -> None:
        request = self._decode(ApplyConfiguration, msg.data)
        reply = ApplyConfigurationReply(error="malformed ApplyConfiguration") if request is None else None
        if reply is None:
            try:
                reply = await self.apply(request)
            except Exception as exc:  # noqa: BLE001 (answer the operator whatever happened)
                logger.exception("operator plan failed")
                reply = ApplyConfigurationReply(error=f"{type(exc).__name__}: {exc}")
        if msg.reply:
            await msg.respond(codec.encode(reply, self.settings.max_payload_bytes))

    async def _publish(self, plan: ReconfigPlan, operator: bool) -> None:
        """Publish a plan: every node at once, or (``rolling``) one wave of changed nodes at a time,
        the next once the previous wave's nodes acknowledged (``_on_ack``)."""
        changed = {n.node for n in plan.nodes if n.stop or n.start}
        waves = [list(w) for w in rolling_waves(plan.nodes)] if self.settings.rolling else []
        awaited = AwaitedPlan(plan.plan_id, self.clock(), set() if waves else changed, operator, plan=plan,
                              waves=waves)
        self.awaited[plan.plan_id] = awaited  # before publishing: an ack may come back at once
        self.num_plans_published += 1
        self.metrics.plans.inc()
        shape = plan.instances_by_model or plan.instances_by_tp
        logger.info("published plan %s: %s, changing nodes %s%s", plan.plan_id, shape, sorted(changed),
                    f" in {len(waves)} waves" if len(waves) > 1 else "")
        if waves:
            await self._publish_wave(awaited)
            return
        await self._send(plan, sorted(changed), operator)
        if not changed:
            self._complete(awaited)

    async def _publish_wave(self, awaited: AwaitedPlan) -> None:
        """The next wave of a rolling plan: the plan message with only that wave's nodes."""
        nodes = awaited.waves.pop(0)
        awaited.node_ids = {n.node for n in nodes}
        awaited.issued_at = self.clock()  # each wave gets the whole ack timeout
        await self._send(msgspec.structs.replace(awaited.plan, nodes=nodes), sorted(awaited.node_ids),
                         awaited.operator)

    async def _send(self, plan: ReconfigPlan, changed: list[str], operator: bool) -> None:
        with self._tracer.start_as_current_span("reconfigurator.plan", kind=SpanKind.PRODUCER, attributes={
                "dls.plan_id": plan.plan_id, "dls.operator": operator, "dls.changed_nodes": changed}):
            await self.nc.publish(self.subjects.plans, codec.encode(plan, self.settings.max_payload_bytes),
                                  headers=inject_headers() or None)  # the node agents' spans continue it


def planning_profile(settings: ReconfiguratorSettings) -> str | None:
    """The profile the plans are made with: ``DLS_RECONFIGURATOR_PROFILE``, else the served model's
    calibration's (``CalibrationMismatch`` when it was made for other weights); None: uncalibrated."""
    if settings.profile:
        return settings.profile
    calibration = served_models_of(settings, "DLS_RECONFIGURATOR_MODEL_DIRS")[0].calibration()
    return str(calibration.profile_path) if calibration is not None else None


def planning_profiles(settings: ReconfiguratorSettings) -> dict[str, str | None]:
    """Each served model's planning profile (model name -> path; None: uncalibrated), first first:
    ``DLS_RECONFIGURATOR_PROFILE`` for every one when set, else each model's calibration's
    (``shared.served``: ``DLS_CALIBRATION_DIR`` is the first model's; ``CalibrationMismatch`` when a bundle
    was made for other weights). ``DuplicateModelName`` (a ``ValueError``) when two directories share a name."""
    profiles: dict[str, str | None] = {}  # model name -> its profile's path
    for model in served_models_of(settings, "DLS_RECONFIGURATOR_MODEL_DIRS"):
        if settings.profile:
            profiles[model.name] = settings.profile
            continue
        calibration = model.calibration()
        profiles[model.name] = str(calibration.profile_path) if calibration is not None else None
    return profiles


def loaded_profiles(settings: ReconfiguratorSettings) -> LatencyProfile | dict[str, LatencyProfile] | None:
    """What the service plans with: one model's profile, or (several models) model name -> profile;
    None when a served model is uncalibrated (said): with no profile of its own, a model can be neither
    planned nor divided from (another model's numbers would mislead), so the service makes no plans."""
    if len(settings.served_model_dirs) == 1:
        path = planning_profile(settings)
        if path is None:  # uncalibrated: no profile of this model to plan with, and another model's would mislead
            logger.warning("%s; the reconfigurator makes no plans for it (the cluster keeps the shape it started "
                           "with)", uncalibrated_message(settings.served_model_dirs[0]))
            return None
        return scaled(LatencyProfile.load(path), settings.profile_scale)
    paths = planning_profiles(settings)
    uncalibrated = [d for d, path in zip(settings.served_model_dirs, paths.values(), strict=True) if path is None]
    for model_dir in uncalibrated:
        logger.warning("%s; the reconfigurator makes no plans while any served model is uncalibrated: the GPUs stay "
                       "divided as they started (or set DLS_RECONFIGURATOR_PROFILE to plan every model with one "
                       "profile)", uncalibrated_message(model_dir))
    if uncalibrated:
        return None
    return {name: scaled(LatencyProfile.load(path), settings.profile_scale) for name, path in paths.items()}


def scaled(profile: LatencyProfile, scale: float) -> LatencyProfile:
    """``profile`` with its latencies times ``DLS_RECONFIGURATOR_PROFILE_SCALE`` (paced workers step at the
    pace profile's times this many times over: planned at 1x, the cluster looks ``scale`` times faster)."""
    return profile if scale == 1.0 else profile.scaled(scale)


async def serve(settings: ReconfiguratorSettings) -> None:
    """Run until SIGTERM or SIGINT."""

    profiles = loaded_profiles(settings)  # bad files fail first
    if profiles is None:
        await on_stop_signals().wait()
        return
    service = ReconfiguratorService(settings, None, profiles)
    setup_tracing("dls-reconfigurator", settings)
    serve_metrics(service.metrics.registry, settings.metrics_port, settings.metrics_host)
    nc = await connect_nats(settings, "dls-reconfigurator")
    service.nc = nc
    stop = on_stop_signals()
    await service.start()
    try:
        await stop.wait()
    finally:
        await service.stop()
        await nc.drain()
        logger.info("reconfigurator stopped: %d arrivals seen, %d plans published, %d completed",
                    service.num_arrivals, service.num_plans_published, service.num_plans_completed)
        shutdown_tracing()
