"""Several models in one cluster: a preset whose request mix flips between two models, and the ways
of dividing the GPUs between them, side by side on the same arrivals.

A ``MultiModelPreset`` names its models (``ServedModel``: each with its own step times, a scale of
the preset's profile, its own SLO and its switch time, the seconds from deciding to start one of its
instances to that instance serving) and the phases of the run (each model's share of the arrivals in
each). Every model's requests replay the bundled model's trace; what differs between the models is
their step times, SLOs and load.

Policies (``DIVISIONS``):

- ``dilaserve``: the scheduler's DiLaServe on a cluster that ``ModelsReconfigurator`` divides between
  the models every period (one ILP over both models, each move's switch time weighed).
- ``per-model``: DiLaServe scheduling, GPUs divided by ``SharedBudgetPlanners``: each model's own
  planner scales it by its own load under one GPU budget (the Dynamo / llm-d / AIBrix pattern).
- ``dilaserve-fixed``: ``dilaserve``'s division with every threshold held at 0.9 (the highest
  candidate, where a light load keeps them).
- ``dilaserve-frozen``: ``dilaserve``, but the requests of each model arriving in the two minutes after
  a flip run at the threshold its requests ran at in the minute before the flip (in ``dilaserve``'s own
  run at the same point: ``pre_flip_thresholds``): what lowering thresholds through a move adds (the
  bridge). Requests already running at the flip keep theirs.
- ``static``: DiLaServe scheduling on the best static split, chosen in hindsight (every split of the
  grid run, the best aggregate attainment kept).
- ``infaas``, ``llumnix``: those baselines' scheduling on the same best static split.

Each run reports its figures overall and per model, each model's GPUs and attainment over time, the
attainment in the two minutes after each flip against the model's steady level, and the GPU-hours
against giving each model its own peak (the fewest GPUs with which that model alone, on its own
cluster, reaches the attainment DiLaServe gave it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from services.reconfigurator.core.baselines import SharedBudgetPlanners
from services.reconfigurator.core.monitor import LengthBuckets, MonitorSettings
from services.reconfigurator.core.planner import PlannerOptions
from services.reconfigurator.core.reconfigurator import ModelsReconfigurator
from services.reconfigurator.core.solver import SolverOptions
from services.reconfigurator.core.spec import Instance, ModelDemand, Workload
from services.reconfigurator.core.stage1 import Stage1Options
from services.reconfigurator.core.stage2 import Stage2Options
from services.scheduler.core import CacheMode, ClusterView, SchedulingLoop, make_policy
from shared.profiles import LatencyProfile
from sim.cluster import ClusterSpec, SimCluster, initial_placement
from sim.engines import DEFAULT_MODEL_DIR, ENGINES
from sim.experiments import (
    DEFAULT_PROFILE,
    Setup,
    calibrated_planning,
    nominal_capacity,
    policy_config,
    setup,
)
from sim.metrics import SimRequestRecord, attainment_over_time, summarize
from sim.presets import Preset
from sim.registry import Registry
from sim.simulator import Simulator, VirtualClock
from sim.timing import StepTimer, anchored
from sim.workload import RequestSpec, SloClass, WorkloadConfig, generate

DIVISIONS = ("dilaserve", "dilaserve-frozen", "dilaserve-fixed", "per-model", "static", "infaas", "llumnix")
STATIC = ("static", "infaas", "llumnix")  # policies on the best static split
FLIP_WINDOW_S = 120.0  # attainment in this long after a flip, against the steady level
PRE_FLIP_S = 60.0  # the thresholds a model ran at before a flip: its requests finishing in this long before it


@dataclass(frozen=True)
class ServedModel:
    """One model of a multi-model preset."""

    name: str
    slo_factor: float  # its SLO: this x its isolated TP-1 latency at 0.9
    shares: tuple[float, ...]  # its share of the arrivals in each phase
    profile_scale: float = 1.0  # its step times: the preset profile's x this
    switch_s: float = 60.0  # drain, stop, load its weights, warm up
    min_instances: int = 1  # what it keeps with no load


@dataclass(frozen=True)
class MultiModelPreset:
    name: str
    description: str
    base: Preset  # the cluster, the workload's lengths and arrival process, cache mode, thresholds
    models: tuple[ServedModel, ...]
    phase_s: tuple[float, ...]  # each phase's length
    rate_mults: tuple[float, ...]  # points: multiples of the cluster's nominal capacity at the mean mix
    policies: tuple[str, ...] = DIVISIONS
    static_step_gpus: int = 4  # the best static split is searched over the first model's GPUs in steps of this
    flip_bin_s: float = 30.0  # attainment-over-time bins
    quick_overrides: dict = field(default_factory=dict)

    def quick(self) -> MultiModelPreset:
        return dataclasses.replace(self, quick_overrides={}, **self.quick_overrides)

    @property
    def flips_s(self) -> list[float]:
        """When the mix changes: the start of every phase after the first."""
        return [float(t) for t in np.cumsum(self.phase_s)[:-1]]

    def mean_shares(self) -> dict[str, float]:
        total = sum(self.phase_s)
        return {m.name: sum(s * d for s, d in zip(m.shares, self.phase_s, strict=True)) / total for m in self.models}


@dataclass
class ModelSetup:
    model: ServedModel
    profile: LatencyProfile
    timer: StepTimer
    base_latency_s: float
    slo_s: float
    capacity_rps: float  # the whole cluster serving this model alone, at 0.9 within its SLO


@dataclass
class MultiSetup:
    preset: MultiModelPreset
    shared: Setup  # the replay trace, candidate thresholds, quality curve (the bundled model's)
    models: dict[str, ModelSetup]
    capacity_rps: float  # the whole cluster at the mean mix

    def describe(self) -> dict:
        return {
            "models": {name: {"slo_s": round(m.slo_s, 4), "isolated_latency_s": round(m.base_latency_s, 4),
                              "profile_scale": m.model.profile_scale, "switch_s": m.model.switch_s,
                              "min_instances": m.model.min_instances, "shares": list(m.model.shares),
                              "capacity_alone_rps": round(m.capacity_rps, 3)}
                       for name, m in self.models.items()},
            "phase_s": list(self.preset.phase_s),
            "num_gpus": self.preset.base.cluster.num_gpus,
            "tp_degrees": list(self.preset.base.cluster.tp_degrees),
            "reconfig_period_s": self.preset.base.cluster.reconfig_period_s,
            "nominal_capacity_rps": round(self.capacity_rps, 3),
            "candidate_thresholds": list(self.shared.candidate_thresholds()),
            "profile": self.shared.profile_description(),
        }


def multi_setup(preset: MultiModelPreset, model_dir: str = DEFAULT_MODEL_DIR,
                profile_path: str = DEFAULT_PROFILE) -> MultiSetup:
    shared = setup(preset.base, model_dir, profile_path)
    rec, cache = shared.trace.isolated_steps()
    no_cache = preset.base.cache_mode == CacheMode.NONE
    if no_cache:
        rec, cache = rec + cache, 0.0
    raw = LatencyProfile.load(profile_path)
    models = {}
    for m in preset.models:
        profile = anchored(raw, shared.profile.context_tokens, shared.step_time_scale * m.profile_scale)
        timer = StepTimer(profile)
        base = timer.isolated_latency(1, rec, cache, no_cache=no_cache)
        slo = m.slo_factor * base
        models[m.name] = ModelSetup(m, profile, timer, base, slo, nominal_capacity(preset.base, timer, rec, cache, slo))
    shares = preset.mean_shares()
    capacity = 1.0 / sum(shares[name] / ms.capacity_rps for name, ms in models.items())
    return MultiSetup(preset, shared, models, capacity)


def requests_of(ms: MultiSetup, rate_rps: float, seed: int, only: str | None = None) -> list[RequestSpec]:
    """Every model's arrivals, phase by phase at its share of ``rate_rps`` (``only``: one model's)."""
    preset = ms.preset
    out = []
    for k, (name, m) in enumerate(ms.models.items()):
        start = 0.0
        for p, (length, share) in enumerate(zip(preset.phase_s, m.model.shares, strict=True)):
            if share > 0 and (only is None or only == name):
                config = dataclasses.replace(preset.base.workload, duration_s=length, num_requests=10**7,
                                             slo_classes=(SloClass(name, m.model.slo_factor),), seed=seed * 1000 + k * 97 + p)
                for r in generate(config, rate_rps * share, m.base_latency_s).requests:
                    out.append(dataclasses.replace(r, request_id=f"{name}-{p}-{r.request_id}",
                                                   arrival_s=start + r.arrival_s, model=name))
            start += length
    return sorted(out, key=lambda r: (r.arrival_s, r.request_id))


def split_placement(spec: ClusterSpec, gpus_by_model: dict[str, int]) -> list[tuple[Instance, str]]:
    """The spec's initial instances (all of one degree), the first ones to the first model."""
    instances = sorted(initial_placement(spec))
    out, i = [], 0
    for name, gpus in gpus_by_model.items():
        n = gpus // instances[0].tp
        out.extend((inst, name) for inst in instances[i:i + n])
        i += n
    return out


