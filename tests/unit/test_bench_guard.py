"""The benchmark guard (bench/guard.py): the floors file holds, figures are reduced from the commands'
JSON as documented, and the command fails on a deliberately weakened figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import guard

REPO_ROOT = Path(__file__).resolve().parents[2]


def _compare(points: dict[str, dict[str, tuple[float, float]]]) -> dict:
    """A `dls compare --json` result: policy -> label -> (SLO attainment, accuracy)."""
    return {"policies": {policy: {"points": [{"label": label, "slo_attainment": slo, "accuracy": acc}
                                             for label, (slo, acc) in by_label.items()]}
                         for policy, by_label in points.items()}}


def test_every_floor_has_a_bound_a_target_and_the_measured_figure_holds_it():
    floors = guard.read_floors()
    assert floors, "bench/floors.toml is empty"
    for name, entry in floors.items():
        assert {"figure", "command", "size", "target", "measured"} <= set(entry), name
        verdict = guard.check({name: entry["measured"]}, {name: entry})[name]
        assert verdict["ok"], f"{name}: the figure measured when its floor was set fails it"


def test_every_guarded_figure_is_produced_by_a_run():
    runs = guard.runs(Path("runs/guard"))
    result = _compare({"dilaserve": {"0.6x": (1.0, 1.0), "1.5x": (0.6, 1.0), "2.0x": (0.5, 1.0)},
                       "infaas": {"0.6x": (1.0, 1.0), "1.5x": (0.2, 1.0), "2.0x": (0.3, 1.0)},
                       "llumnix": {"0.6x": (1.0, 1.0), "1.5x": (0.2, 1.0), "2.0x": (0.3, 1.0)}})
    predictor = {"relative_error": {"one_shot": 0.8, "progress": 0.6, "progress_confidence": 0.5},
                 "by_family": {"chain": {"one_shot": 0.9, "progress": 0.7, "progress_confidence": 0.6}},
                 "total_ratio": {"one_shot": 0.5, "progress": 0.9, "progress_confidence": 0.97}}
    produced: dict[str, float] = {}
    for run in runs:
        produced.update(run.figures(predictor if run.name == "predictor" else result))
    assert set(guard.read_floors()) == set(guard.combine(produced))


def test_gaps_take_the_better_baseline_per_point():
    result = _compare({"dilaserve": {"1.0x": (0.95, 0.99), "2.0x": (0.50, 0.98)},
                       "infaas": {"1.0x": (0.97, 0.99), "2.0x": (0.30, 0.99)},
                       "llumnix": {"1.0x": (0.96, 0.995), "2.0x": (0.35, 0.98)}})
    gaps = guard.gaps(result)
    assert gaps["1.0x"] == pytest.approx((-2.0, 0.5))
    assert gaps["2.0x"] == pytest.approx((15.0, 1.0))
    figures = guard.combine(guard._trace_figures("azure_conv", top=True)(result))
    assert figures == pytest.approx({"azure_conv_worst_gap_pp": -2.0, "azure_conv_top_lead_pp": 15.0,
                                     "accuracy_loss_pp": 1.0})


def _run_guard(tmp_path: Path, figures: dict[str, float]) -> subprocess.CompletedProcess:
    path = tmp_path / "figures.json"
    path.write_text(json.dumps(figures))
    return subprocess.run([sys.executable, "-m", "bench.guard", "--figures", str(path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


def test_the_guard_passes_the_measured_figures_and_fails_a_weakened_one(tmp_path):
    floors = guard.read_floors()
    measured = {name: entry["measured"] for name, entry in floors.items()}
    passed = _run_guard(tmp_path, measured)
    assert passed.returncode == 0, passed.stderr
    assert json.loads(passed.stdout)["failed"] == []

    weakened = dict(measured)
    weakened["paper_bench_long_lead_pp"] = floors["paper_bench_long_lead_pp"]["floor"] - 0.5  # a lead that slipped
    weakened["predictor_error_ratio"] = floors["predictor_error_ratio"]["ceiling"] + 0.1  # a predictor that got worse
    failed = _run_guard(tmp_path, weakened)
    assert failed.returncode == 1
    report = json.loads(failed.stdout)
    assert report["failed"] == ["predictor_error_ratio", "paper_bench_long_lead_pp"]
    assert "FAILED paper_bench_long_lead_pp" in failed.stderr and "bench/floors.toml" in failed.stderr


def test_a_floors_entry_needs_exactly_one_bound(tmp_path):
    path = tmp_path / "floors.toml"
    path.write_text('[x]\nfigure = "x"\nfloor = 1.0\nceiling = 2.0\n')
    with pytest.raises(guard.GuardError, match="exactly one of floor and ceiling"):
        guard.read_floors(path)
