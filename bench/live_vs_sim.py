"""Gather ``scripts/live-vs-sim.sh`` runs into one JSON (docs/live-vs-sim.md, docs/bench/live-vs-sim*.json).

    python -m bench.live_vs_sim --preset live-local-long --dir runs/live-vs-sim-long --rates 4.5,8 \\
        --json docs/bench/live-vs-sim-long.json

For each rate it reads OUT_DIR/{sim,sim-cp,live}-RATE.json (what the script wrote) and reports the live
side (``dls loadgen``), the simulator with the GPU profile alone (``sim``) and with the live run's
control-plane time per step (``sim_cp``), and the SLO-attainment gaps in points.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

from bench.common import emit_json

LIVE_KEYS = ("completed", "failed", "slo_attainment", "accuracy", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
             "mean_ttft_ms", "mean_steps", "mean_threshold", "request_throughput")
SIM_KEYS = ("rps", "slo_attainment", "accuracy", "mean_latency_s", "p99_latency_s", "mean_steps", "mean_threshold",
            "mean_batch_when_queued", "mean_batch_deep_queue", "num_steps_deep_queue", "breakdown", "late_yields")
# the live scheduler's step counters, from the line it logs when it stops (the script's stack-RATE/ run dir)
COUNTERS_LINE = re.compile(r"scheduler stopped; step counters: (\{.*\})")


def live_counters(run_dir: Path) -> dict | None:
    """The live scheduler's step counters (late yields, pipelined steps, ...), or None without its log."""
    log = run_dir / "logs" / "scheduler.log"
    if not log.exists():
        return None
    found = COUNTERS_LINE.findall(log.read_text(errors="replace"))
    return ast.literal_eval(found[-1]) if found else None


def _rate_name(rate: float) -> str:
    return f"{rate:g}"


def _sim_point(path: Path) -> tuple[dict, dict]:
    data = json.loads(path.read_text())
    point = data["policies"]["dilaserve"]["points"][0]
    return {k: point.get(k) for k in SIM_KEYS}, data["setup"]


def gather(preset: str, out_dir: Path, rates: list[float]) -> dict:
    points, setup = [], {}
    for rate in rates:
        name = _rate_name(rate)
        files = {kind: out_dir / f"{kind}-{name}.json" for kind in ("sim", "sim-cp", "live")}
        missing = [str(p) for p in files.values() if not p.exists()]
        if missing:
            raise FileNotFoundError(f"rate {name}: run scripts/live-vs-sim.sh {preset} {name} N {out_dir} first "
                                    f"(missing {', '.join(missing)})")
        sim, setup = _sim_point(files["sim"])
        sim_cp, cp_setup = _sim_point(files["sim-cp"])
        live_report = json.loads(files["live"].read_text())
        live = {k: live_report.get(k) for k in LIVE_KEYS}
        counters = live_counters(out_dir / f"stack-{name}")
        points.append({
            "rate_rps": rate,
            "num_requests": live_report.get("num_requests"),
            "replayed_rps": sim["rps"],  # the Poisson draw's own mean rate, which both sides replay
            "live": live,
            "control_plane": live_report.get("control_plane"),
            "sim": sim,
            "sim_cp": {**sim_cp, "control_plane_ms": cp_setup.get("control_plane_ms")},
            # requests per batched step while some request waited for its first step, each side
            "mean_batch_when_queued": {"live": (live_report.get("batch_when_queued") or {}).get("mean_batch"),
                                       "sim": sim.get("mean_batch_when_queued")},
            # the same over the steps composed while requests were queued, placed nowhere (a deep queue)
            "mean_batch_deep_queue": {
                "live": ((live_report.get("batch_when_queued") or {}).get("deep_queue") or {}).get("mean_batch"),
                "sim": sim.get("mean_batch_deep_queue")},
            # seconds from arrival to the first step, each side
            "first_step_wait_s": {"live": (live_report.get("batch_when_queued") or {}).get("mean_first_step_wait_s"),
                                  "sim": (sim.get("breakdown") or {}).get("queueing_s")},
            # requests that left a step to those still on time (late yields), each side, and the live
            # scheduler's other step counters
            "late_yields": {"live": (counters or {}).get("late_yields"), "sim": sim.get("late_yields")},
            "live_step_counters": counters,
            "gap_pp": round(100 * abs(live["slo_attainment"] - sim["slo_attainment"]), 1),
            "gap_cp_pp": round(100 * abs(live["slo_attainment"] - sim_cp["slo_attainment"]), 1),
        })
    return {
        "preset": preset,
        "setup": setup,
        "commands": [f"scripts/live-vs-sim.sh {preset} {_rate_name(p['rate_rps'])} {p['num_requests']}"
                     for p in points],
        "live_stack": (f"dls up --workers 2 --pace profiles/llada-8b-h100.json --pace-scale {setup.get('step_time_scale')} "
                       f"--pace-context {setup.get('profile_anchor_context_tokens')} (overlap and pipelining on)"),
        "note": ("same arrivals and prompts on both sides (dls loadgen --dry-run --save-trace, seed 0); 'sim' is the "
                 "simulator with the GPU profile alone, 'sim_cp' with the control-plane time per step the live run "
                 "measured from its requests' step timelines (dls loadgen --timelines; CONTROL_PLANE_MS overrides)"),
        "points": points,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True, help="the preset the runs used (live-local or live-local-long)")
    p.add_argument("--dir", required=True, type=Path, help="the OUT_DIR the script wrote")
    p.add_argument("--rates", required=True, help="comma-separated rates, as passed to the script")
    p.add_argument("--json", help="write the JSON here too")
    args = p.parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        p.error(f"--rates: not a comma-separated list of numbers: {args.rates!r}")
    try:
        result = gather(args.preset, args.dir, rates)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    emit_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
