"""The simulated cluster: nodes of GPUs, instances of a TP degree on aligned GPU slots, and the
execution of the reconfigurator's Stage 2 plans (drain and stop, then start after a start-up time).

Instances are registered in the scheduler's ``ClusterView`` (the only instance state policies
read). A stopped instance is drained first (``StepScheduler.drain_instance``: it takes no new work,
its requests move at their next step) and removed once empty (by the scheduling core, as live;
``release`` then frees its GPUs); an instance the plan starts waits for its GPUs to be free, then for
``startup_s`` (model load), then joins the view.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.reconfigurator.core.spec import Cluster, Instance, Node
from services.scheduler.core import ClusterView
from shared.profiles import LatencyProfile
from sim.workload import DEFAULT_MODEL


@dataclass(frozen=True)
class ClusterSpec:
    num_nodes: int = 4
    gpus_per_node: int = 4
    initial_tp: tuple[int, ...] = (1,) * 16  # TP degree of each instance at the start
    tp_degrees: tuple[int, ...] = (1, 2, 4)  # degrees the reconfigurator may use
    max_batch: int | None = None  # None: the profile's largest batch
    reconfigure: bool = False
    reconfig_period_s: float = 60.0  # the paper: every few minutes
    reconfig_window_s: float = 60.0  # the workload monitor's sliding window
    reconfig_peak_windows: int | None = None  # MonitorSettings.peak_windows (None: the monitor's default)
    startup_s: float = 10.0  # model load of a started instance
    rolling: bool = True  # apply a plan node by node (``PlacementPlan.waves``); False: every node at once
    migration_base_s: float = 0.002  # per migration: stop-and-copy of token state (tens of KB)
    migration_s_per_token: float = 1e-6
    # KV memory per GPU for caches (0: each instance's default, max batch x the profile's context);
    # an instance holds tp * kv_budget_bytes / the profile's kv_bytes_per_token context tokens
    kv_budget_bytes: int = 0
    model: str = DEFAULT_MODEL  # the model every instance serves (requests name theirs: RequestSpec.model)
    # several models: a slot that changes model loads the incoming model while the outgoing one still
    # serves on it (both models' weights fit a GPU), then drains it (one step plus migration): make
    # before break. False: the outgoing instance drains first and the GPUs idle through the load
    overlap_switch: bool = False

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def kv_tokens(self, profile: LatencyProfile, tp: int) -> int | None:
        """A TP-``tp`` instance's KV memory in context tokens under ``kv_budget_bytes`` (None: no budget)."""
        if not self.kv_budget_bytes:
            return None
        tokens = profile.kv_tokens(tp, self.kv_budget_bytes)
        if tokens is None:
            raise ValueError(f"a KV budget needs the profile's kv_bytes_per_token; {profile.model} has none")
        return tokens

    def node_names(self) -> list[str]:
        return [f"node-{i}" for i in range(self.num_nodes)]


def initial_placement(spec: ClusterSpec) -> list[Instance]:
    """Pack the initial instances, largest degree first, into aligned slots node by node."""
    free = {name: list(range(spec.gpus_per_node)) for name in spec.node_names()}
    placed = []
    for tp in sorted(spec.initial_tp, reverse=True):
        for name in spec.node_names():
            slot = _aligned_free_slot(free[name], tp, spec.gpus_per_node)
            if slot is not None:
                placed.append(Instance(name, tp, slot))
                free[name] = [g for g in free[name] if g not in slot]
                break
        else:
            raise ValueError(f"initial instances {spec.initial_tp} do not fit {spec.num_nodes}x{spec.gpus_per_node} GPUs")
    return placed


def _aligned_free_slot(free: list[int], tp: int, num_gpus: int) -> tuple[int, ...] | None:
    for start in range(0, num_gpus - tp + 1, tp):
        slot = tuple(range(start, start + tp))
        if all(g in free for g in slot):
            return slot
    return None


@dataclass
class PendingStart:
    instance: Instance
    plan_id: str
    model: str | None = None  # the model it starts (None: the cluster's one model)
    replaces: tuple[Instance, ...] = ()  # make before break: instances on its GPUs drained once it is up


