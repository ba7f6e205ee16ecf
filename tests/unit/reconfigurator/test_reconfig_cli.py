"""`dls reconfig solve`: prints the plan and solve times; bad files are user errors naming the field."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from services.reconfigurator import cli
from shared.cli import CliError
from tests.unit.reconfigurator.reconfig_builders import profile_dict

EXAMPLES = Path(__file__).resolve().parents[3] / "services" / "reconfigurator" / "examples"


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dls")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def profile_path(tmp_path) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_dict()))
    return str(path)


def test_solve_prints_plan_and_solve_times(profile_path, capsys):
    code = run(
        [
            "reconfig",
            "solve",
            "--workload",
            str(EXAMPLES / "workload.json"),
            "--cluster",
            str(EXAMPLES / "cluster-16.json"),
            "--profile",
            profile_path,
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    capacity = report["plan"]["capacity"]
    assert capacity["num_gpus_used"] <= 16
    assert set(report["solve_s"]) >= {"stage1", "stage2", "current", "stage1_plus_stage2"}
    assert report["plan"]["plan_id"] == "plan-1"
    assert report["decision"]["apply"] in (True, False)
    placement = report["plan"]["placement"]
    assert len(placement["nodes"]) == 4
    assert placement["num_kept"] + placement["num_stopped"] == 16


def test_solve_text_output(profile_path, capsys):
    run(
        [
            "reconfig",
            "solve",
            "--workload",
            str(EXAMPLES / "workload.json"),
            "--cluster",
            str(EXAMPLES / "cluster-16.json"),
            "--profile",
            profile_path,
        ]
    )
    out = capsys.readouterr().out
    assert "instances:" in out and "keep" in out and "solve: stage 1" in out


def test_bad_workload_is_a_user_error_naming_the_field(tmp_path, profile_path):
    data = json.loads((EXAMPLES / "workload.json").read_text())
    data["classes"][1]["rate"] = -2
    bad = tmp_path / "workload.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(CliError, match=r"classes\[1\]\.rate"):
        run(
            [
                "reconfig",
                "solve",
                "--workload",
                str(bad),
                "--cluster",
                str(EXAMPLES / "cluster-16.json"),
                "--profile",
                profile_path,
            ]
        )


def test_bad_cluster_is_a_user_error_naming_the_field(tmp_path, profile_path):
    data = json.loads((EXAMPLES / "cluster-16.json").read_text())
    data["placement"][0]["gpu_ids"] = [9]
    bad = tmp_path / "cluster.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(CliError, match=r"placement\[0\]\.gpu_ids: GPU 9 does not exist"):
        run(
            [
                "reconfig",
                "solve",
                "--workload",
                str(EXAMPLES / "workload.json"),
                "--cluster",
                str(bad),
                "--profile",
                profile_path,
            ]
        )
