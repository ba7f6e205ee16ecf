"""docs/results.md's load-control and loss-breakdown sections, from compare-shaped JSON."""

from sim import results_doc


def point(label: str, slo: float, accuracy: float = 0.99, queueing_s: float = 1.0) -> dict:
    return {"label": label, "slo_attainment": slo, "accuracy": accuracy, "mean_latency_s": 2.0,
            "breakdown": {"queueing_s": queueing_s, "reconfiguration_s": 0.25, "migration_s": 0.001,
                          "reconfiguration_instance_s": 40.0, "mean_threshold": 0.8}}


def test_load_control_experiment_reports_what_algorithm_2_adds_per_regime():
    slo = {"dilaserve": (0.50, 0.30), "dilaserve-no-loadctl": (0.49, 0.30),
           "dilaserve-all-thresholds": (0.90, 0.80), "dilaserve-all-thresholds-no-loadctl": (0.90, 0.80),
           "dilaserve-plan-once": (0.48, 0.28), "dilaserve-plan-once-no-loadctl": (0.45, 0.27),
           "dilaserve-plan-once-all-thresholds": (0.92, 0.85),
           "dilaserve-plan-once-all-thresholds-no-loadctl": (0.86, 0.80)}
    data = {"policies": {label: {"points": [point("2.0x", a), point("3.0x", b)]} for label, (a, b) in slo.items()}}
    text = results_doc.load_control_experiment(data, None)
    assert "| every step | within the budget | 49.0 -> 50.0% (+1.0), acc. 99.0% | 30.0 -> 30.0% (+0.0)" in text
    assert "at most +6.0 points (short answers, Algorithm 1 once" in text and "all five thresholds, 2.0x" in text
    assert "re-plans every step it adds +0.0 to +1.0 points; where it plans once, +1.0 to +6.0" in text
    assert results_doc.load_control_experiment(None, None) == ""


def test_loss_breakdown_has_a_row_per_point_with_every_policy():
    runs = {"paper-bench-quick": {"policies": {
        name: {"points": [point("1.0x", 0.9, queueing_s=q), point("2.0x", 0.5, queueing_s=2 * q)]}
        for name, q in (("dilaserve", 0.5), ("infaas", 1.0), ("llumnix", 1.5))}}}
    text = results_doc.loss_breakdown(runs)
    rows = [line for line in text.splitlines() if line.startswith("| paper-bench |")]
    assert rows[1] == "| paper-bench | 2.0x | 50.0 / 50.0 / 50.0 | 1.00 / 2.00 / 3.00 | 0.25 / 0.25 / 0.25 | " \
                      "0.001 / 0.001 / 0.001 | 40 / 40 / 40 | 0.800 / 0.800 / 0.800 |"
    assert len(rows) == 2


def compare_json(profile: dict, slo: dict[str, tuple[float, float]]) -> dict:
    return {"setup": {"slo_s": 3.0, "nominal_capacity_rps": 50.0, "profile": profile},
            "policies": {label: {"points": [{**point("1.0x", a), "rps": 50.0, "mean_threshold": 0.85},
                                            {**point("2.0x", b), "rps": 100.0, "mean_threshold": 0.8}]}
                         for label, (a, b) in slo.items()}}


def test_measured_headlines_put_each_profile_beside_the_other_and_judge_the_top_point():
    modelled = {"path": "profiles/llada-8b-h100.json", "measured": False, "derived_tp": [], "smoothed": []}
    measured = {"path": results_doc.MEASURED_PROFILE, "measured": True, "derived_tp": [2, 4, 8], "smoothed": ["x"]}
    runs = {"paper-bench-quick": compare_json(modelled, {"dilaserve": (1.0, 0.9), "infaas": (0.8, 0.4),
                                                         "llumnix": (0.8, 0.5)}),
            "paper-bench-quick-h200": compare_json(measured, {"dilaserve": (1.0, 0.5), "infaas": (0.9, 0.5),
                                                              "llumnix": (0.9, 0.45)})}
    text = results_doc.measured_headlines(runs.get)
    rows = [line for line in text.splitlines() if line.startswith("| paper-bench (quick) |")]
    assert len(rows) == 4
    assert rows[1].startswith("| paper-bench (quick) | `profiles/llada-8b-h100.json` (modelled) | 3.00 | 50.0 | 2.0x |")
    assert "`profiles/llada-8b-h200-measured.json` (measured, TP-2/4/8 derived)" in rows[3]
    assert "| 50.0 / 50.0 / 45.0 |" in rows[3] and "| +0.0 / +5.0 |" in rows[3]
    assert ("- paper-bench (quick) at 2.0x: modelled ahead (+50.0 / +40.0 pp); measured NOT ahead "
            "(+0.0 / +5.0 pp).") in text
    assert results_doc.measured_headlines({"paper-bench-quick": runs["paper-bench-quick"]}.get) == ""


