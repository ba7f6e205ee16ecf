"""Decision time per scheduling event, by cluster size and number of running requests.

    python -m bench.scheduler --json runs/bench-scheduler.json [--quick] [--policy dilaserve]

For each (instances, requests) pair: instances of TP 1, 1, 2, 4 (repeating) with the modelled
LLaDA-8B/H100 profile; ``requests`` requests kept active (a finished one is replaced by a new
arrival; those beyond the cluster's batch slots wait in the queue). A fake engine produces step
outcomes with a fresh remaining-step prediction for every request at every step (the most work the
policy can be given). An event is one step result of one instance (all its requests) or one arrival;
the time measured is the whole ``SchedulingLoop`` call: recording the event in the view, the
policy's decision, and applying it. Prints the JSON and writes it to ``--json``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import emit_json
from services.scheduler.core import ClusterView, Request, SchedulingLoop, make_policy
from services.scheduler.core.load import cache_step_weight, cluster_token_steps_per_s
from services.scheduler.fake_engine import FakeEngine
from shared.profiles import LatencyProfile

PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "llada-8b-h100.json"
INSTANCE_COUNTS = (16, 128, 1024)
REQUEST_COUNTS = (100, 1000, 10000)
TP_CYCLE = (1, 1, 2, 4)
TARGET = {"instances": 16, "requests": 1000, "p50_max_ms": 1.0}


def build_view(profile: LatencyProfile, num_instances: int) -> ClusterView:
    view = ClusterView()
    for i in range(num_instances):
        view.add_instance(f"n{i // 8}/i{i}", TP_CYCLE[i % len(TP_CYCLE)], profile, node_id=f"n{i // 8}")
    return view


def near_capacity_slo(view: ClusterView, num_requests: int) -> float:
    """An SLO at which the active requests' work at threshold 0.9 about fills the cluster's capacity
    window (never below 3 s, ~5x the isolated TP-1 latency): the load controller then has to narrow
    ranges, its most expensive regime."""
    work_per_request = (140 + 256) * (8 + cache_step_weight(view) * 72)  # tokens x (rec + kappa cache)
    return max(3.0, num_requests * work_per_request / cluster_token_steps_per_s(view))


class Workload:
    """Request factory: ShareGPT-like prompt lengths (mean ~140), generation 256, block 32."""

    def __init__(self, engine: FakeEngine, rng: np.random.Generator, slo_s: float) -> None:
        self.engine = engine
        self.rng = rng
        self.slo_s = slo_s
        self.num_made = 0

    def make(self, now: float, mid_flight: bool = False) -> Request:
        """A new request; ``mid_flight``: already part-way through (for the initial population)."""
        prompt = int(np.clip(self.rng.lognormal(np.log(140), 0.6), 16, 1024))
        slo_s = self.slo_s * float(self.rng.uniform(0.5, 1.5))
        request = Request(f"r{self.num_made}", now, prompt, 256, slo_s=slo_s)
        request.priority = int(self.rng.random() < 0.1)
        if mid_flight:
            tokens = int(self.rng.integers(0, 256))
            request.num_tokens_committed, request.current_block = tokens, tokens // request.block_len
            request.num_block_steps = int(tokens % request.block_len > 0)
        request.record_prediction(self.engine.predict_for(request))
        self.num_made += 1
        return request


def run_config(policy_name: str, profile, num_instances: int, num_requests: int, num_events: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    engine = FakeEngine(np.random.default_rng(seed + 1), predict=True)
    view = build_view(profile, num_instances)
    workload = Workload(engine, np.random.default_rng(seed + 2), near_capacity_slo(view, num_requests))
    loop = SchedulingLoop(make_policy(policy_name, rng=seed), view)
    now = 0.0
    loop.on_arrivals(now, [workload.make(now, mid_flight=True) for _ in range(num_requests)])
    step_ms, arrival_ms = [], []
    num_warmup = max(num_events // 5, 10)
    for k in range(num_events + num_warmup):
        busy = [inst.instance_id for inst in view.instances.values() if inst.batch]
        inst_id = busy[int(rng.integers(len(busy)))]
        result = engine.run_step(view, inst_id)
        now += view.instances[inst_id].latency(1, max(view.instances[inst_id].batch, 1)) / len(busy)
        elapsed = timed(loop.on_step_result, now, result)
        if k >= num_warmup:
            step_ms.append(elapsed)
        for _ in range(sum(o.finished for o in result.outcomes)):
            elapsed = timed(loop.on_arrival, now, workload.make(now))
            if k >= num_warmup:
                arrival_ms.append(elapsed)
    return {**summarise(num_instances, num_requests, step_ms, arrival_ms, view), "slo_s": round(workload.slo_s, 2)}


def timed(call, *args) -> float:
    start = time.perf_counter()
    call(*args)
    return (time.perf_counter() - start) * 1e3


def summarise(num_instances, num_requests, step_ms, arrival_ms, view) -> dict:
    every = np.array(step_ms + arrival_ms)
    thresholds = [r.threshold for r in view.requests.values() if r.threshold is not None]
    return {
        "instances": num_instances,
        "requests": num_requests,
        "p50": round(float(np.percentile(every, 50)), 4),
        "p99": round(float(np.percentile(every, 99)), 4),
        "mean": round(float(every.mean()), 4),
        "events": int(len(every)),
        "step_events": len(step_ms),
        "step_p50": round(float(np.percentile(step_ms, 50)), 4),
        "arrival_events": len(arrival_ms),
        "arrival_p50": round(float(np.percentile(arrival_ms, 50)), 4) if arrival_ms else None,
        "running": sum(inst.batch for inst in view.instances.values()),
        "queued": view.num_queued,
        "mean_threshold": round(float(np.mean(thresholds)), 3) if thresholds else None,
    }


def growth(rows: list[dict]) -> dict:
    """p50 relative to the smallest configuration, keyed "instances x requests"."""
    base = rows[0]["p50"] or 1e-9
    return {f'{r["instances"]}x{r["requests"]}': round(r["p50"] / base, 2) for r in rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Scheduler decision time per event")
    parser.add_argument("--json", type=Path, help="write the JSON report here")
    parser.add_argument("--quick", action="store_true", help="fewer events per configuration")
    parser.add_argument("--policy", default="dilaserve")
    parser.add_argument("--events", type=int, help="measured step events per configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, default=PROFILE)
    args = parser.parse_args(argv)
    profile = LatencyProfile.load(args.profile)
    num_events = args.events or (60 if args.quick else 1000)
    rows = []
    for num_instances in INSTANCE_COUNTS:
        for num_requests in REQUEST_COUNTS:
            row = run_config(args.policy, profile, num_instances, num_requests, num_events, args.seed)
            rows.append(row)
            print(f"{num_instances:5d} instances {num_requests:6d} requests: p50 {row['p50']:.3f} ms "
                  f"p99 {row['p99']:.3f} ms", file=sys.stderr)
    target_row = next(r for r in rows if (r["instances"], r["requests"]) == (TARGET["instances"], TARGET["requests"]))
    report = {
        "benchmark": "scheduler",
        "policy": args.policy,
        "profile": str(args.profile.name),
        "events_per_config": num_events,
        "unit": "ms per scheduling event (record + decide + apply)",
        "python": platform.python_version(),
        "decision_ms": rows,
        "growth_p50": growth(rows),
        "target": {**TARGET, "p50_ms": target_row["p50"], "met": target_row["p50"] <= TARGET["p50_max_ms"]},
    }
    emit_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
