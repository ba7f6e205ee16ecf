"""Named experiment presets mirroring the paper's, each with a ``--quick`` size for checks.

A preset fixes the cluster, the workload, the x axis (request rates as multiples of the cluster's
nominal capacity, or a list of workload variants), the policies compared and the engine. Policies are
scheduler-core names, or *variants* (a label for a core policy with config overrides, e.g. the
migration ablation's ``dilaserve-any-step``).

Admission is the same FCFS queue for every policy and early rejection (``reject_infeasible``) is off:
a request that cannot make its deadline still runs and counts as a miss. That keeps the comparison
about scheduling and threshold control; rejection would help every policy's attainment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from services.scheduler.core import CacheMode
from shared.tasks import LONG_BLOCK_LENGTH, LONG_CANVAS
from sim.cluster import ClusterSpec
from sim.registry import Registry
from sim.workload import SloClass, WorkloadConfig

BASELINES = ("infaas", "llumnix")  # the paper's baselines, which every comparing preset runs beside its own policies
BENCH_POLICIES = ("dilaserve", *BASELINES)
ALL_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9)  # the paper's whole candidate set

# label -> (core policy name, config overrides)
VARIANTS: dict[str, tuple[str, dict]] = {
    "dilaserve-any-step": ("dilaserve", {"migrate_at_recompute_only": False}),
    "fixed-0.9": ("fixed", {"fixed_threshold": 0.9}),
    # a quality floor: candidate thresholds 0.8 and up only (trades SLO attainment for accuracy)
    "dilaserve-floor-0.8": ("dilaserve", {"thresholds": (0.8, 0.9)}),
    # the paper's whole candidate set, whatever it costs the bundled model in accuracy
    "dilaserve-all-thresholds": ("dilaserve", {"thresholds": ALL_THRESHOLDS}),
}
# the load-control experiment: Algorithm 1 per step or once per request (at its first placement, with
# the prediction made at arrival), within the quality budget or over all five thresholds, each with
# and without Algorithm 2
_PLAN_ONCE = {"plan_once": True, "prediction": "oneshot"}
for _label, _overrides in (("dilaserve-all-thresholds", {"thresholds": ALL_THRESHOLDS}),
                           ("dilaserve-plan-once", _PLAN_ONCE),
                           ("dilaserve-plan-once-all-thresholds", {**_PLAN_ONCE, "thresholds": ALL_THRESHOLDS})):
    VARIANTS[_label] = ("dilaserve", _overrides)  # (dilaserve itself and dilaserve-no-loadctl: core policies)
    VARIANTS[f"{_label}-no-loadctl"] = ("dilaserve", {**_overrides, "load_control": False})
LOADCTL_POLICIES = ("dilaserve", "dilaserve-no-loadctl", "dilaserve-all-thresholds", "dilaserve-all-thresholds-no-loadctl",
                    "dilaserve-plan-once", "dilaserve-plan-once-no-loadctl", "dilaserve-plan-once-all-thresholds",
                    "dilaserve-plan-once-all-thresholds-no-loadctl")


@dataclass(frozen=True)
class Point:
    """One x-axis point: a rate multiple and optional workload overrides."""

    rate_mult: float
    label: str = ""
    workload: dict = field(default_factory=dict)  # WorkloadConfig overrides


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    cluster: ClusterSpec
    workload: WorkloadConfig
    points: tuple[Point, ...]
    policies: tuple[str, ...] = BENCH_POLICIES
    engine: str = "replay"
    cache_mode: CacheMode = CacheMode.DUAL
    fidelity_policies: tuple[str, ...] = ()  # also run these with the model in the loop and compare
    capacity_policy: str = "fixed-0.9"  # what "nominal capacity" is measured with (analytically)
    sample_period_s: float = 1.0
    # LLaDA-8B steps per request at 0.9 (256 tokens at ~3.2 tokens/step); each bundled-model step is
    # timed as this / the bundled model's steps per request (see sim/README.md). None: one to one.
    llada_steps_per_request: float | None = 80.0
    reconfigure_policies: tuple[str, ...] = ("dilaserve",)
    thresholds: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9)  # the paper's candidates, before the budget
    # DiLaServe's candidates: those of `thresholds` whose accuracy, as the replay trace measured it on
    # the bundled model, is at most this many points below the highest's (within_quality_budget);
    # None: all of them. A variant with its own "thresholds" is not filtered.
    quality_budget_pp: float | None = 1.0
    quick_overrides: dict = field(default_factory=dict)  # applied by quick()
    seed: int = 0

    def quick(self) -> Preset:
        changes = dict(self.quick_overrides)
        workload = dataclasses.replace(self.workload, **changes.pop("workload", {}))
        cluster = dataclasses.replace(self.cluster, **changes.pop("cluster", {}))
        return dataclasses.replace(self, workload=workload, cluster=cluster, quick_overrides={}, **changes)


def resolve_policy(label: str) -> tuple[str, dict]:
    """(core policy name, overrides) for a policy name or a variant label."""
    return VARIANTS.get(label, (label, {}))


PRESETS: Registry[Preset] = Registry("preset")

_BENCH_CLUSTER = ClusterSpec(num_nodes=4, gpus_per_node=4, initial_tp=(1,) * 16, reconfigure=False)
_BENCH_RATES = (0.25, 0.5, 1.0, 1.5, 2.0)
_QUICK_RATES = (0.5, 1.0, 2.0)


def _rate_points(mults) -> tuple[Point, ...]:
    return tuple(Point(m) for m in mults)


PRESETS.register(
    "paper-bench",
    Preset(
        "paper-bench",
        "Paper 5.3 / Fig. 9: 16 TP-1 instances, no reconfiguration, 5-shot prompts, SLO 5x isolated "
        "TP-1 latency at 0.9, Poisson arrivals from light to 2x the fixed-0.9 capacity",
        _BENCH_CLUSTER,
        WorkloadConfig(arrival="poisson", num_requests=4000, num_shots=5),
        _rate_points(_BENCH_RATES),
        cache_mode=CacheMode.NONE,
        fidelity_policies=("dilaserve",),
        quick_overrides={"workload": {"num_requests": 1000}, "points": _rate_points(_QUICK_RATES)},
    ),
)

PRESETS.register(
    "paper-trace",
    Preset(
        "paper-trace",
        "Paper 5.2 / Fig. 8: 16 GPUs on 4 nodes, reconfiguration over TP {1,2,4}, bursty BurstGPT-like "
        "arrivals with peaks at 2.5x the mean (or --trace, scaled to each point's mean rate), ShareGPT-like "
        "lengths (a trace's own), mean rates 0.6-1.5x nominal capacity; SLO attainment, latency, configuration "
        "over time",
        ClusterSpec(num_nodes=4, gpus_per_node=4, initial_tp=(1,) * 16, reconfigure=True,
                    reconfig_period_s=30.0, reconfig_window_s=30.0, startup_s=3.0),
        WorkloadConfig(arrival="burstgpt-like", lengths="sharegpt-like", num_requests=10**6, duration_s=600.0,
                       period_s=300.0, peak_to_mean=2.5),
        _rate_points((0.6, 0.9, 1.2, 1.5)),
        cache_mode=CacheMode.NONE,
        sample_period_s=5.0,
        quick_overrides={"workload": {"duration_s": 240.0, "period_s": 120.0},
                         "cluster": {"reconfig_period_s": 15.0, "reconfig_window_s": 15.0}},
    ),
)

PRESETS.register(
    "ablation-threshold",
    Preset(
        "ablation-threshold",
        "Paper Fig. 10: fixed threshold vs SLO-aware threshold vs SLO-aware + load control",
        _BENCH_CLUSTER,
        WorkloadConfig(arrival="poisson", num_requests=4000, num_shots=5),
        _rate_points((0.5, 1.0, 1.5, 2.0)),
        policies=("fixed-0.9", "dilaserve-no-loadctl", "dilaserve", *BASELINES),
        cache_mode=CacheMode.NONE,
        quick_overrides={"workload": {"num_requests": 1200}, "points": _rate_points((1.0, 2.0))},
    ),
)

PRESETS.register(
    "ablation-loadctl",
    Preset(
        "ablation-loadctl",
        "What load control (Algorithm 2) adds: Algorithm 1 per step or once per request, within the "
        "quality budget or over all five thresholds, each with and without it",
        _BENCH_CLUSTER,
        WorkloadConfig(arrival="poisson", num_requests=4000, num_shots=5),
        _rate_points((1.0, 2.0, 3.0)),
        policies=(*LOADCTL_POLICIES, *BASELINES),
        cache_mode=CacheMode.NONE,
        quick_overrides={"workload": {"num_requests": 1200}, "points": _rate_points((1.0, 2.0, 3.0))},
    ),
)

PRESETS.register(
    "ablation-predictor",
    Preset(
        "ablation-predictor",
        "Paper Fig. 6: one-shot vs online remaining-step prediction",
        _BENCH_CLUSTER,
        WorkloadConfig(arrival="poisson", num_requests=4000, num_shots=5),
        _rate_points((1.0, 1.5, 2.0)),
        policies=("dilaserve-oneshot", "dilaserve", *BASELINES),
        cache_mode=CacheMode.NONE,
        quick_overrides={"workload": {"num_requests": 1200}, "points": _rate_points((1.0, 2.0))},
    ),
)

PRESETS.register(
    "ablation-migration",
    Preset(
        "ablation-migration",
        "Paper App. E: migration off / at any step / at recompute steps only",
        _BENCH_CLUSTER,
        WorkloadConfig(arrival="gamma", cv=3.0, num_requests=4000, num_shots=5),
        _rate_points((0.5, 1.0, 1.5)),
        policies=("dilaserve-no-migration", "dilaserve-any-step", "dilaserve", *BASELINES),
        cache_mode=CacheMode.DUAL,
        quick_overrides={"workload": {"num_requests": 1200}, "points": _rate_points((1.0,))},
    ),
)

PRESETS.register(
    "ablation-cache",
    Preset(
        "ablation-cache",
        "Paper App. F, the other way round: paper-bench with the dual KV cache on (paper-bench runs "
        "without one, see sim/README.md)",
        _BENCH_CLUSTER,
        WorkloadConfig(arrival="poisson", num_requests=4000, num_shots=5),
        _rate_points((0.5, 1.0, 2.0)),
        cache_mode=CacheMode.DUAL,
        quick_overrides={"workload": {"num_requests": 1200}, "points": _rate_points((1.0, 2.0))},
    ),
)

PRESETS.register(
    "sweep-input",
    Preset(
        "sweep-input",
        "Paper Fig. 12 (left): few-shot count 0, 2, 5, 8 at 1.5x capacity",
        _BENCH_CLUSTER,
        WorkloadConfig(arrival="poisson", num_requests=3000),
        tuple(Point(1.5, f"shots={k}", {"num_shots": k}) for k in (0, 2, 5, 8)),
        policies=BENCH_POLICIES,
        cache_mode=CacheMode.NONE,
        quick_overrides={"workload": {"num_requests": 800},
                         "points": tuple(Point(1.5, f"shots={k}", {"num_shots": k}) for k in (0, 8))},
    ),
)

PRESETS.register(
    "sweep-output",
    Preset(
        "sweep-output",
        "Paper Fig. 12 (right): generation length 16, 24, 32 at 1.5x capacity (answers end early: "
        "longer canvases cost context, not steps)",
        _BENCH_CLUSTER,
        WorkloadConfig(arrival="poisson", num_requests=3000, num_shots=5),
        tuple(Point(1.5, f"gen={g}", {"gen_len": g}) for g in (16, 24, 32)),
        policies=BENCH_POLICIES,
        cache_mode=CacheMode.NONE,
        quick_overrides={"workload": {"num_requests": 800},
                         "points": tuple(Point(1.5, f"gen={g}", {"gen_len": g}) for g in (16, 32))},
    ),
)

PRESETS.register(
    "mixed-slo",
    Preset(
        "mixed-slo",
        "Paper 3.5: two SLO classes, 'interactive' (3x, priority 2: load control keeps its full range) "
        "and 'batch' (10x, priority 0), 30/70",
        _BENCH_CLUSTER,
        WorkloadConfig(arrival="poisson", num_requests=4000, num_shots=5,
                       slo_classes=(SloClass("interactive", 3.0, priority=2, weight=0.3),
                                    SloClass("batch", 10.0, priority=0, weight=0.7))),
        _rate_points((1.0, 1.5, 2.0)),
        cache_mode=CacheMode.NONE,
        quick_overrides={"workload": {"num_requests": 1000}, "points": _rate_points((1.0, 2.0))},
    ),
)

PRESETS.register(
    "tiny",
    Preset(
        "tiny",
        "A few hundred requests on 4 TP-1 instances, for tests",
        ClusterSpec(num_nodes=1, gpus_per_node=4, initial_tp=(1,) * 4),
        WorkloadConfig(arrival="poisson", num_requests=150, num_shots=5),
        _rate_points((1.0, 2.0)),
        quick_overrides={"workload": {"num_requests": 80}},
    ),
)

PRESETS.register(
    "live-local",
    Preset(
        "live-local",
        "The local stack of `dls up --workers 2 --pace profiles/llada-8b-h100.json` (paced as setup says): 2 TP-1 "
        "instances (max batch 16 as the workers), no reconfiguration, no KV cache, 5-shot prompts; replay the "
        "arrivals `dls loadgen` sent with --trace (docs/live-vs-sim.md)",
        ClusterSpec(num_nodes=1, gpus_per_node=2, initial_tp=(1, 1), max_batch=16, reconfigure=False),
        WorkloadConfig(arrival="poisson", num_requests=1000, num_shots=5),
        (Point(1.0),),
        policies=("dilaserve",),
        cache_mode=CacheMode.NONE,
        quick_overrides={"workload": {"num_requests": 100}},
    ),
)

# LLaDA's GSM8K setting (256 tokens in blocks of 32: 8 blocks, answers ending early at EOS) scaled to the
# bundled model: the long family (chain, 35-125 tokens) on a 128-token canvas in LLaDA's blocks of 32
# (2-4 blocks per answer), dual cache.
_LONG_WORKLOAD = WorkloadConfig(arrival="poisson", num_requests=3000, num_shots=5, gen_len=LONG_CANVAS,
                                block_len=LONG_BLOCK_LENGTH, family="chain")

PRESETS.register(
    "paper-bench-long",
    Preset(
        "paper-bench-long",
        "paper-bench where answers are long: the chain family (35-125 tokens, 2-4 blocks of 32 on a 128-token "
        "canvas, stopping at the EOS block), dual KV cache; SLO 5x isolated TP-1 latency at 0.9",
        _BENCH_CLUSTER,
        _LONG_WORKLOAD,
        _rate_points((0.5, 1.0, 1.5, 2.0, 3.0)),
        cache_mode=CacheMode.DUAL,
        quick_overrides={"workload": {"num_requests": 800}, "points": _rate_points((1.0, 2.0))},
    ),
)

PRESETS.register(
    "ablation-threshold-long",
    Preset(
        "ablation-threshold-long",
        "Paper Fig. 10 on paper-bench-long: fixed threshold vs SLO-aware vs SLO-aware + load control",
        _BENCH_CLUSTER,
        _LONG_WORKLOAD,
        _rate_points((1.0, 2.0, 3.0)),
        policies=("fixed-0.9", "dilaserve-no-loadctl", "dilaserve", *BASELINES),
        cache_mode=CacheMode.DUAL,
        quick_overrides={"workload": {"num_requests": 800}, "points": _rate_points((2.0, 3.0))},
    ),
)

PRESETS.register(
    "ablation-loadctl-long",
    Preset(
        "ablation-loadctl-long",
        "The load-control experiment on paper-bench-long",
        _BENCH_CLUSTER,
        _LONG_WORKLOAD,
        _rate_points((1.0, 2.0, 3.0)),
        policies=(*LOADCTL_POLICIES, *BASELINES),
        cache_mode=CacheMode.DUAL,
        quick_overrides={"workload": {"num_requests": 800}, "points": _rate_points((2.0, 3.0))},
    ),
)

PRESETS.register(
    "ablation-predictor-long",
    Preset(
        "ablation-predictor-long",
        "Paper Fig. 6 on paper-bench-long: one-shot vs online remaining-step prediction",
        _BENCH_CLUSTER,
        _LONG_WORKLOAD,
        _rate_points((1.0, 2.0)),
        policies=("dilaserve-oneshot", "dilaserve", *BASELINES),
        cache_mode=CacheMode.DUAL,
        quick_overrides={"workload": {"num_requests": 800}, "points": _rate_points((2.0,))},
    ),
)

PRESETS.register(
    "live-local-long",
    Preset(
        "live-local-long",
        "live-local with long answers: the chain family, max_tokens 128 in blocks of 32, dual cache, 2 TP-1 "
        "instances (max batch 16); replay the arrivals `dls loadgen --family chain` sent (docs/live-vs-sim.md)",
        ClusterSpec(num_nodes=1, gpus_per_node=2, initial_tp=(1, 1), max_batch=16, reconfigure=False),
        _LONG_WORKLOAD,
        (Point(1.0),),
        policies=("dilaserve",),
        cache_mode=CacheMode.DUAL,
        # each chain step timed as about 8.7 LLaDA-8B steps (370 over the chain's ~43): a pace a CPU
        # worker keeps at batch 16 with the whole stack on two cores (at 4.4, a quarter of the steps
        # overran it at 4.5 req/s and the control plane slowed with the load: docs/live-vs-sim.md)
        llada_steps_per_request=370.0,
        quick_overrides={"workload": {"num_requests": 100}},
    ),
)
