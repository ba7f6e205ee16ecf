"""Two models on the live stack (``dls up --model A --model B``) with slots moving between them as the mix
flips, against a static split of the same slots, and a model scaled to zero answering its next request.

    python -m bench.live_models --json docs/bench/live-models.json
    python -m bench.live_models --quick --json runs/live-models-quick.json    # a few minutes, end to end

Runs, each on fresh NATS/Redis ports (workers paced to a GPU profile, as ``bench.live_overload``):

1. A probe stack (one worker per model; skipped when ``--switch-s`` and ``--slo-ms`` are given): how long
   the node agent takes to bring a worker from spawn to READY (its log), which becomes each model's
   ``DLS_RECONFIGURATOR_SWITCH_S``, and each model's isolated latency at 0.9, from which its SLO
   (``DLS_GATEWAY_MODEL_SLO_MS``) is made: tight (3x, the ``multi-model`` preset's) for the first model,
   loose (6x) for the second.
2. The static split: ``--workers-per-model 2,2``, ``DLS_RECONFIGURATOR_ENABLED=false``.
3. The division: the same slots and start, the reconfigurator on with a short period (window the same,
   ``DLS_RECONFIGURATOR_PEAK_WINDOWS=1``), the second model allowed down to 0 instances.
   After the flips, a last phase sends the first model alone until the reconfigurator scales the second
   to zero, then one request for it (the official ``openai`` SDK), whose wait ``X-DLS-Cold-Start-Ms`` says.

Both runs get the same arrivals: Poisson per model and phase (one ``loadgen`` plan per model, sent
concurrently), phase 1 80:20 between the models, phase 2 20:80, phase 3 80:20 again, at ``--rate`` in all.
Recorded per run: each model's attainment (answers within its SLO over requests sent) overall and per
phase, lost requests (sent, not answered), 5xx answers, the READY slots per model every few seconds
(``/v1/cluster``); for the division also each applied division (the reconfigurator's log), how long after
each flip the slots followed (the new heavy model holding more READY slots than the other), in
reconfiguration periods, and each switch's time from the plan to the new worker READY and to the old one
stopped (the node agent's log), with p50 and p99. Progress on stdout; the JSON at the end (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from bench.common import emit_json, launch_stack, stop_stack
from bench.live_overload import WORKLOADS, quality_curve
from loadgen.driver import PlannedRequest, Result, poisson_plan, run_plan
from shared.calibration import QUALITY, bundle_dir
from shared.runtime import free_port, free_port_range

BUNDLED = "models/dls-tiny"
# each model's SLO over its isolated latency: the multi-model preset's tight 3x, and 6x for the loose one (the
# preset's 8x is never missed by the loose model at 4 slots' load, static split or not)
TIGHT_SLO_FACTOR, LOOSE_SLO_FACTOR = 3.0, 6.0
HEAVY_SHARE = 0.8  # the heavy model's share of the arrivals in a phase
ISOLATED_SAMPLES = 3  # requests sent one at a time per model to measure its isolated latency
POLL_S = 2.0  # /v1/cluster is read this often
MAX_TOKENS = 16  # the short workload (bench.live_overload's): sums and word lists
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
STARTED = re.compile(r"started (\S+) \(.*as pid")
READY = re.compile(r"(\S+) \((\S+), TP-\d+ on GPUs \[[\d, ]*\]\) is READY")
SWITCHED = re.compile(r"switched (.*) to (\S+) \(TP-\d+ on GPUs \[([\d, ]*)\](?: of model '([^']+)')?\), made before "
                      r"break: READY ([\d.]+) s after the plan, the old stopped ([\d.]+) s later \(([\d.]+) s in all\)")
DIVIDES = re.compile(r"plan (\S+) divides the GPUs: (.*) \(running: (.*)\)$")
ANSWERED = re.compile(r"plan (\S+) answered by every node it changes")
MODEL_GPUS = re.compile(r"(\S+) (\d+) GPUs")


# --- pure parts: phases, arrivals, summaries ---------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One stretch of the run with a fixed mix."""

    start_s: float  # offset from the start of the load
    duration_s: float
    shares: dict[str, float]  # model name -> its share of the arrivals

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s

    @property
    def heavy(self) -> str:
        return max(self.shares, key=self.shares.get)