@dataclass
class SimCluster:
    """Instances in the view plus GPU ownership, draining and pending starts."""

    spec: ClusterSpec
    profile: LatencyProfile
    view: ClusterView
    id_to_instance: dict[str, Instance] = field(default_factory=dict)  # instance id -> placement
    gpu_to_owner: dict[tuple[str, int], str] = field(default_factory=dict)  # (node, gpu) -> instance id
    draining_ids: set[str] = field(default_factory=set)
    pending: list[PendingStart] = field(default_factory=list)
    plan_to_num_pending: dict[str, int] = field(default_factory=dict)  # plan id -> starts not up yet
    num_started: int = 0
    # several models: each model's profile (absent: every instance is spec.model on ``profile``)
    profiles: dict[str, LatencyProfile] = field(default_factory=dict)
    model_of: dict[str, str] = field(default_factory=dict)  # instance id -> the model it serves

    def start_now(self, instance: Instance, model: str | None = None) -> str:
        """Register an instance of ``model`` (None: the spec's one model) immediately (initial
        placement, or after its start-up)."""
        model = model or self.spec.model
        profile = self.profiles.get(model, self.profile)
        self.num_started += 1
        iid = f"{instance.node}/g{instance.gpu_ids[0]}-{instance.gpu_ids[-1]}#{self.num_started}"
        self.view.add_instance(iid, instance.tp, profile, node_id=instance.node, max_batch=self.spec.max_batch,
                               mem_limit_tokens=self.spec.kv_tokens(profile, instance.tp), model=model)
        self.id_to_instance[iid] = instance
        self.model_of[iid] = model
        for gpu in instance.gpu_ids:
            self.gpu_to_owner[(instance.node, gpu)] = iid
        return iid

    def reserve(self, instance: Instance) -> None:
        for gpu in instance.gpu_ids:
            self.gpu_to_owner[(instance.node, gpu)] = "<starting>"

    def drain(self, instance: Instance) -> str | None:
        """Mark an instance to stop (the scheduling core drains it in the view); its id, or None if
        it is not running or already draining."""
        iid = self.instance_id_of(instance)
        if iid is None or iid in self.draining_ids:
            return None
        self.draining_ids.add(iid)
        return iid

    def release(self, iid: str) -> None:
        """A drained instance left the view (the scheduling core removed it): its GPUs are free."""
        self.draining_ids.discard(iid)
        self.model_of.pop(iid, None)
        instance = self.id_to_instance.pop(iid)
        for gpu in instance.gpu_ids:
            if self.gpu_to_owner.get((instance.node, gpu)) == iid:
                del self.gpu_to_owner[(instance.node, gpu)]

    def gpus_free(self, instance: Instance) -> bool:
        return all((instance.node, g) not in self.gpu_to_owner for g in instance.gpu_ids)

    def instance_id_of(self, instance: Instance) -> str | None:
        for iid, placed in self.id_to_instance.items():
            if placed == instance:
                return iid
        return None

    def placement(self) -> tuple[Instance, ...]:
        """Running instances that are not draining (what the reconfigurator plans from)."""
        return tuple(sorted(inst for iid, inst in self.id_to_instance.items() if iid not in self.draining_ids))

    def as_reconfig_cluster(self) -> Cluster:
        nodes = tuple(Node(name, tuple(range(self.spec.gpus_per_node))) for name in self.spec.node_names())
        return Cluster(nodes, tuple(sorted(self.spec.tp_degrees)), self.placement())

    def running_models(self) -> dict[Instance, str]:
        """The model of each running instance that is not draining (what ``plan_models`` reads)."""
        return {inst: self.model_of[iid] for iid, inst in self.id_to_instance.items() if iid not in self.draining_ids}

    def gpus_by_model(self) -> dict[str, int]:
        """GPUs each model's live (non-draining) instances hold."""
        out: dict[str, int] = {}
        for inst, model in self.running_models().items():
            out[model] = out.get(model, 0) + inst.tp
        return out

    def instances_by_tp(self) -> dict[int, int]:
        # tp degree -> live (non-draining) instances
        counts: dict[int, int] = {}
        for inst in self.placement():
            counts[inst.tp] = counts.get(inst.tp, 0) + 1
        return counts

    def migration_s(self, context_tokens: int) -> float:
        return self.spec.migration_base_s + self.spec.migration_s_per_token * context_tokens
