"""bench.live_vs_sim: the live-vs-sim runs of a preset gathered into one JSON, gaps in points."""

import json

import pytest

from bench.live_vs_sim import gather, main


def _write(out, rate, live_slo, sim_slo, cp_slo, cp_ms=6.0):
    def sim(slo, cp):
        return {"setup": {"step_time_scale": 4.37, "profile_anchor_context_tokens": 201, "control_plane_ms": cp},
                "policies": {"dilaserve": {"points": [{"rps": 4.7, "slo_attainment": slo, "accuracy": 1.0, "mean_steps": 14.0,
                                                       "mean_latency_s": 3.0, "p99_latency_s": 6.0,
                                                       "mean_threshold": 0.75}]}}}
    (out / f"sim-{rate}.json").write_text(json.dumps(sim(sim_slo, 0.0)))
    (out / f"sim-cp-{rate}.json").write_text(json.dumps(sim(cp_slo, cp_ms)))
    (out / f"live-{rate}.json").write_text(json.dumps({"num_requests": 270, "slo_attainment": live_slo,
                                                        "accuracy": 1.0, "control_plane": {"mean_ms": cp_ms}}))


def test_gaps_are_measured_against_both_simulator_runs(tmp_path):
    _write(tmp_path, "4.5", 0.80, 0.90, 0.82)
    _write(tmp_path, "8", 0.30, 0.42, 0.33, cp_ms=7.5)
    result = gather("live-local-long", tmp_path, [4.5, 8.0])
    first, second = result["points"]
    assert (first["gap_pp"], first["gap_cp_pp"]) == (10.0, 2.0)
    assert (second["gap_pp"], second["gap_cp_pp"]) == (12.0, 3.0)
    assert second["sim_cp"]["control_plane_ms"] == 7.5 and second["replayed_rps"] == 4.7
    assert result["commands"] == ["scripts/live-vs-sim.sh live-local-long 4.5 270",
                                  "scripts/live-vs-sim.sh live-local-long 8 270"]
    assert "--pace-scale 4.37" in result["live_stack"]


def test_a_missing_run_names_the_command_that_makes_it(tmp_path, capsys):
    _write(tmp_path, "4.5", 0.80, 0.90, 0.82)
    assert main(["--preset", "live-local-long", "--dir", str(tmp_path), "--rates", "4.5,8"]) == 2
    assert "scripts/live-vs-sim.sh live-local-long 8" in capsys.readouterr().err


def test_rates_must_be_numbers(tmp_path):
    with pytest.raises(SystemExit):
        main(["--preset", "live-local-long", "--dir", str(tmp_path), "--rates", "fast"])


def test_late_yields_are_read_from_each_side(tmp_path):
    """The simulator's count from its point, the live scheduler's from the counters line it logs when
    it stops (the script's stack-RATE run directory); none where that log is missing."""
    _write(tmp_path, "7", 0.25, 0.32, 0.30)
    point = json.loads((tmp_path / "sim-7.json").read_text())
    point["policies"]["dilaserve"]["points"][0]["late_yields"] = 314
    (tmp_path / "sim-7.json").write_text(json.dumps(point))
    assert gather("live-local", tmp_path, [7.0])["points"][0]["late_yields"] == {"live": None, "sim": 314}
    logs = tmp_path / "stack-7" / "logs"
    logs.mkdir(parents=True)
    (logs / "scheduler.log").write_text(
        "2026-12-07 21:06:31,833 dls.scheduler INFO scheduler ready\n"
        "2026-12-07 21:08:24,395 dls.scheduler INFO scheduler stopped; step counters: "
        "{'continued_steps': 33, 'pipelined_steps': 30, 'late_yields': 219}\n")
    result = gather("live-local", tmp_path, [7.0])["points"][0]
    assert result["late_yields"] == {"live": 219, "sim": 314}
    assert result["live_step_counters"]["pipelined_steps"] == 30
