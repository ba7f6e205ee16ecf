"""``bench.control_plane`` at a tiny size: it runs end to end and writes the summary fields.

Behaviour only (the JSON's shape and that steps ran), never timings: the benchmark's figures depend
on the machine and its load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_control_plane_bench_writes_its_summary(tmp_path):
    out = tmp_path / "cp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.control_plane", "--instances", "2", "--requests", "8", "--gen-length", "96",
         "--warmup", "0.5", "--duration", "1", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["instances"] == 2 and report["requests"] == 8
    assert {"p50", "p99"} <= set(report["overhead_ms"])
    assert {"nats_rtt", "redis_rtt"} <= set(report["floor_ms"])
    assert report["overhead_ms"]["samples"] > 0
    assert report["steps_per_s"] > 0
    assert report["event_loop"] in ("uvloop", "asyncio")
    assert {"results_to_command_issued_p50", "command_flight_p50"} <= set(report["breakdown_ms"])
    assert {"nats_rtt", "redis_rtt"} <= set(report["floor_under_load_ms"])
    # 96 tokens at one a step, blocks of 32: most steps have 32 tokens to go and no block start
    assert report["scheduler_counters"]["continued_steps"] > 0
    # pipelining: steps ran from a command held by the worker (with repeats, all of them may have)
    assert report["scheduler_counters"]["pipelined_steps"] > 0 and 0 < report["pipelined_share"] <= 1
    # a repeat is a held command run again: a part of the pipelined steps
    assert 0 <= report["repeated_share"] <= report["pipelined_share"]
    # the steps that waited for a command are a part of all steps (none at all when repeats covered every gap)
    assert 0 <= report["overhead_round_trip_ms"]["samples"] <= report["overhead_ms"]["samples"]
    # the instances' time with requests held and no step running: a share of their wall time
    assert 0 <= report["gpu_idle_share"] <= 1
    # steps run from a held command that came after the step before had ended (none in hand then)
    assert 0 <= report["late_held_share"] <= 1 - report["pipelined_share"]
    # the 8 requests run as two batches of about 4: a dispatch that splits an instance's requests into
    # two half batches taking turns (an early dispatch once did) halves this
    assert report["mean_batch"] >= 0.6 * report["requests"] / report["instances"]
    for value in (*report["overhead_ms"].values(), *report["floor_ms"].values()):
        assert value >= 0
