"""`python -m bench.reconfig --quick`: the machine-readable summary and the acceptance timings."""

from __future__ import annotations

import json

from bench import reconfig
from services.reconfigurator.core.example_profile import example_profile


def test_quick_bench_writes_the_summary(tmp_path, capsys, monkeypatch):
    # The built-in profile, so the test does not depend on profiles/llada-8b-h100.json.
    monkeypatch.setattr(reconfig, "load_profile", lambda: (example_profile(), "built-in example profile"))
    out = tmp_path / "bench-reconfig.json"
    assert reconfig.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert set(result["solve_s"]) == {"16", "256", "1024"}
    # Acceptance (medians): 16 GPUs under 1 s, 1,024 GPUs under 30 s; both are far below on 2 cores.
    assert result["solve_s"]["16"] < 1.0
    assert result["solve_s"]["1024"] < 30.0
    plans = result["plans"]
    assert [p["rps"] for p in plans] == sorted(p["rps"] for p in plans)
    for plan in plans:
        assert set(plan) >= {"rps", "instances_by_tp", "avg_threshold"}
        assert sum(int(tp) * n for tp, n in plan["instances_by_tp"].items()) <= 16
    assert plans[0]["instances_by_tp"]["4"] > 0 and plans[0]["avg_threshold"] == 0.9
    assert plans[-1]["instances_by_tp"]["1"] == 16