def even_split(ms: MultiSetup) -> dict[str, int]:
    g = ms.preset.base.cluster.num_gpus
    names = list(ms.models)
    share = g // len(names)
    return {name: share + (g - share * len(names) if i == 0 else 0) for i, name in enumerate(names)}


def _monitor(ms: MultiSetup, m: ModelSetup) -> MonitorSettings:
    """The model's workload monitor, planning with its calibration (``calibrated_planning``). Both models
    replay the bundled model's trace, so they share its candidates and its steps."""
    spec = ms.preset.base.cluster
    return calibrated_planning(MonitorSettings(
        window_s=spec.reconfig_window_s, min_window_s=min(10.0, spec.reconfig_window_s),
        block_length=ms.preset.base.workload.block_len, slo_s=m.slo_s,
        kv_cache=ms.preset.base.cache_mode != CacheMode.NONE,
        buckets=LengthBuckets(prompt_edges=(64, 128), output_edges=(16,)),
        **({} if spec.reconfig_peak_windows is None else {"peak_windows": spec.reconfig_peak_windows}),
    ), ms.shared)


def divider(ms: MultiSetup, label: str, clock: VirtualClock):
    """The GPU divider a dynamic policy runs (None: a static split)."""
    if label in STATIC:
        return None
    spec = ms.preset.base.cluster
    demands = [ModelDemand(name, Workload(()), m.profile, switch_s=m.model.switch_s,
                           min_instances=m.model.min_instances) for name, m in ms.models.items()]
    monitors = {name: _monitor(ms, m) for name, m in ms.models.items()}
    options = PlannerOptions(stage1=Stage1Options(solver=SolverOptions(time_limit_s=5.0, threads=1),
                                                  kv_budget_bytes=spec.kv_budget_bytes),
                             stage2=Stage2Options())
    if label == "per-model":
        return SharedBudgetPlanners(demands, clock, monitors, options)
    return ModelsReconfigurator(demands, clock, monitors, options)