def flip_phases(models: list[str], phase_s: float, heavy_share: float = HEAVY_SHARE) -> list[Phase]:
    """80:20, 20:80, 80:20 between the two ``models``, each phase ``phase_s`` long."""
    first, second = models
    mixes = (heavy_share, 1.0 - heavy_share, heavy_share)  # the first model's share in each phase
    return [Phase(i * phase_s, phase_s, {first: share, second: 1.0 - share}) for i, share in enumerate(mixes)]


def model_plans(phases: list[Phase], rate_rps: float, seed: int, slo_ms: dict[str, float | None] | None = None,
                max_tokens: int = MAX_TOKENS) -> dict[str, list[PlannedRequest]]:
    """Model name -> its open-loop plan: Poisson arrivals at ``rate_rps`` x its share in each phase, offset to
    the phase's start, held-out task prompts (the same for every run with this seed). ``slo_ms``: a model's
    SLO carried by each request (None or absent: the gateway's default for the model)."""
    plans: dict[str, list[PlannedRequest]] = {m: [] for m in phases[0].shares}
    for p, phase in enumerate(phases):
        for m, (model, share) in enumerate(sorted(phase.shares.items())):
            if share <= 0:
                continue
            drawn = poisson_plan(rate_rps * share, phase.duration_s, slo_ms=(slo_ms or {}).get(model),
                                 max_tokens=max_tokens, seed=seed * 1000 + p * 10 + m)
            plans[model].extend(dataclasses.replace(r, arrival_s=r.arrival_s + phase.start_s) for r in drawn)
    return plans


def percentile(values, q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), None for no values."""
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def distribution(values) -> dict:
    """Count, p50, p99, mean and max of ``values`` (seconds, rounded to 0.1 s)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"n": 0, "p50": None, "p99": None, "mean": None, "max": None}
    return {"n": len(values), "p50": round(percentile(values, 50), 1), "p99": round(percentile(values, 99), 1),
            "mean": round(statistics.fmean(values), 1), "max": round(max(values), 1)}


def outcome_counts(results: list[Result]) -> dict:
    """Sent, answered (200), lost (no answer at all), 5xx and other refusals, and the SLOs met."""
    num_5xx = sum(500 <= r.status < 600 for r in results)
    answered = sum(r.finished for r in results)
    lost = sum(r.status == 0 for r in results)  # no HTTP answer: timed out or the connection failed
    return {"sent": len(results), "answered": answered, "lost": lost, "num_5xx": num_5xx,
            "other_errors": len(results) - answered - lost - num_5xx,
            "slo_met": sum(r.slo_met for r in results),
            "attainment": round(sum(r.slo_met for r in results) / len(results), 4) if results else None}


def model_summary(results: list[Result], phases: list[Phase]) -> dict:
    """One model's figures over the run and per phase (by arrival), with its latencies."""
    finished = [r.latency_s for r in results if r.finished]
    per_phase = [outcome_counts([r for r in results if phase.start_s <= r.planned.arrival_s < phase.end_s])
                 for phase in phases]
    return {**outcome_counts(results), "slo_ms": next((r.slo_ms for r in results if r.slo_ms), None),
            "p50_latency_s": round(percentile(finished, 50), 2) if finished else None,
            "p99_latency_s": round(percentile(finished, 99), 2) if finished else None,
            "correct": sum(r.correct for r in results),
            "error_statuses": sorted({r.status for r in results if not r.finished}),
            "errors": sorted({r.error for r in results if r.error})[:5],
            "per_phase": per_phase}


def follow_delays(timeline: list[dict], phases: list[Phase], period_s: float) -> list[dict]:
    """For each phase, how long after its start the READY slots favoured its heavy model (more than any
    other holds), in seconds and in reconfiguration periods (None: not within the phase)."""
    out = []
    for i, phase in enumerate(phases):
        followed = next((s["t_s"] for s in timeline if phase.start_s <= s["t_s"] < phase.end_s
                         and _favours(s["ready"], phase.heavy)), None)
        delay = None if followed is None else followed - phase.start_s
        out.append({"phase": i + 1, "heavy": phase.heavy, "start_s": phase.start_s,
                    "followed_after_s": None if delay is None else round(delay, 1),
                    "periods": None if delay is None else round(delay / period_s, 2)})
    return out


def _favours(ready: dict[str, int], model: str) -> bool:
    return ready.get(model, 0) > max((n for m, n in ready.items() if m != model), default=0)


# --- log reading -------------------------------------------------------------------------------------


