"""Runs: one point (``run_point``), side-by-side sweeps (``compare``), capacity search (``capacity``)
and the replay-vs-model fidelity check. Everything is seeded: the same preset, policy and seed give
the same numbers; every policy sees the same arrivals, problems and engine seed at a point.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.reconfigurator.core.latency import StepTable
from services.reconfigurator.core.monitor import LengthBuckets, MonitorSettings
from services.reconfigurator.core.planner import PlannerOptions
from services.reconfigurator.core.reconfigurator import Reconfigurator
from services.reconfigurator.core.solver import SolverOptions
from services.reconfigurator.core.stage1 import Stage1Options
from services.reconfigurator.core.stage2 import Stage2Options
from services.scheduler.core import (
    CacheMode,
    ClusterView,
    SchedulingLoop,
    StepConfig,
    make_config,
    make_policy,
)
from services.scheduler.core.policies import POLICIES
from services.scheduler.core.threshold import (
    PredictionMode,
    candidates_from_quality,
    canvas_floors,
    quality_curve_key,
    quality_curves,
    within_quality_budget,
)
from shared.calibration import QUALITY, bundle_dir
from shared.profiles import LatencyProfile
from shared.request_traces import read_trace
from shared.tasks import SHORT_FAMILIES, Family, Split, TaskGenerator
from sim.cluster import SimCluster, initial_placement
from sim.engines import DEFAULT_MODEL_DIR, ENGINES, ReplayTrace, calibrate
from sim.metrics import attainment_over_time, breakdown, summarize
from sim.predictors import PREDICTION_SOURCES
from sim.presets import Preset, resolve_policy
from sim.simulator import Simulator, VirtualClock
from sim.timing import StepTimer, anchored
from sim.workload import generate

DEFAULT_PROFILE = "profiles/llada-8b-h100.json"
SLO_BASE_THRESHOLD = 0.9


@dataclass
class Setup:
    """What every run of a preset shares: the replay trace, the anchored profile, SLO and capacity."""

    preset: Preset
    trace: ReplayTrace
    profile: LatencyProfile  # anchored and time-scaled
    step_time_scale: float
    timer: StepTimer
    base_latency_s: float  # isolated TP-1 latency at 0.9
    slo_s: float  # of the first SLO class
    capacity_rps: float  # nominal: fixed 0.9 on the initial cluster, within the SLO
    model_dir: str
    prediction: str = "auto"
    steps: StepConfig = StepConfig()  # overlap and pipelining, as the live scheduler runs them by default
    profile_path: str = DEFAULT_PROFILE  # the latency profile's file

    def predictor(self, one_shot: bool = False):
        """The preset's prediction source; ``one_shot``: its arrival-only model (a policy in
        ``PredictionMode.ONESHOT`` plans on it)."""
        thresholds = make_config("dilaserve").thresholds
        return PREDICTION_SOURCES.get(self.prediction)(model_dir=self.model_dir, thresholds=thresholds,
                                                       one_shot=one_shot)

    def candidate_thresholds(self) -> tuple[float, ...]:
        """DiLaServe's candidate thresholds: the preset's, within its quality budget on this model
        (the live scheduler's rule, ``candidates_from_quality``, on the curve ``quality_curve`` names)."""
        budget = self.preset.quality_budget_pp
        if budget is None:
            return tuple(self.preset.thresholds)
        data, key, _ = self._quality()
        if data is None:
            return within_quality_budget(self.preset.thresholds, self.trace.overall_accuracy(), budget)
        return candidates_from_quality(self.preset.thresholds, data, budget, [key])

    def canvas_floors(self, thresholds) -> dict[int, float]:
        """The live scheduler's floors per canvas (``canvas_floors`` on quality.json) for these
        candidates; none without a budget or curves per canvas."""
        budget = self.preset.quality_budget_pp
        data = self._quality()[0]
        if budget is None or data is None:
            return {}
        return canvas_floors(thresholds, data, budget)

    def quality_curve(self) -> tuple[dict[float, float], str]:
        """(threshold -> accuracy, where it comes from): the model's measured curve (quality.json,
        written with its model card from `bench.engine`: 500 problems) for the preset's task family
        when it has one (measured as served), else for its cache mode; else the replay trace's
        calibration (192 problems: a point of accuracy is two answers)."""
        data, key, where = self._quality()
        if data is None:
            return self.trace.overall_accuracy(), where
        return quality_curves(data, [key])[0], where

    def quality_curve_key(self) -> str | None:
        """The name the live scheduler's ``DLS_SCHEDULER_QUALITY_CURVES`` takes for this preset's curve."""
        return self._quality()[1]

    def _quality(self) -> tuple[dict | None, str | None, str]:
        path = bundle_dir(self.model_dir) / QUALITY
        if not path.exists():
            return None, None, "replay trace calibration"
        data = json.loads(path.read_text())
        workload = self.preset.workload
        key = quality_curve_key(data, family=workload.family,
                                gen_len=workload.gen_len, block_len=workload.block_len,
                                no_cache=self.preset.cache_mode == CacheMode.NONE)
        if key in data.get("families", {}):
            return data, key, f"{path} (families.{key})"
        return data, key, f"{path} ({key})"

    def describe(self) -> dict:
        return {
            "candidate_thresholds": list(self.candidate_thresholds()),
            "quality_curve": self.quality_curve()[1],
            "quality_curve_key": self.quality_curve_key(),
            "quality_budget_pp": self.preset.quality_budget_pp,
            "model_key": self.trace.model_key,
            "profile_anchor_context_tokens": self.profile.context_tokens,
            "isolated_latency_s": round(self.base_latency_s, 6),
            "slo_s": round(self.slo_s, 6),
            "nominal_capacity_rps": round(self.capacity_rps, 3),
            "step_time_scale": round(self.step_time_scale, 4),
            "cache_mode": self.preset.cache_mode.name.lower(),
            "workload": {"family": self.preset.workload.family, "gen_len": self.preset.workload.gen_len,
                         "block_len": self.preset.workload.block_len, "num_shots": self.preset.workload.num_shots},
            "replay_tokens_per_step": {f"{t:.2f}": round(v, 3) for t, v in sorted(self.trace.tokens_per_step().items())},
            "replay_accuracy": self.trace.accuracy,
            "control_plane_ms": round(self.timer.control_plane_s * 1000.0, 3),
            "pipelining": self.steps.pipelines,
            "overlap": self.steps.overlap,
            "overlap_min_tokens": self.steps.overlap_min_tokens,
            "prediction_source": self.prediction,
            "prediction_source_used": type(self.predictor()).__name__,
            "trace": self.trace_description(),
            "kv_budget": self.kv_description(),
            "profile": self.profile_description(),
        }

    def profile_description(self) -> dict:
        """Which latency profile timed the run, and what of it was measured."""
        profile = self.profile
        return {"path": self.profile_path, "model": profile.model, "device": profile.device,
                "measured": profile.measured, "derived_tp": list(profile.derived_tp),
                "smoothed": list(profile.smoothed)}

    def kv_description(self) -> dict | None:
        """The KV memory budget per GPU and what each TP degree holds under it (None: no budget)."""
        cluster = self.preset.cluster
        if not cluster.kv_budget_bytes:
            return None
        return {"bytes_per_gpu": cluster.kv_budget_bytes, "kv_bytes_per_token": self.profile.kv_bytes_per_token,
                "tokens_by_tp": {str(tp): cluster.kv_tokens(self.profile, tp) for tp in cluster.tp_degrees}}

    def trace_description(self) -> dict | None:
        """The replayed trace file (None for a built-in arrival process)."""
        workload = self.preset.workload
        if workload.arrival != "trace":
            return None
        trace = read_trace(workload.trace_path, layout=workload.trace_layout, models=workload.trace_models,
                           keep_failures=workload.trace_keep_failures)
        return {"path": workload.trace_path, "layout": trace.layout, "num_requests": len(trace.rows),
                "time_scale": workload.time_scale}


def setup(
    preset: Preset,
    model_dir: str = DEFAULT_MODEL_DIR,
    profile_path: str = DEFAULT_PROFILE,
    trace: ReplayTrace | None = None,
    prediction: str = "auto",
    steps: StepConfig | None = None,
    control_plane_s: float = 0.0,
) -> Setup:
    """What a preset's runs share. ``control_plane_s``: time added to every step (``sim.timing``: a live
    stack's measured control-plane time per step; 0 for a GPU cluster's modelled profile)."""
    # the preset's own few-shot count when all its prompts have one (closer replay), else a mix
    shots = preset.workload.num_shots if preset.workload.lengths == "fixed" else None
    workload = preset.workload
    families = (Family(workload.family),) if workload.family else SHORT_FAMILIES
    trace = trace or calibrate(model_dir, num_shots=shots, gen_len=workload.gen_len, block_len=workload.block_len,
                               families=families)
    anchor = _mean_context(model_dir, preset.workload.num_shots, trace.gen_len)
    rec, cache = trace.isolated_steps(SLO_BASE_THRESHOLD)
    scale = preset.llada_steps_per_request / (rec + cache) if preset.llada_steps_per_request else 1.0
    profile = anchored(LatencyProfile.load(profile_path), anchor, scale)
    timer = StepTimer(profile, control_plane_s=control_plane_s)
    no_cache = preset.cache_mode == CacheMode.NONE
    if no_cache:
        rec, cache = rec + cache, 0.0  # every step is a full forward
    base = timer.isolated_latency(1, rec, cache, no_cache=no_cache)
    slo = preset.workload.slo_classes[0].slo_factor * base
    capacity = nominal_capacity(preset, timer, rec, cache, slo)
    return Setup(preset, trace, profile, scale, timer, base, slo, capacity, model_dir, prediction,
                 steps or StepConfig(), profile_path)


def _mean_context(model_dir: str, num_shots: int, gen_len: int) -> float:
    from shared.tokenizer import CharTokenizer

    tokenizer = CharTokenizer.from_pretrained(Path(model_dir))
    tasks = TaskGenerator(seed=999)
    prompts = [tasks.problem(num_shots, Split.HELD_OUT).prompt for _ in range(64)]
    return statistics.fmean(len(tokenizer.encode(p)) for p in prompts) + gen_len


def nominal_capacity(preset: Preset, timer: StepTimer, rec: float, cache: float, slo_s: float) -> float:
    """Requests/s the initial cluster serves at 0.9 with every request within the SLO: per instance,
    the batch with the best throughput among those whose per-request latency fits the SLO."""
    total = 0.0
    for tp in preset.cluster.initial_tp:
        best = 0.0
        max_batch = preset.cluster.max_batch or timer.profile.max_batch(tp)
        full = timer.profile.full if preset.cache_mode == CacheMode.NONE else timer.profile.alpha
        for b in range(1, max_batch + 1):
            latency = rec * full(tp, b) + cache * timer.profile.beta(tp, b)
            if latency * timer.time_scale <= slo_s:
                best = max(best, b / (latency * timer.time_scale))
        total += best
    return total


def policy_config(setup_: Setup, label: str) -> tuple[str, dict]:
    """Core policy name and config: the variant's overrides plus the calibrated step rates."""
    name, overrides = resolve_policy(label)
    fields = POLICIES[name].config_cls.model_fields
    config = dict(overrides)
    rates = setup_.trace.tokens_per_step()
    if "fallback_tokens_per_step" in fields:
        config.setdefault("fallback_tokens_per_step", rates)
    if "thresholds" in fields:
        config.setdefault("thresholds", setup_.candidate_thresholds())
    if "canvas_floors" in fields and "thresholds" not in overrides:  # a variant's own set stands as given
        # as the live scheduler bounds each request by its canvas
        config.setdefault("canvas_floors", tuple(sorted(setup_.canvas_floors(config["thresholds"]).items())))
    if "tokens_per_step" in fields:
        threshold = config.get("threshold", fields["threshold"].default)
        config.setdefault("tokens_per_step", rates[min(rates, key=lambda t: abs(t - threshold))])
    make_config(name, config)  # validate early: errors name the field
    return name, config


def _plans_on_one_shot(name: str, config: dict) -> bool:
    """Whether the policy plans on the predictor's one-shot model (``PredictionMode.ONESHOT``)."""
    return getattr(make_config(name, config), "prediction", None) == PredictionMode.ONESHOT


def run_point(setup_: Setup, label: str, point_index: int, engine_name: str | None = None, seed: int | None = None) -> dict:
    """One policy at one x-axis point; returns the summary (and timeline for reconfiguring presets)."""
    preset = setup_.preset
    seed = preset.seed if seed is None else seed
    point = preset.points[point_index]
    workload_config = dataclasses.replace(preset.workload, seed=seed, **point.workload)
    workload = generate(workload_config, point.rate_mult * setup_.capacity_rps, setup_.base_latency_s)
    name, config = policy_config(setup_, label)
    view = ClusterView()
    cluster = SimCluster(preset.cluster, setup_.profile, view)
    for instance in initial_placement(preset.cluster):
        cluster.start_now(instance)
    loop = SchedulingLoop(make_policy(name, config, rng=seed), view)
    engine_rng = np.random.default_rng([seed, point_index, 7])
    engine = ENGINES.get(engine_name or preset.engine)(setup_.trace, engine_rng, setup_.model_dir)
    clock = VirtualClock()
    reconfigures = preset.cluster.reconfigure and label.startswith(preset.reconfigure_policies)
    reconfigurator = _reconfigurator(setup_, clock) if reconfigures else None
    sim = Simulator(
        loop, cluster, engine, setup_.timer, workload.requests,
        predictor=setup_.predictor(one_shot=_plans_on_one_shot(name, config)),
        reconfigurator=reconfigurator, cache_mode=preset.cache_mode,
        sample_period_s=preset.sample_period_s, clock=clock, steps=setup_.steps,
    )
    result = sim.run()
    summary = summarize(result.records)
    # the rate replayed: a trace's window scaled to the point's rate, or by an explicit time scale,
    # which replaces the point's rate (rate_mult is then what that scale gives)
    explicit_scale = workload_config.arrival == "trace" and workload_config.time_scale is not None
    summary.update(
        rps=round(workload.rate_rps, 4),
        rate_mult=round(workload.rate_rps / setup_.capacity_rps, 4) if explicit_scale else point.rate_mult,
        label=point.label or f"{point.rate_mult}x",
        trace_native_rps=None if workload.trace_native_rps is None else round(workload.trace_native_rps, 4),
        scale=None if workload.scale is None else round(workload.scale, 4),
        duration_s=round(workload.duration_s, 3), wall_s=round(result.wall_s, 3), num_events=result.num_events,
        # as the live scheduler counts them: steps an instance went on with before the pass (overlap,
        # pipelining included), of those, steps run from a held command (pipelining), and steps run
        # as a command's repeat (none: the simulator's held commands are never late)
        continued_steps=sim.core.counters["continued_steps"], pipelined_steps=sim.core.counters["pipelined_steps"],
        repeated_steps=sim.core.counters["repeated_steps"],
        # requests left out of a step because they were late and others were not (DiLaServe's
        # yielding), and block starts deferred by the recompute budget, as the live scheduler logs them
        late_yields=sim.core.counters["late_yields"], recomputes_deferred=sim.core.counters["recomputes_deferred"],
        # batched steps run and the requests each carried on average (the workers log their steps)
        batched_steps=sim.batched_steps, mean_batch=round(sim.batched_items / max(sim.batched_steps, 1), 3),
        # the same over the steps that started while requests waited in the queue, and that mean over
        # the instances' maximum batch (1.0: every such step ran full)
        mean_batch_when_queued=round(sim.queued_items / sim.queued_steps, 3) if sim.queued_steps else None,
        batch_fill_when_queued=round(sim.queued_items / sim.queued_max_items, 4) if sim.queued_steps else None,
        # and over the steps composed while requests were queued, placed nowhere (a deep queue)
        mean_batch_deep_queue=round(sim.deep_items / sim.deep_steps, 3) if sim.deep_steps else None,
        batch_fill_deep_queue=round(sim.deep_items / sim.deep_max_items, 4) if sim.deep_steps else None,
        num_steps_deep_queue=sim.deep_steps,
        breakdown=breakdown(result.records, sim.reconfiguration_instance_s),
    )
    summary["reconfiguration"] = reconfigures
    if preset.cluster.reconfigure:
        summary["timeline"] = result.timeline.to_json()
        summary["reconfigurations"] = result.reconfigurations
        summary["attainment_over_time"] = attainment_over_time(result.records, preset.sample_period_s * 6)
    return summary


def calibrated_planning(settings: MonitorSettings, setup_: Setup) -> MonitorSettings:
    """``settings`` planning with the served model's calibration, as the scheduler serves it: thresholds
    among DiLaServe's candidates (the quality budget's) and steps per request as the replay trace measured
    them (``ReplayTrace.measured_steps``) rather than counted from the canvas. The multi-model preset
    plans so; the single-model presets' planner still counts from the canvas (``docs/notes.md``)."""
    return dataclasses.replace(settings, thresholds=tuple(setup_.candidate_thresholds()),
                               step_table=StepTable((setup_.trace.measured_steps(),)))


def _reconfigurator(setup_: Setup, clock: VirtualClock) -> Reconfigurator:
    spec = setup_.preset.cluster
    settings = MonitorSettings(
        window_s=spec.reconfig_window_s, min_window_s=min(10.0, spec.reconfig_window_s),
        block_length=setup_.preset.workload.block_len, slo_s=setup_.slo_s,
        kv_cache=setup_.preset.cache_mode != CacheMode.NONE,
        buckets=LengthBuckets(prompt_edges=(64, 128), output_edges=(16,)),
        **({} if spec.reconfig_peak_windows is None else {"peak_windows": spec.reconfig_peak_windows}),
    )
    solver = SolverOptions(time_limit_s=5.0, threads=1)
    options = PlannerOptions(stage1=Stage1Options(solver=solver, kv_budget_bytes=setup_.preset.cluster.kv_budget_bytes),
                             stage2=Stage2Options())
    return Reconfigurator(setup_.profile, clock, settings, options)


def compare(setup_: Setup, labels: list[str], engine_name: str | None = None, seed: int | None = None,
            progress=None) -> dict:
    """Every policy at every point, on the same arrivals; plus the fidelity check where the preset asks."""
    preset = setup_.preset
    policies = {}
    for label in labels:
        points = []
        for i in range(len(preset.points)):
            points.append(run_point(setup_, label, i, engine_name, seed))
            if progress:
                progress(label, points[-1])
        policies[label] = {"points": sorted(points, key=lambda p: p["rps"])}
    out = {"preset": preset.name, "setup": setup_.describe(), "policies": policies}
    fidelity_labels = [p for p in preset.fidelity_policies if p in labels]
    if fidelity_labels and (engine_name or preset.engine) == "replay":
        out["fidelity"] = fidelity(setup_, fidelity_labels, policies, seed, progress)
    return out


def fidelity(setup_: Setup, labels: list[str], replay: dict, seed: int | None, progress=None) -> dict:
    """Model in the loop vs replay at every point: the largest gaps over the sweep."""
    slo_gaps, lat_gaps, rows = [], [], []
    for label in labels:
        for i in range(len(setup_.preset.points)):
            model = run_point(setup_, label, i, "model", seed)
            if progress:
                progress(f"{label} (model)", model)
            rep = next(p for p in replay[label]["points"] if p["rate_mult"] == model["rate_mult"])
            slo_gap = abs(rep["slo_attainment"] - model["slo_attainment"]) * 100
            lat_gap = abs(rep["mean_latency_s"] - model["mean_latency_s"]) / model["mean_latency_s"] * 100
            slo_gaps.append(slo_gap)
            lat_gaps.append(lat_gap)
            rows.append({
                "policy": label, "rps": model["rps"],
                "model": {k: model[k] for k in ("slo_attainment", "accuracy", "mean_latency_s", "mean_steps")},
                "replay": {k: rep[k] for k in ("slo_attainment", "accuracy", "mean_latency_s", "mean_steps")},
                "slo_attainment_gap_pp": round(slo_gap, 3), "mean_latency_gap_pct": round(lat_gap, 3),
            })
    return {
        "engines": ["replay", "model"],
        "slo_attainment_gap_pp": round(max(slo_gaps), 3),
        "mean_latency_gap_pct": round(max(lat_gaps), 3),
        "within_targets": max(slo_gaps) <= 3.0 and max(lat_gaps) <= 5.0,
        "points": rows,
    }


def capacity(setup_: Setup, label: str, target: float = 0.9, seed: int | None = None,
             max_iterations: int = 12, tolerance: float = 0.02) -> dict:
    """The highest request rate whose SLO attainment is at least ``target`` (Vidur-style search):
    double the rate until it fails, then bisect until the bracket is within ``tolerance`` (relative)."""
    probes = []

    def attainment(mult: float) -> float:
        preset = dataclasses.replace(setup_.preset, points=(dataclasses.replace(setup_.preset.points[0], rate_mult=mult),))
        summary = run_point(dataclasses.replace(setup_, preset=preset), label, 0, None, seed)
        probes.append({"rps": summary["rps"], "slo_attainment": summary["slo_attainment"], "accuracy": summary["accuracy"]})
        return summary["slo_attainment"]

    lo, hi = 0.0, 0.5
    while attainment(hi) >= target and len(probes) < max_iterations:
        lo, hi = hi, hi * 2
    while (hi - lo) > tolerance * hi and len(probes) < max_iterations:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if attainment(mid) >= target else (lo, mid)
    return {
        "policy": label, "target": target, "max_rps": round(lo * setup_.capacity_rps, 3),
        "max_rate_mult": round(lo, 4), "nominal_capacity_rps": round(setup_.capacity_rps, 3),
        "probes": sorted(probes, key=lambda p: p["rps"]),
    }
