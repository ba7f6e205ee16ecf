"""Per-model series in their home, ``shared.metrics``: the reconfigurator's planned GPUs per model, the
gateway's cold-start histogram, the predictor's per-model series (names as they were)."""

from __future__ import annotations

from shared.metrics import GatewayMetrics, PredictorMetrics, ReconfiguratorMetrics, render


def test_planned_gpus_follow_the_published_division_and_a_model_left_out_reads_zero():
    metrics = ReconfiguratorMetrics()
    value = metrics.registry.get_sample_value
    metrics.set_division({"alpha": 6, "beta": 2})
    assert (value("dls_reconfigurator_planned_gpus", {"model": "alpha"}),
            value("dls_reconfigurator_planned_gpus", {"model": "beta"})) == (6, 2)
    metrics.set_division({"alpha": 8})
    assert (value("dls_reconfigurator_planned_gpus", {"model": "alpha"}),
            value("dls_reconfigurator_planned_gpus", {"model": "beta"})) == (8, 0)


def test_the_gateways_cold_start_histogram_keeps_its_name_and_labels():
    metrics = GatewayMetrics()
    metrics.cold_start_seconds.labels("beta", "served").observe(42.0)
    text = render(metrics.registry).decode()
    assert 'dls_gateway_cold_start_seconds_count{model_name="beta",outcome="served"} 1.0' in text
    assert 'dls_gateway_cold_start_seconds_bucket{le="60.0",model_name="beta",outcome="served"} 1.0' in text


def test_the_predictors_per_model_series_are_on_its_registry_under_their_names():
    metrics = PredictorMetrics()
    metrics.by_model.queries.labels(model="beta").inc(3)
    metrics.by_model.serving("beta", one_shot=False, version="v7")
    metrics.served_requests.labels(outcome="not_served").inc()
    value = metrics.registry.get_sample_value
    assert value("dls_predictor_model_queries_total", {"model": "beta"}) == 3
    assert value("dls_predictor_model_info", {"model": "beta", "kind": "online", "version": "v7"}) == 1
    assert "not_served: of a model this predictor does not serve" in render(metrics.registry).decode()
