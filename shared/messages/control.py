"""Cluster control: worker heartbeats (leases), workload stats, reconfiguration plans and their acks.

Workers publish a ``WorkerHeartbeat`` every few seconds (subject ``heartbeat``); every reader treats
an instance as gone when no heartbeat arrived within its ``ttl_s`` (``shared.leases``). The scheduler publishes
``WorkloadStats`` (subject ``stats``) for the reconfigurator's workload monitor. The reconfigurator
publishes a ``ReconfigPlan`` (subject ``plans``), mirroring ``services.reconfigurator.core.plan``;
each node agent answers with a ``PlanAck`` (subject ``plans.ack``). An operator asks the
reconfigurator for a given shape with ``ApplyConfiguration`` (request/reply on ``reconfig.apply``);
the reply names the plan it published.
"""

from __future__ import annotations

from enum import IntEnum

from shared.messages.base import Message, Part


class WorkerStatus(IntEnum):
    """Where a worker is in its life, as it reports it."""

    STARTING = 0  # loading the model; takes no steps yet
    READY = 1  # takes step commands
    DRAINING = 2  # finishing its resident requests; give it no new ones
    STOPPING = 3  # about to exit; its lease ends now


class KVMemory(Part, kw_only=True):
    """A worker's KV pool as its heartbeat reports it (``services.worker.kv.pages.KVMemory``); per GPU of
    the instance (every tensor-parallel rank holds the same pages for its own heads)."""

    budget_bytes: int = 0  # the pool's cap (0: none)
    pool_bytes: int = 0  # allocated now
    used_bytes: int = 0  # in pages requests hold
    free_bytes: int = 0  # budget less used (0 with no budget)
    used_tokens: int = 0  # positions requests hold
    free_tokens: int = 0  # positions the free bytes hold
    capacity_tokens: int = 0  # positions the scheduler may place here, summed over requests (0: no budget)
    bytes_per_token: int = 0  # one position, every layer
    page_tokens: int = 0  # positions per page


class MeasuredSteps(Part, kw_only=True):
    """Step times a worker measured itself (ms per batch size), for a model served without a
    calibration: the scheduler plans the instance with them (``shared.profiles.online_profile``)."""

    context_tokens: int  # the context its recompute times apply at
    block_length: int  # the model's default block
    recompute_ms: dict[int, float]  # batch size -> a recompute step's time (a block start with a KV cache)
    cache_ms: dict[int, float]  # batch size -> a cache step's time
    full_ms: dict[int, float] = {}  # batch size -> a step with no cache
    served_steps: int = 0  # served steps folded in since it started


class WorkerHeartbeat(Message, kw_only=True):
    """A worker's lease: it is alive and serving ``model`` for ``ttl_s`` after this heartbeat *arrives*
    (on the receiver's clock: ``shared.leases``; ``sent_at`` is informational, hosts' clocks differ)."""

    instance_id: str  # the instance (also the token of its step subject)
    node: str  # the node it runs on
    tp: int  # tensor-parallel degree
    gpu_ids: list[int] = []  # GPUs it holds on the node (empty on CPU)
    max_batch: int  # most requests one step may carry
    model: str  # the model it serves
    profile: str = ""  # latency profile the scheduler should use for it (name or path)
    profile_scale: float = 1.0  # its steps take this many times the profile's latencies (paced workers)
    profile_context_tokens: int = 0  # the context its paced latencies apply at (0: the profile's own)
    status: WorkerStatus = WorkerStatus.READY  # its state
    num_resident: int = 0  # requests whose local copy (and KV cache) it holds
    ttl_s: float  # the lease lasts this long after the heartbeat arrives
    sent_at: float  # unix time (s) of this heartbeat
    started_at: float = 0.0  # unix time (s) the worker started (a change means it restarted)
    metrics_port: int = 0  # port of its Prometheus /metrics endpoint on its node; 0: none
    shard: int = 0  # the scheduler shard that owns this instance (DLS_SCHEDULER_SHARDS > 1)
    seq: int = 0  # counts this process's heartbeats from 1 (orders them; 0: a sender that does not count)
    step_running_s: float = 0.0  # how long its current step has been computing (s, its monotonic clock); 0: idle
    kv: KVMemory | None = None  # its KV pool (None: an engine that keeps none)
    measured: MeasuredSteps | None = None  # with no profile (uncalibrated): the step times it measures


