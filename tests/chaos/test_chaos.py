"""The chaos run as a pytest module (marker ``chaos``, out of the default run): scenarios 1-6 against
real processes, none losing or duplicating a request. ``make test-chaos`` runs the same thing as
``python -m tests.chaos``."""

from __future__ import annotations

import json

import pytest

from tests.chaos.__main__ import main

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]


def test_no_request_lost_or_duplicated_in_any_scenario(tmp_path):
    report_path = tmp_path / "chaos-report.json"
    code = main(["--report", str(report_path), "--run-dir", str(tmp_path / "runs")])
    report = json.loads(report_path.read_text())
    assert sorted(report) == ["1_worker_kill", "2_scheduler_restart", "3_gateway_restart", "4_nats_node_loss",
                              "5_redis_restart", "6_overload"]
    for name, result in report.items():
        assert "error" not in result, (name, result)
        assert result["lost"] == 0 and result["duplicated"] == 0, (name, result)
        assert result["completed"] > 0, (name, result)
    assert code == 0