def log_lines(path: Path, since: float = 0.0):
    """(wall time, text) of each timestamped line of a service's log at or after ``since``."""
    if not path.exists():
        return
    for line in path.read_text(errors="replace").splitlines():
        match = LOG_TIME.match(line)
        if match:
            at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at >= since:
                yield at, line[match.end():]


def boot_times(node_agent_log: Path) -> dict[str, list[float]]:
    """Model -> seconds from each worker's spawn to its READY, from the node agent's log."""
    started: dict[str, float] = {}  # instance id -> when it was spawned
    model_to_s: dict[str, list[float]] = {}
    for at, text in log_lines(node_agent_log):
        if match := STARTED.search(text):
            started[match.group(1)] = at
        elif (match := READY.search(text)) and match.group(1) in started:
            model_to_s.setdefault(match.group(2), []).append(at - started.pop(match.group(1)))
    return model_to_s


def switches(node_agent_log: Path, since: float) -> list[dict]:
    """Each slot switched before break: when, to which model, plan to READY, plan to the old stopped."""
    out = []
    for at, text in log_lines(node_agent_log, since):
        if match := SWITCHED.search(text):
            out.append({"t_s": round(at - since, 1), "to_model": match.group(4), "gpus": match.group(3),
                        "ready_s": float(match.group(5)), "old_stopped_s": float(match.group(7))})
    return out


def divisions(reconfigurator_log: Path, since: float) -> list[dict]:
    """Each division the reconfigurator published (when, GPUs per model, running before) and when every
    node it changed answered."""
    out, by_id = [], {}
    for at, text in log_lines(reconfigurator_log, since):
        if match := DIVIDES.search(text):
            entry = {"plan_id": match.group(1), "t_s": round(at - since, 1),
                     "gpus": {m: int(n) for m, n in MODEL_GPUS.findall(match.group(2))},
                     "running": match.group(3), "done_s": None}
            by_id[entry["plan_id"]] = entry
            out.append(entry)
        elif (match := ANSWERED.search(text)) and match.group(1) in by_id:
            by_id[match.group(1)]["done_s"] = round(at - since, 1)
    return out


# --- the stack -------------------------------------------------------------------------------------


@dataclass
class Run:
    """One started stack: its ``dls up`` process, gateway URL and run directory (logs under ``logs/``)."""

    process: subprocess.Popen
    url: str
    run_dir: Path


def stack_env(args, models: list[str], extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, DLS_NATS_URL=f"nats://127.0.0.1:{free_port()}",
               DLS_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0", DLS_METRICS_PORT=str(free_port_range(24)))
    curve = quality_curve(WORKLOADS["short"], "none", args.model_dirs[0])
    if curve is not None and all(_has_curve(d, curve) for d in args.model_dirs):
        env.setdefault("DLS_SCHEDULER_QUALITY_CURVES", json.dumps([curve]))  # as bench.live_overload
    env.update(extra)
    return env


def _has_curve(model_dir: str, key: str) -> bool:
    path = bundle_dir(model_dir) / QUALITY
    return path.exists() and key in json.loads(path.read_text())


def start(args, name: str, workers_per_model: str, extra: dict[str, str]) -> Run:
    run_dir = Path(args.run_dir) / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    port = free_port()
    counts = [int(n) for n in workers_per_model.split(",")]
    argv = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--workers", str(sum(counts)),
            "--workers-per-model", workers_per_model, "--pace", str(args.paced_profile), "--run-dir", str(run_dir)]
    for model_dir in args.model_dirs:
        argv += ["--model", model_dir]
    url = f"http://127.0.0.1:{port}"
    said(f"{name}: starting dls up ({workers_per_model} workers per model) ...")
    process = launch_stack(argv, stack_env(args, args.models, extra), run_dir.with_suffix(".log"), url)
    run = Run(process, url, run_dir)
    wait_models(run, [m for m, n in zip(args.models, counts, strict=True) if n])
    said(f"{name}: serving at {url}")
    return run