class Arrival(Part, kw_only=True):
    """One request arrival; mirrors ``services.reconfigurator.core.monitor.ArrivalEvent`` plus the
    model, which picks the workload monitor the event goes to (one per served model)."""

    time_s: float  # unix time (s) of arrival
    prompt_tokens: int  # prompt length
    output_tokens: int  # requested generation length
    slo_s: float | None = None  # the request's latency SLO, when it has its own
    model: str = ""  # the model the request names; "": none named (counted as the first served model's)


class WorkloadStats(Message, kw_only=True):
    """The scheduler's report for one window: arrivals and how the cluster coped."""

    window_start: float  # unix time (s), inclusive
    window_end: float  # unix time (s), exclusive
    arrivals: list[Arrival] = []  # every arrival in the window, in order
    num_finished: int = 0  # requests that finished in the window
    num_slo_met: int = 0  # of which within their SLO
    num_rejected: int = 0  # requests rejected at admission
    num_in_flight: int = 0  # requests admitted and not finished at window_end
    mean_threshold: float | None = None  # mean threshold of the window's steps; None: no steps


class InstanceSlot(Part, kw_only=True):
    """A model instance of TP degree ``tp`` on GPUs of one node; mirrors the planner's ``Instance``."""

    tp: int  # tensor-parallel degree
    gpu_ids: list[int]  # the node's GPUs it occupies (len == tp)
    model: str = ""  # the model it serves (a served model's name); "": the node agent's own model


class NodePlan(Part, kw_only=True):
    """What one node's agent does: keep these instances, stop these, then start these."""

    node: str  # the node
    keep: list[InstanceSlot] = []  # instances left running
    stop: list[InstanceSlot] = []  # instances to stop first
    start: list[InstanceSlot] = []  # instances to start once the stops are done


class ReconfigPlan(Message, kw_only=True):
    """One reconfiguration (Stage 1 capacity + Stage 2 placement), named by ``plan_id``."""

    plan_id: str  # acknowledgements name it
    created_at: float  # unix time (s) the plan was made
    nodes: list[NodePlan]  # per-node keep/stop/start lists
    instances_by_tp: dict[int, int]  # tp degree -> instances once applied (every model's)
    instances_by_model: dict[str, dict[int, int]] = {}  # model -> tp degree -> instances (several models)
    batch_by_tp: dict[int, int] = {}  # tp degree -> batch size Stage 1 planned
    avg_threshold: float | None = None  # Stage 1's primary objective; None: fallback plan
    fallback_reason: str | None = None  # set when Stage 1 was infeasible and this is all-TP-1


class PlanAckStatus(IntEnum):
    """How a node agent dealt with its part of a plan."""

    APPLIED = 0  # every stop and start done
    PARTIAL = 1  # some done; ``detail`` says which failed
    FAILED = 2  # nothing changed
    REJECTED = 3  # not applied (stale plan id, unknown node, another plan in progress)


class PlanAck(Message, kw_only=True):
    """A node agent's answer to a plan."""

    plan_id: str  # the plan
    node: str  # the node answering
    status: PlanAckStatus  # outcome
    started_instance_ids: list[str] = []  # instances it started
    stopped_instance_ids: list[str] = []  # instances it stopped
    detail: str = ""  # what failed, when something did
    acked_at: float  # unix time (s) of the answer


class ApplyConfiguration(Message, kw_only=True):
    """An operator's request: publish a plan that moves the running instances to this shape."""

    instances_by_tp: dict[int, int]  # tp degree -> instances wanted (degrees left out: none)
    requested_by: str = ""  # who asked (logged with the plan)


class ApplyConfigurationReply(Message, kw_only=True):
    """The reconfigurator's answer to ``ApplyConfiguration``."""

    plan_id: str = ""  # the plan it published; empty when it published none
    nodes: list[NodePlan] = []  # that plan's per-node keep/stop/start lists
    error: str | None = None  # why no plan was published (infeasible shape, plan in flight, ...)
