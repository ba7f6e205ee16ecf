"""What the reconfigurator plans for: the workload (request classes) and the cluster (nodes, GPUs,
current instances). Plain frozen dataclasses; ``files.py`` builds them from JSON and validates them,
the workload monitor builds a ``Workload`` from arrival events.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from shared.profiles import LatencyProfile

DEFAULT_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9)
DEFAULT_SAFETY_BUFFER = 0.2
DEFAULT_BLOCK_LENGTH = 32
# The paper's default SLO: 5x the isolated TP-1 latency at the highest threshold.
DEFAULT_SLO_FACTOR = 5.0
SINGLE_MODEL = ""  # the model's name where one model is planned (solve_stage1, solve_stage2)


@dataclass(frozen=True)
class StepCounts:
    """Predicted denoising steps of one request at one threshold, split by cost."""

    recompute: float  # full forward steps (one per block with a KV cache; every step without)
    cache: float  # cheap steps over the current block only

    @property
    def total(self) -> float:
        return self.recompute + self.cache


@dataclass(frozen=True)
class RequestClass:
    """Requests with similar prompt and output lengths, planned for as one aggregate."""

    name: str
    prompt_tokens: int
    output_tokens: int
    rate: float  # measured arrivals per second (before the safety buffer)
    slo_s: float | None = None  # None: the workload's default SLO
    # threshold -> predicted steps; thresholds missing here come from the default predictor table
    steps_by_threshold: dict[float, StepCounts] = field(default_factory=dict)


@dataclass(frozen=True)
class Workload:
    """Request classes with their rates plus the knobs that Stage 1 needs about them."""

    classes: tuple[RequestClass, ...]
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS
    safety_buffer: float = DEFAULT_SAFETY_BUFFER  # planned rate = rate * (1 + safety_buffer)
    block_length: int = DEFAULT_BLOCK_LENGTH
    kv_cache: bool = True  # False: every step is a recompute step
    slo_s: float | None = None  # default SLO for classes without their own
    slo_factor: float = DEFAULT_SLO_FACTOR  # used when neither the class nor the workload sets slo_s
    # threshold -> tokens committed per step on average (the class-level predictor table)
    tokens_per_step: dict[float, float] | None = None

    def planned_rate(self, request_class: RequestClass) -> float:
        return request_class.rate * (1.0 + self.safety_buffer)

    def with_rate_scale(self, scale: float) -> Workload:
        """The same workload with every class's rate multiplied by ``scale`` (for sweeps)."""
        classes = tuple(
            RequestClass(
                c.name, c.prompt_tokens, c.output_tokens, c.rate * scale, c.slo_s, c.steps_by_threshold
            )
            for c in self.classes
        )
        return Workload(
            classes,
            self.thresholds,
            self.safety_buffer,
            self.block_length,
            self.kv_cache,
            self.slo_s,
            self.slo_factor,
            self.tokens_per_step,
        )

    @property
    def total_rate(self) -> float:
        return sum(c.rate for c in self.classes)


@dataclass(frozen=True, order=True)
class Instance:
    """A model instance of TP degree ``tp`` on ``len(gpu_ids) == tp`` GPUs of one node."""

    node: str
    tp: int
    gpu_ids: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"node": self.node, "tp": self.tp, "gpu_ids": list(self.gpu_ids)}


@dataclass(frozen=True)
class Node:
    name: str
    gpu_ids: tuple[int, ...]  # sorted; slot k of degree d is gpu_ids[k*d:(k+1)*d]

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_ids)

    def num_slots(self, tp: int) -> int:
        return self.num_gpus // tp

    def slot_gpu_ids(self, tp: int, slot: int) -> tuple[int, ...]:
        return self.gpu_ids[slot * tp : (slot + 1) * tp]


@dataclass(frozen=True)
class Cluster:
    """Nodes, the TP degrees allowed on them, and the instances running now."""

    nodes: tuple[Node, ...]
    tp_degrees: tuple[int, ...]  # ascending; each divides the next
    placement: tuple[Instance, ...] = ()

    @property
    def num_gpus(self) -> int:
        return sum(n.num_gpus for n in self.nodes)

    def num_slots(self, tp: int) -> int:
        return sum(n.num_slots(tp) for n in self.nodes)

    def current_instances_by_tp(self) -> dict[int, int]:
        # tp degree -> number of current instances
        counts = Counter(inst.tp for inst in self.placement)
        return {tp: counts.get(tp, 0) for tp in self.tp_degrees}

    def with_placement(self, placement: tuple[Instance, ...]) -> Cluster:
        return Cluster(self.nodes, self.tp_degrees, tuple(placement))


def uniform_cluster(num_nodes: int, gpus_per_node: int, tp_degrees: tuple[int, ...]) -> Cluster:
    """``num_nodes`` identical nodes named node-0.. with GPUs 0..gpus_per_node-1 and nothing running."""
    nodes = tuple(Node(f"node-{i}", tuple(range(gpus_per_node))) for i in range(num_nodes))
    return Cluster(nodes, tuple(sorted(tp_degrees)))


@dataclass(frozen=True)
class ModelDemand:
    """One model of several sharing a cluster: its load, its calibration and what moving it costs.

    ``switch_s`` is the seconds from deciding to start one of its instances to that instance serving
    (drain the GPUs' previous instance, stop it, load this model's weights, warm up): from the
    model's calibration or measured at start. ``min_instances`` is what it keeps with no load (0: it
    may be scaled to zero). ``tp_degrees`` restricts the degrees it may run at (None: the cluster's),
    e.g. a model whose weights need two GPUs; ``kv_budget_bytes`` is its KV memory per GPU (None:
    ``Stage1Options.kv_budget_bytes``), which with its profile's KV bytes per token bounds its batches.
    """

    name: str
    workload: Workload
    profile: LatencyProfile
    switch_s: float = 0.0
    min_instances: int = 0
    tp_degrees: tuple[int, ...] | None = None
    kv_budget_bytes: int | None = None

    @property
    def has_load(self) -> bool:
        return bool(self.workload.classes) and self.workload.total_rate > 0