def paced_profile(pace: str, scale: float, out_dir: Path) -> Path:
    """``pace`` at TP 1 with every step time times ``scale``, written under ``out_dir``: the workers are paced to it at
    scale 1, so the reconfigurator, which plans with the pace profile as it is (``dls up`` passes it no
    scale), plans with the step times the workers take."""
    data = json.loads(Path(pace).read_text())
    # TP 1 alone: the slots are single-GPU workers (a plan for a TP-4 instance would put one paced worker of
    # four CPU processes where four served)
    data["tp"] = {"1": data["tp"]["1"]}
    data["tp_efficiency"] = {"1": 1.0}
    for curves in data["tp"].values():
        for kind in ("recompute_ms", "cache_ms"):
            curves[kind] = {batch: ms * scale for batch, ms in curves[kind].items()}
    data["notes"] = f"{pace} with every step time x{scale:g} (bench.live_models); " + data.get("notes", "")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{Path(pace).stem}-x{scale:g}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def wait_models(run: Run, models: list[str], timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if set(models) <= set(ready_slots(run.url)):
            return
        time.sleep(1.0)
    raise RuntimeError(f"no READY worker of each of {models} within {timeout_s:.0f} s; see {run.run_dir}")


def cluster(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/cluster", timeout=5) as reply:
        return json.loads(reply.read())


def ready_slots(url: str) -> dict[str, int]:
    """Model -> its READY instances, from /v1/cluster (empty when it does not answer)."""
    try:
        instances = cluster(url)["instances"]
    except (OSError, KeyError, ValueError):
        return {}
    counts: dict[str, int] = {}
    for instance in instances:
        if instance["status"] == "READY":
            counts[instance["model"]] = counts.get(instance["model"], 0) + 1
    return counts


class SlotPoller:
    """Reads /v1/cluster every ``POLL_S`` in a thread: the READY and STARTING instances per model."""

    def __init__(self, url: str, t0: float) -> None:
        self.url, self.t0 = url, t0
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SlotPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                instances = cluster(self.url)["instances"]
            except (OSError, KeyError, ValueError):
                continue
            ready: dict[str, int] = {}
            starting: dict[str, int] = {}
            for instance in instances:
                into = ready if instance["status"] == "READY" else starting
                into[instance["model"]] = into.get(instance["model"], 0) + 1
            self.samples.append({"t_s": round(time.time() - self.t0, 1), "ready": ready, "other": starting})


def said(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


# --- the runs --------------------------------------------------------------------------------------


def isolated_ms(url: str, model: str, seed: int) -> float:
    """Median latency of requests of ``model`` sent one at a time at threshold 0.9."""
    latencies = []
    samples = poisson_plan(50.0, 1.0, slo_ms=600_000.0, seed=seed, max_tokens=MAX_TOKENS)[:ISOLATED_SAMPLES]
    for planned in samples:
        alone = dataclasses.replace(planned, arrival_s=0.0, min_threshold=0.9)
        [result] = asyncio.run(run_plan(url, [alone], model=model, cache="none"))
        if result.finished:
            latencies.append(result.latency_s * 1000.0)
    if not latencies:
        raise RuntimeError(f"no isolated request of {model} finished: pass --slo-ms")
    return statistics.median(latencies)


def probe(args) -> dict:
    """One worker per model: their spawn-to-READY times and isolated latencies."""
    run = start(args, "probe", ",".join("1" for _ in args.models), {"DLS_RECONFIGURATOR_ENABLED": "false"})
    try:
        isolated = {m: round(isolated_ms(run.url, m, args.seed + 100 + i), 1) for i, m in enumerate(args.models)}
    finally:
        stop_stack(run.process)
    boots = boot_times(run.run_dir / "logs" / "node_agent.log")
    said(f"probe: spawn to READY {({m: [round(x, 1) for x in v] for m, v in boots.items()})} s, "
         f"isolated latency at 0.9 {isolated} ms")
    return {"boot_s": {m: [round(s, 1) for s in v] for m, v in boots.items()}, "isolated_ms": isolated}


async def send_load(url: str, plans: dict[str, list[PlannedRequest]], timeout_s: float) -> dict[str, list[Result]]:
    """Every model's plan at once (one open-loop ``run_plan`` each, the same start)."""
    done = {"n": 0}
    total = sum(len(p) for p in plans.values())

    def progress(_result) -> None:
        done["n"] += 1
        if done["n"] % 100 == 0:
            said(f"  {done['n']}/{total} answered")

    results = await asyncio.gather(*(run_plan(url, plan, model=model, cache="none", timeout_s=timeout_s,
                                              progress=progress) for model, plan in plans.items()))
    return dict(zip(plans, results, strict=True))


def run_mix(args, name: str, extra: dict[str, str], plans: dict[str, list[PlannedRequest]],
            phases: list[Phase], then=None) -> dict:
    """Start a 2,2 stack, send the flipping mix while reading the slots, optionally ``then(run, t0)`` (the
    scale-from-zero phase), stop it and read its logs."""
    run = start(args, name, ",".join(str(n) for n in args.split), extra)
    try:
        t0 = time.time()
        said(f"{name}: {sum(len(p) for p in plans.values())} requests over {phases[-1].end_s:.0f} s "
             f"({', '.join(f'{m} {len(p)}' for m, p in plans.items())}) ...")
        with SlotPoller(run.url, t0) as poller:
            results = asyncio.run(send_load(run.url, plans, args.request_timeout_s))
            after = then(run, t0) if then else None
        report = {"by_model": {m: model_summary(r, phases) for m, r in results.items()},
                  "slots_over_time": poller.samples}
        if after is not None:
            report["scale_from_zero"] = after
    finally:
        stop_stack(run.process)
    logs = run.run_dir / "logs"
    report["divisions"] = divisions(logs / "reconfigurator.log", t0)
    report["switches"] = switches(logs / "node_agent.log", t0)
    report["switch_ready_s"] = distribution(s["ready_s"] for s in report["switches"])
    report["switch_old_stopped_s"] = distribution(s["old_stopped_s"] for s in report["switches"])
    report["follow"] = follow_delays(poller.samples, phases, args.period_s)
    for model, summary in report["by_model"].items():
        said(f"{name}: {model} attainment {summary['attainment']:.3f} ({summary['slo_met']}/{summary['sent']}), "
             f"lost {summary['lost']}, 5xx {summary['num_5xx']}")
    return report


def scale_from_zero(args, idle: str, busy: str):
    """The last phase: ``busy`` alone at the whole rate until the reconfigurator has no instance of
    ``idle`` (or ``args.zero_wait_s``), then one request of ``idle`` (openai SDK) and its wait."""

    def phase(run: Run, t0: float) -> dict:
        plan = poisson_plan(args.rate, args.zero_wait_s + 2 * args.period_s, slo_ms=None, max_tokens=MAX_TOKENS,
                            seed=args.seed * 1000 + 999)
        said(f"scale from zero: {busy} alone at {args.rate:g} req/s until {idle} has no instance ...")
        return asyncio.run(_zero_phase(args, run, t0, plan, idle, busy))

    return phase


async def _zero_phase(args, run: Run, t0: float, plan: list[PlannedRequest], idle: str, busy: str) -> dict:
    load = asyncio.create_task(run_plan(run.url, plan, model=busy, cache="none", timeout_s=args.request_timeout_s))
    began = time.time()
    zero_at = None
    while time.time() - began < args.zero_wait_s:
        await asyncio.sleep(POLL_S)
        on = await asyncio.to_thread(_instances_of, run.url, idle)
        if on == 0:
            zero_at = time.time()
            break
    out = {"idle_model": idle, "busy_model": busy, "load_began_s": round(began - t0, 1),
           "scaled_to_zero_after_s": None if zero_at is None else round(zero_at - began, 1)}
    if zero_at is None:
        said(f"scale from zero: {idle} still has an instance after {args.zero_wait_s:.0f} s: no cold start to time")
    else:
        said(f"scale from zero: {idle} at zero {zero_at - began:.0f} s after its load stopped; one request ...")
        out.update(await asyncio.to_thread(cold_request, run.url, idle))
        said(f"scale from zero: answered {out.get('status')} after {out.get('latency_s')} s, "
             f"X-DLS-Cold-Start-Ms {out.get('cold_start_ms')}")
    load.cancel()
    await asyncio.gather(load, return_exceptions=True)
    return out


def _instances_of(url: str, model: str) -> int | None:
    """STARTING or READY instances of ``model`` (None: /v1/cluster did not answer)."""
    try:
        instances = cluster(url)["instances"]
    except (OSError, KeyError, ValueError):
        return None
    return sum(i["model"] == model and i["status"] in ("READY", "STARTING") for i in instances)


def cold_start_from_boot(args, env: dict[str, str]) -> dict:
    """Where the reconfigurator did not scale the idle model to zero: a stack that starts with every slot on
    the first model (the second at zero from boot), the first model's load, one request of the second."""
    said("the idle model was not scaled to zero: a stack with it at zero from boot instead ...")
    run = start(args, "zero", f"{sum(args.split)},0", env)
    try:
        return scale_from_zero(args, idle=args.models[1], busy=args.models[0])(run, time.time())
    finally:
        stop_stack(run.process)


def cold_request(url: str, model: str) -> dict:
    """One request of ``model`` through the official ``openai`` SDK: its status, latency, wait header."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    sent = time.perf_counter()
    try:
        raw = client.completions.with_raw_response.create(model=model, prompt="12+30=", max_tokens=MAX_TOKENS)
    except openai.APIStatusError as exc:
        return {"status": exc.status_code, "latency_s": round(time.perf_counter() - sent, 2), "error": str(exc)[:200]}
    answer = raw.parse()
    header = raw.headers.get("x-dls-cold-start-ms")
    return {"status": raw.status_code, "latency_s": round(time.perf_counter() - sent, 2),
            "cold_start_ms": float(header) if header is not None else None, "text": answer.choices[0].text}


# --- setup and main ---------------------------------------------------------------------------------


def prepare_models(args) -> None:
    """Two model directories: the two ``--model``s, or the one given and a copy of it under another name."""
    dirs = args.model or [BUNDLED]
    if len(dirs) > 2:
        raise SystemExit("--model: at most two")
    if len(dirs) == 1:
        twin = Path(tempfile.mkdtemp(prefix="dls-live-models-")) / f"{Path(dirs[0]).name}-twin"
        shutil.copytree(dirs[0], twin, ignore=shutil.ignore_patterns("replay", "MODEL_CARD.md"))
        dirs = [dirs[0], str(twin)]
    args.model_dirs = dirs
    args.models = [Path(d).name for d in dirs]


def settings_from_probe(args, measured: dict | None) -> None:
    """``args.switch_s`` and ``args.slo_ms`` (model -> value), from the flags or the probe."""
    first, second = args.models
    if args.switch_s is None:
        boots = [s for v in measured["boot_s"].values() for s in v]
        value = round(max(boots), 1) if boots else 20.0
        args.switch_s = {m: value for m in args.models}
    else:
        args.switch_s = {m: args.switch_s for m in args.models}
    if args.slo_ms is None:
        iso = measured["isolated_ms"]
        args.slo_ms = {first: round(TIGHT_SLO_FACTOR * iso[first]), second: round(LOOSE_SLO_FACTOR * iso[second])}
    else:
        tight, loose = (float(x) for x in args.slo_ms.split(","))
        args.slo_ms = {first: tight, second: loose}


def pairs(values: dict) -> str:
    return ",".join(f"{m}={v:g}" for m, v in values.items())


def compare(static: dict, dynamic: dict) -> dict:
    """Per model: attainment of each run over the flipping phases and the difference in points."""
    out = {}
    for model in static["by_model"]:
        s, d = static["by_model"][model]["attainment"], dynamic["by_model"][model]["attainment"]
        out[model] = {"static": s, "division": d, "gain_pp": round(100 * (d - s), 1),
                      "per_phase": [{"static": a["attainment"], "division": b["attainment"]} for a, b in
                                    zip(static["by_model"][model]["per_phase"], dynamic["by_model"][model]["per_phase"],
                                        strict=True)]}
    return out


def verdict(report: dict, period_s: float) -> dict:
    """The acceptance points, each true or false, from the report."""
    dynamic, static = report["division"], report["static"]
    flips = dynamic["follow"][1:]  # phase 1 starts from the even split; the flips are phases 2 and 3
    zero = dynamic.get("scale_from_zero") or {}
    runs = (dynamic, static)
    return {
        "slots_follow_within_two_periods": all(f["periods"] is not None and f["periods"] <= 2.0 for f in flips),
        "no_request_lost": all(m["lost"] == 0 for r in runs for m in r["by_model"].values()),
        "no_5xx": all(m["num_5xx"] == 0 for r in runs for m in r["by_model"].values()),
        "each_model_beats_static": all(c["gain_pp"] > 0 for c in report["comparison"].values()),
        "scaled_to_zero_and_answered": zero.get("status") == 200,
        "answered_from_zero_at_boot": (report.get("cold_start_from_boot") or {}).get("status") == 200,
        "period_s": period_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=None, metavar="DIR",
                   help=f"a served model directory, twice for two (default {BUNDLED}; one: a copy of it is the "
                        "second); the first gets the tight SLO")
    p.add_argument("--split", default="2,2", help="the first workers per model (the static split); 4 slots")
    p.add_argument("--rate", type=float, default=4.0, help="total arrivals per second (about 0.8x what 4 slots serve)")
    p.add_argument("--phase-s", type=float, default=120.0, help="seconds of each of the three phases")
    p.add_argument("--period-s", type=float, default=30.0, help="the reconfigurator's period (and its window)")
    p.add_argument("--zero-wait-s", type=float, default=180.0,
                   help="how long the last phase waits for the idle model to be scaled to zero")
    p.add_argument("--switch-s", type=float, default=None,
                   help="each model's DLS_RECONFIGURATOR_SWITCH_S; default: the probe's longest spawn-to-READY")
    p.add_argument("--slo-ms", default=None, metavar="TIGHT,LOOSE",
                   help="the two models' SLOs; default: 3x and 6x their isolated latency at 0.9 (the probe)")
    p.add_argument("--pace", default="profiles/llada-8b-h100.json")
    p.add_argument("--pace-scale", type=float, default=20.0,
                   help="each step paced as this many LLaDA-8B steps (the pace profile is written scaled, and every "
                        "service plans with it)")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="short phases and period: an end-to-end check")
    p.add_argument("--run-dir", default="runs/live-models")
    p.add_argument("--json", default="docs/bench/live-models.json")
    args = p.parse_args(argv)
    if args.quick:
        args.phase_s, args.period_s, args.zero_wait_s = 60.0, 20.0, 90.0
    args.split = [int(n) for n in args.split.split(",")]
    prepare_models(args)
    args.paced_profile = paced_profile(args.pace, args.pace_scale, Path(args.run_dir))
    report = {"config": {}, "probe": None}
    if args.switch_s is None or args.slo_ms is None:
        report["probe"] = probe(args)
    settings_from_probe(args, report["probe"])
    phases = flip_phases(args.models, args.phase_s)
    plans = model_plans(phases, args.rate, args.seed)
    # the reconfigurator's rates count arrivals over its window as the scheduler's stats bring them: stats
    # every 10 s (the default) would leave a third of a 30 s window unseen at each plan
    common = {"DLS_GATEWAY_MODEL_SLO_MS": pairs(args.slo_ms), "DLS_SCHEDULER_STATS_INTERVAL_S": "2"}
    division = {**common, "DLS_RECONFIGURATOR_INTERVAL_S": str(args.period_s),
                "DLS_RECONFIGURATOR_WINDOW_S": str(args.period_s), "DLS_RECONFIGURATOR_PEAK_WINDOWS": "1",
                "DLS_RECONFIGURATOR_SWITCH_S": pairs(args.switch_s),
                "DLS_RECONFIGURATOR_MIN_INSTANCES": pairs({args.models[0]: 1, args.models[1]: 0}),
                # the clients send cache none: the monitor must count every step as a full forward
                "DLS_RECONFIGURATOR_CACHE": "none",
                "DLS_NODE_AGENT_OVERLAP_SWITCH": "on"}
    static = {**common, "DLS_RECONFIGURATOR_ENABLED": "false"}
    report["config"] = {
        "models": args.models, "split": args.split, "rate_rps": args.rate, "phase_s": args.phase_s,
        "phases": [dataclasses.asdict(ph) for ph in phases], "period_s": args.period_s, "slo_ms": args.slo_ms,
        "switch_s": args.switch_s, "pace": args.pace, "pace_scale": args.pace_scale,
        "paced_profile": str(args.paced_profile), "seed": args.seed,
        "quick": args.quick, "static_env": static, "division_env": division,
        "command": "python -m bench.live_models " + " ".join(argv if argv is not None else sys.argv[1:])}
    said(f"models {args.models}, SLOs {args.slo_ms} ms, switch {args.switch_s} s, {args.rate:g} req/s, "
         f"phases of {args.phase_s:.0f} s, period {args.period_s:.0f} s")
    report["static"] = run_mix(args, "static", static, plans, phases)
    report["division"] = run_mix(args, "division", division, plans, phases,
                                 then=scale_from_zero(args, idle=args.models[1], busy=args.models[0]))
    if (report["division"].get("scale_from_zero") or {}).get("status") != 200:
        report["cold_start_from_boot"] = cold_start_from_boot(args, division)
    report["comparison"] = compare(report["static"], report["division"])
    report["acceptance"] = verdict(report, args.period_s)
    said(f"comparison {json.dumps(report['comparison'])}")
    said(f"acceptance {json.dumps(report['acceptance'])}")
    emit_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
