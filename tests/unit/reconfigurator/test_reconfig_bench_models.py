"""`bench.reconfig`'s several-model case: the fields it reports (timings are reported, not asserted)."""

from __future__ import annotations

from bench import reconfig
from services.reconfigurator.core.example_profile import example_profile
from services.reconfigurator.core.files import load_workload


def test_the_models_case_reports_its_division_and_solve_times():
    workload = load_workload(reconfig.WORKLOAD_PATH)
    result = reconfig.time_models(workload, example_profile(), num_models=2, repeats=1)
    assert result["num_models"] == 2 and result["num_gpus"] == 64
    assert result["solve_s"] > 0 and result["max_s"] >= result["solve_s"]
    assert [r["rps"] for r in result["runs"]] == list(reconfig.MODELS_TIMED_RPS)
    for run in result["runs"]:
        assert set(run["gpus_by_model"]) == {"model-0", "model-1"}
        assert sum(run["gpus_by_model"].values()) <= 64
        assert not run["fallback"]
    # The heaviest level moves GPUs to the model that now has three quarters of the load.
    heaviest = result["runs"][-1]["gpus_by_model"]
    assert heaviest["model-0"] > heaviest["model-1"]
