"""A short soak as a pytest test (marker ``chaos``, out of the default run; ``make test-soak`` runs the
real one): two minutes of load and faults, no request lost or duplicated, every fault recovered."""

from __future__ import annotations

import json

import pytest

from tests.soak.__main__ import main

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1800)]


def test_a_short_soak_loses_and_duplicates_nothing(tmp_path):
    report_path = tmp_path / "soak-report.json"
    code = main(["--minutes", "2", "--json", str(report_path), "--run-dir", str(tmp_path / "runs")])
    report = json.loads(report_path.read_text())
    assert report["problems"] == [] and code == 0, report.get("problems")
    assert report["lost"] == 0 and report["duplicated"] == 0 and report["failed"] == 0
    assert report["completed"] == report["accepted"] > 0
    assert report["faults"] >= 8 and len(report["fault_kinds"]) >= 7