def run(ms: MultiSetup, label: str, rate_mult: float, seed: int = 0, split: dict[str, int] | None = None,
        only: str | None = None, num_gpus: int | None = None, frozen: dict[str, list[float | None]] | None = None) -> dict:
    """One policy at one rate. ``split``: GPUs per model for a static policy (default: even); ``only``
    with ``num_gpus``: one model's requests alone on a cluster of that many GPUs (the peak-each sizing);
    ``frozen`` (``dilaserve-frozen``: model -> threshold at each flip, None: not held): the requests of a
    model arriving in the ``FLIP_WINDOW_S`` after a flip pinned at its threshold there; unset, a
    ``dilaserve`` run at the same point gives them (its ``pre_flip_thresholds``)."""
    preset = ms.preset
    spec = preset.base.cluster
    if only is not None:
        spec = dataclasses.replace(spec, num_nodes=max(1, math.ceil(num_gpus / spec.gpus_per_node)),
                                   initial_tp=(spec.initial_tp[0],) * (num_gpus // spec.initial_tp[0]))
    rate = rate_mult * ms.capacity_rps
    requests = requests_of(ms, rate, seed, only)
    if label == "dilaserve-frozen":
        if frozen is None:
            frozen = {n: f["pre_flip_thresholds"] for n, f in run(ms, "dilaserve", rate_mult, seed)["by_model"].items()}
        requests = freeze_after_flips(requests, preset.flips_s, frozen)
    policy = {"static": "dilaserve", "per-model": "dilaserve", "dilaserve-fixed": "fixed-0.9",
              "dilaserve-frozen": "dilaserve"}.get(label, label)
    name, config = policy_config(ms.shared, policy)
    view = ClusterView()
    cluster = SimCluster(spec, ms.shared.profile, view, profiles={n: m.profile for n, m in ms.models.items()})
    if only is not None:
        placement = [(inst, only) for inst in initial_placement(spec)]
    else:
        placement = split_placement(spec, split or even_split(ms))
    for inst, model in placement:
        cluster.start_now(inst, model)
    clock = VirtualClock()
    reconfigurator = divider(ms, label, clock) if only is None else None
    engine = ENGINES.get(preset.base.engine)(ms.shared.trace, np.random.default_rng([seed, 7]), ms.shared.model_dir)
    sim = Simulator(SchedulingLoop(make_policy(name, config, rng=seed), view), cluster, engine, ms.shared.timer,
                    requests, predictor=ms.shared.predictor(), reconfigurator=reconfigurator,
                    cache_mode=preset.base.cache_mode, sample_period_s=preset.base.sample_period_s, clock=clock,
                    steps=ms.shared.steps, timers={n: m.timer for n, m in ms.models.items()})
    sim.startup_s = {n: m.model.switch_s for n, m in ms.models.items()}
    result = sim.run()
    model_of = {r.request_id: r.model for r in requests}
    by_model = {n: [rec for rec in result.records if model_of[rec.request_id] == n] for n in ms.models}
    summary = summarize(result.records)
    summary.update(
        rps=round(rate, 3), rate_mult=rate_mult, wall_s=round(result.wall_s, 2),
        split=None if reconfigurator is not None or only is not None else dict(split or even_split(ms)),
        by_model={n: _model_figures(ms, recs) for n, recs in by_model.items() if recs},
        gpus_over_time={"time_s": [round(t, 1) for t in result.timeline.times],
                        "gpus_by_model": result.timeline.gpus_by_model},
        reconfigurations=[r for r in result.reconfigurations if r["applied"]],
        reconfiguration_instance_s=round(sim.reconfiguration_instance_s, 1),
        duration_s=round(sum(preset.phase_s), 1),
    )
    return summary


def _model_figures(ms: MultiSetup, records: list[SimRequestRecord]) -> dict:
    s = summarize(records)
    out = {k: s[k] for k in ("num_requests", "slo_attainment", "accuracy", "mean_latency_s", "p99_latency_s",
                             "mean_threshold")}
    out["attainment_over_time"] = attainment_over_time(records, ms.preset.flip_bin_s)["slo_attainment"]
    out["after_flips"] = after_flips(records, ms.preset.flips_s)
    out["pre_flip_thresholds"] = pre_flip_thresholds(records, ms.preset.flips_s)
    return out


def pre_flip_thresholds(records: list[SimRequestRecord], flips_s: list[float]) -> list[float | None]:
    """The mean threshold of the steps of the requests finishing in the ``PRE_FLIP_S`` before each flip
    (None where none finished)."""
    out = []
    for f in flips_s:
        done = [r for r in records if r.finish_s is not None and f - PRE_FLIP_S <= r.finish_s < f and r.num_steps]
        steps = sum(r.num_steps for r in done)
        out.append(round(sum(r.threshold_sum for r in done) / steps, 4) if steps else None)
    return out


def freeze_after_flips(requests: list[RequestSpec], flips_s: list[float],
                       frozen: dict[str, list[float | None]]) -> list[RequestSpec]:
    """``requests`` with those of each model arriving in the ``FLIP_WINDOW_S`` after a flip pinned at the
    model's threshold at that flip (both bounds; where it lies between candidates, the scheduler's range
    holds the candidates between its floor and ceiling, so it is rounded to the nearest 0.1, the grid's
    step)."""
    out = []
    for r in requests:
        values = frozen.get(r.model) or []
        for f, value in zip(flips_s, values, strict=False):
            if value is not None and f <= r.arrival_s < f + FLIP_WINDOW_S:
                pinned = round(value, 1)
                r = dataclasses.replace(r, min_threshold=pinned, max_threshold=pinned)
                break
        out.append(r)
    return out


def after_flips(records: list[SimRequestRecord], flips_s: list[float]) -> dict:
    """Attainment of the requests arriving in the ``FLIP_WINDOW_S`` after each flip, against the
    steady level (every request arriving outside those windows), and their ratio."""
    def inside(t: float) -> bool:
        return any(f <= t < f + FLIP_WINDOW_S for f in flips_s)

    steady = [r for r in records if not inside(r.arrival_s)]
    level = sum(r.met_slo for r in steady) / len(steady) if steady else math.nan
    flips = []
    for f in flips_s:
        window = [r for r in records if f <= r.arrival_s < f + FLIP_WINDOW_S]
        value = sum(r.met_slo for r in window) / len(window) if window else math.nan
        flips.append({"flip_s": f, "num_requests": len(window), "slo_attainment": round(value, 4),
                      "of_steady": round(value / level, 4) if level and window else None})
    return {"steady": round(level, 4), "flips": flips}


def best_static_split(ms: MultiSetup, rate_mult: float, seed: int, progress=None) -> tuple[dict[str, int], list[dict]]:
    """The split (GPUs per model) whose static DiLaServe run has the best aggregate attainment, and
    every split tried. Two models: the first model's GPUs over the grid of ``static_step_gpus``."""
    preset = ms.preset
    names = list(ms.models)
    if len(names) != 2:
        raise ValueError("the best static split is searched for two models")
    g = preset.base.cluster.num_gpus
    step = preset.static_step_gpus
    tried = []
    for first in range(step, g, step):
        split = {names[0]: first, names[1]: g - first}
        summary = run(ms, "static", rate_mult, seed, split)
        tried.append({"split": split, "slo_attainment": summary["slo_attainment"], "summary": summary})
        if progress:
            progress(f"static {first}:{g - first}", summary)
    best = max(tried, key=lambda t: (t["slo_attainment"], -abs(t["split"][names[0]] - g / 2)))
    return best["split"], tried


def peak_each_gpus(ms: MultiSetup, rate_mult: float, seed: int, targets: dict[str, float], progress=None) -> dict:
    """For each model, the fewest GPUs (in steps of the initial degree) with which its requests alone
    reach ``targets[model]``: what giving each model its own peak costs."""
    tp = ms.preset.base.cluster.initial_tp[0]
    g = ms.preset.base.cluster.num_gpus
    out = {}
    for name in ms.models:
        lo, hi = 0, g  # lo fails (or is nothing), hi is assumed to reach it; bisect on instances
        probes = {}
        while hi - lo > tp:
            mid = (lo + hi) // (2 * tp) * tp or tp
            summary = run(ms, "static", rate_mult, seed, only=name, num_gpus=mid)
            probes[mid] = summary["slo_attainment"]
            if progress:
                progress(f"{name} alone on {mid} GPUs", summary)
            lo, hi = (lo, mid) if summary["slo_attainment"] >= targets[name] - 1e-9 else (mid, hi)
        out[name] = {"gpus": hi, "target": round(targets[name], 4), "probes": dict(sorted(probes.items()))}
    return out


def compare(ms: MultiSetup, labels: list[str] | None = None, seed: int = 0, progress=None) -> dict:
    """Every policy at every point on the same arrivals, the best static split searched at each point,
    and at the top point the GPU-hours of each model on its own peak."""
    preset = ms.preset
    labels = labels or list(preset.policies)
    unknown = [label for label in labels if label not in DIVISIONS]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; a multi-model preset runs {list(DIVISIONS)}")
    points = []
    for mult in preset.rate_mults:
        point: dict = {"rate_mult": mult, "rps": round(mult * ms.capacity_rps, 3), "policies": {}}
        if any(label in STATIC for label in labels):
            split, tried = best_static_split(ms, mult, seed, progress)
            point["best_static_split"] = split
            point["static_splits"] = [{"split": t["split"], "slo_attainment": round(t["slo_attainment"], 4)}
                                      for t in tried]
            if "static" in labels:
                point["policies"]["static"] = next(t["summary"] for t in tried if t["split"] == split)
        ordered = sorted(labels, key=lambda label: label == "dilaserve-frozen")  # dilaserve's run first
        for label in ordered:
            if label == "static":
                continue
            ours = point["policies"].get("dilaserve")
            frozen = ({n: f["pre_flip_thresholds"] for n, f in ours["by_model"].items()}
                      if label == "dilaserve-frozen" and ours is not None else None)
            summary = run(ms, label, mult, seed, point.get("best_static_split"), frozen=frozen)
            point["policies"][label] = summary
            if progress:
                progress(label, summary)
        points.append(point)
    out = {"preset": preset.name, "kind": "multi-model", "setup": ms.describe(), "points": points}
    top = points[-1]
    ours = top["policies"].get("dilaserve")
    if ours is not None:
        targets = {name: fig["slo_attainment"] for name, fig in ours["by_model"].items()}
        peaks = peak_each_gpus(ms, top["rate_mult"], seed, targets, progress)
        g = preset.base.cluster.num_gpus
        hours = sum(preset.phase_s) / 3600.0
        peak_total = sum(p["gpus"] for p in peaks.values())
        out["gpu_hours"] = {
            "dilaserve": round(g * hours, 3), "each_model_its_peak": round(peak_total * hours, 3),
            "peak_gpus_by_model": peaks, "saving": round(1.0 - g / peak_total, 4) if peak_total else None,
        }
    out["headline"] = headline(out)
    return out


def headline(result: dict) -> dict:
    """The top point's figures the issue's acceptance reads."""
    top = result["points"][-1]["policies"]
    att = {label: s["slo_attainment"] for label, s in top.items()}
    ours = top.get("dilaserve")
    out: dict = {"slo_attainment": {k: round(v, 4) for k, v in att.items()}}
    if ours is None:
        return out
    for other in ("static", "per-model"):
        if other in att:
            out[f"lead_over_{other}_pp"] = round(100 * (att["dilaserve"] - att[other]), 2)
            out[f"accuracy_gap_vs_{other}_pp"] = {
                name: round(100 * (fig["accuracy"] - top[other]["by_model"][name]["accuracy"]), 2)
                for name, fig in ours["by_model"].items() if name in top[other]["by_model"]}
    out["by_model"] = {name: {"slo_attainment": round(fig["slo_attainment"], 4), "accuracy": round(fig["accuracy"], 4),
                              "after_flips_of_steady": [f["of_steady"] for f in fig["after_flips"]["flips"]]}
                       for name, fig in ours["by_model"].items()}
    held = top.get("dilaserve-frozen") or top.get("dilaserve-fixed")
    if held is not None:  # thresholds held through the move (at their pre-flip values): what lowering them adds
        for name, fig in held["by_model"].items():
            out["by_model"][name]["after_flips_thresholds_held"] = [f["slo_attainment"] for f in fig["after_flips"]["flips"]]
            out["by_model"][name]["after_flips"] = [f["slo_attainment"] for f in ours["by_model"][name]["after_flips"]["flips"]]
            if "dilaserve-frozen" in top:
                out["by_model"][name]["pre_flip_thresholds"] = ours["by_model"][name]["pre_flip_thresholds"]
    if "gpu_hours" in result:
        out["gpu_hours_saving"] = result["gpu_hours"]["saving"]
    return out


MULTI_PRESETS: Registry[MultiModelPreset] = Registry("multi-model preset")

_FLIP = (0.8, 0.2, 0.8)  # the first model's share in each phase (80:20, then 20:80, then back)

MULTI_PRESETS.register(
    "multi-model",
    MultiModelPreset(
        "multi-model",
        "Two models on 32 GPUs (4 nodes of 8, TP {1, 2, 4}): a LLaDA-8B-class model with a tight SLO (3x its "
        "isolated latency) and a Dream-7B-class one (step times 0.87x: 7.6B parameters against 8B) with a "
        "loose one (8x); the mix flips 80:20, 20:80, back, with bursty arrivals (Gamma, CV 2); switch times "
        "45 s and 40 s (a cold load of an 8B model, the low end of the published 30-100 s), loaded beside the "
        "outgoing model, which then drains (make before break, as the node agent switches a slot)",
        Preset(
            "multi-model", "",
            ClusterSpec(num_nodes=4, gpus_per_node=8, initial_tp=(1,) * 32, tp_degrees=(1, 2, 4), reconfigure=True,
                        reconfig_period_s=10.0, reconfig_window_s=10.0, reconfig_peak_windows=1, overlap_switch=True),
            WorkloadConfig(arrival="gamma", cv=2.0, lengths="fixed", num_shots=5),
            (),
            cache_mode=CacheMode.NONE,
            sample_period_s=5.0,
        ),
        (ServedModel("llada-8b", 3.0, _FLIP, switch_s=45.0),
         ServedModel("dream-7b", 8.0, tuple(round(1.0 - s, 6) for s in _FLIP), profile_scale=0.87, switch_s=40.0)),
        phase_s=(600.0, 600.0, 600.0),
        rate_mults=(0.6, 0.9, 1.2),
        static_step_gpus=2,
        quick_overrides={"phase_s": (240.0, 240.0, 240.0), "rate_mults": (1.2,), "static_step_gpus": 8},
    ),
)