def test_multi_model_section_has_each_models_figures_and_the_leads():
    def run(slo: float, a: float, b: float, moves: int) -> dict:
        def fig(x: float) -> dict:
            return {"slo_attainment": x, "accuracy": 0.99,
                    "after_flips": {"steady": x, "flips": [{"of_steady": 0.9}, {"of_steady": None}]}}
        return {"slo_attainment": slo, "by_model": {"a": fig(a), "b": fig(b)}, "reconfigurations": [{}] * moves}

    data = {"setup": {"num_gpus": 32, "phase_s": [240.0] * 3, "reconfig_period_s": 10.0, "nominal_capacity_rps": 30.0,
                      "models": {"a": {"slo_s": 4.0, "switch_s": 45.0, "shares": [0.8, 0.2]},
                                 "b": {"slo_s": 9.0, "switch_s": 40.0, "shares": [0.2, 0.8]}}},
            "points": [{"rate_mult": 1.2, "rps": 36.0, "best_static_split": {"a": 16, "b": 16},
                        "static_splits": [{"split": {"a": 16, "b": 16}, "slo_attainment": 0.9}],
                        "policies": {"static": run(0.9, 0.88, 0.92, 0), "dilaserve": run(0.95, 0.94, 0.96, 5)}}],
            "headline": {"lead_over_static_pp": 5.0},
            "gpu_hours": {"peak_gpus_by_model": {"a": {"gpus": 20}, "b": {"gpus": 20}}, "each_model_its_peak": 2.67,
                          "dilaserve": 2.13, "saving": 0.2}}
    text = results_doc.multi_model(data, None)
    assert "splits tried: 16:16 90.0%" in text
    assert "| dilaserve | 95.0 | 94.0 | 99.0 | 0.90, - | 96.0 | 99.0 | 0.90, - | 5 |" in text
    assert "+5.0 points over static" in text and "saving 20%" in text
    assert results_doc.multi_model(None, None) == ""


def test_every_preset_judges_each_point_against_the_better_baseline():
    runs = {
        "paper-bench-quick": compare_json({}, {"dilaserve": (1.0, 0.9), "infaas": (0.8, 0.4), "llumnix": (0.8, 0.5)}),
        "ablation-cache-quick": compare_json({}, {"dilaserve": (0.9, 0.53), "infaas": (0.5, 0.5),
                                                  "llumnix": (0.95, 0.3)}),
        "mixed-slo-quick": compare_json({}, {"dilaserve": (1.0, 0.9), "infaas": (0.8, 0.4), "llumnix": (0.8, 0.5)}),
        "ablation-migration-quick": compare_json({}, {"dilaserve": (1.0, 0.9)}),  # no baselines: not judged
    }
    for p in runs["mixed-slo-quick"]["policies"]["dilaserve"]["points"]:
        p["accuracy"] = 0.975  # 1.5 points under the baselines' 0.99
    rows = [line for line in results_doc.every_preset(runs.get).splitlines() if line.startswith("| ")][1:]
    assert rows[:2] == ["| paper-bench | 1.0x | 100.0 (99.0) | 80.0 (99.0) | 80.0 (99.0) | +20.0 | yes |",
                        "|  | 2.0x | 90.0 (99.0) | 40.0 (99.0) | 50.0 (99.0) | +40.0 | yes |"]
    assert rows[2].endswith("| -5.0 | no: behind |") and rows[3].endswith("| +3.0 | no: lead under 5 |")
    assert rows[4].endswith("| no: accuracy |") and len(rows) == 6
    assert "Not run (or without both baselines): paper-bench-long-quick" in results_doc.every_preset(runs.get)
