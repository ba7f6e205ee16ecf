"""Tracing and metrics helpers: trace context through NATS headers and the Redis record, the
bootstrap staying off without an endpoint, the Prometheus registries, the predictor-error metric,
and the gateway's ``/metrics`` after a request."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared import telemetry
from shared.metrics import (
    LOOP_STALL_S,
    GatewayMetrics,
    NodeAgentMetrics,
    PredictorMetrics,
    ReconfiguratorMetrics,
    SchedulerMetrics,
    WorkerMetrics,
    predictor_error,
    render,
    serve_metrics,
)
from shared.runtime import free_port
from shared.settings import SchedulerSettings
from tests.unit.gateway.gateway_builders import MODEL, client


@pytest.fixture
def sdk_tracer():
    """A tracer of a private SDK provider (the process-wide one is left alone) and its exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_trace_context_round_trips_through_nats_headers(sdk_tracer):
    tracer, _ = sdk_tracer
    with tracer.start_as_current_span("parent") as parent:
        headers = telemetry.inject_headers({"Nats-Msg-Id": "r1"})
    assert headers["Nats-Msg-Id"] == "r1" and headers["traceparent"].startswith("00-")
    child = tracer.start_span("child", context=telemetry.extract_context(headers))
    assert child.get_span_context().trace_id == parent.get_span_context().trace_id
    assert child.parent.span_id == parent.get_span_context().span_id
    assert telemetry.header_context(parent)["traceparent"] == headers["traceparent"]


def test_a_stored_traceparent_parents_and_links_later_spans(sdk_tracer):
    tracer, _ = sdk_tracer
    admission = tracer.start_span("admit")
    stored = telemetry.traceparent_of(admission)
    step = tracer.start_span("step", context=telemetry.context_of(stored),
                             links=[telemetry.link_to(stored)])
    assert step.get_span_context().trace_id == admission.get_span_context().trace_id
    assert step.parent.span_id == admission.get_span_context().span_id
    assert step.links[0].context.span_id == admission.get_span_context().span_id


def test_without_tracing_nothing_is_stored_or_sent():
    span = trace.NonRecordingSpan(trace.INVALID_SPAN_CONTEXT)
    assert telemetry.traceparent_of(span) == "" and telemetry.header_context(span) == {}
    assert telemetry.context_of("") is None and telemetry.link_to("") is None
    assert telemetry.extract_context(None) is not None  # an empty context: spans become roots


def test_setup_tracing_stays_off_without_an_endpoint(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "DLS_OTEL_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert telemetry.setup_tracing("dls-test", SchedulerSettings()) is None
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert telemetry.setup_tracing("dls-test", SchedulerSettings(otel_endpoint="http://collector:4317")) is None


def test_otlp_protocol_follows_the_environment(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    assert telemetry._protocol("http://jaeger:4317") == "grpc"
    assert telemetry._protocol("http://collector:4318") == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert telemetry._protocol("http://jaeger:4317") == "http/protobuf"


SCHEDULER_NAMES = (
    "dls_scheduler_requests_finished_total", "dls_scheduler_requests_slo_met_total",
    "dls_scheduler_requests_rejected_total", "dls_scheduler_request_latency_seconds_bucket",
    "dls_scheduler_request_steps_total", "dls_scheduler_queue_depth", "dls_scheduler_requests_in_flight",
    "dls_scheduler_batch_size_bucket", "dls_scheduler_step_threshold_bucket", "dls_scheduler_migrations_total",
    'dls_scheduler_instances{tp="2"}', "dls_scheduler_predictor_error_bucket",
    'dls_malformed_messages_total{subject="results"}',
)


def test_the_registries_render_every_metric_name():
    scheduler = SchedulerMetrics()
    scheduler.set_instances({1: 2, 2: 1})
    scheduler.malformed.labels(subject="results").inc()
    text = render(scheduler.registry).decode()
    for name in SCHEDULER_NAMES:
        assert name in text, name
    scheduler.set_instances({1: 3})  # the TP-2 instance left: its gauge reads 0, not its last value
    assert 'dls_scheduler_instances{tp="2"} 0.0' in render(scheduler.registry).decode()

    worker = WorkerMetrics("w-1")
    worker.steps.inc()
    text = render(worker.registry).decode()
    for name in ("dls_worker_steps_total", "dls_worker_batch_size_bucket", "dls_worker_step_seconds_bucket",
                 "dls_worker_tokens_committed_total", "dls_worker_state_loads_total",
                 "dls_worker_resident_requests"):
        assert f'{name}{{instance="w-1"' in text, name
    for metrics, name in ((GatewayMetrics(), "dls_gateway_http_request_seconds"),
                          (PredictorMetrics(), "dls_predictor_queries_total"),
                          (ReconfiguratorMetrics(), "dls_reconfigurator_plans_total"),
                          (NodeAgentMetrics(), "dls_node_agent_restarts_total")):
        assert name in render(metrics.registry).decode()


def test_metrics_are_served_over_http_and_off_on_port_zero():
    assert serve_metrics(SchedulerMetrics().registry, 0) is None
    metrics = SchedulerMetrics()
    metrics.finished.inc()
    server = serve_metrics(metrics.registry, port=free_port())
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5) as reply:
            assert "dls_scheduler_requests_finished_total 1.0" in reply.read().decode()
        assert serve_metrics(metrics.registry, port=server.server_port) is None  # taken: logged, not fatal
    finally:
        server.shutdown()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_metrics_port_answers_liveness_and_readiness_probes():
    """/health follows the event loop the server was started from; /ready also the service's check."""
    ready = {"now": False}

    async def main():
        server = serve_metrics(SchedulerMetrics().registry, port=free_port(), ready=lambda: ready["now"])
        base = f"http://127.0.0.1:{server.server_port}"
        try:
            seen = [await asyncio.to_thread(_get, f"{base}/health"), await asyncio.to_thread(_get, f"{base}/ready")]
            ready["now"] = True
            seen.append(await asyncio.to_thread(_get, f"{base}/ready"))
            server.loop_watch.last_tick -= LOOP_STALL_S + 1  # as if the loop had been stuck that long
            server.loop_watch.task.cancel()
            seen += [await asyncio.to_thread(_get, f"{base}/health"), await asyncio.to_thread(_get, f"{base}/ready")]
            return seen
        finally:
            server.shutdown()

    (health, not_ready, now_ready, stuck, stuck_ready) = asyncio.run(main())
    assert health == (200, "ok\n") and not_ready[0] == 503 and now_ready[0] == 200
    assert stuck[0] == 503 and stuck_ready[0] == 503


def test_the_node_agents_metrics_carry_its_workers():
    """One scrape of the agent's port gives every worker's series (by their ``instance`` label)."""
    from prometheus_client.parser import text_string_to_metric_families

    from services.node_agent.agent import WorkerMetricsCollector

    workers = [WorkerMetrics(f"w-{i}") for i in range(2)]
    for i, worker in enumerate(workers):
        worker.steps.inc(i + 1)
    servers = [serve_metrics(w.registry, port=free_port()) for w in workers]
    agent = NodeAgentMetrics()
    own = frozenset(family.name for family in agent.registry.collect())
    urls = [f"http://127.0.0.1:{s.server_port}/metrics" for s in servers] + [f"http://127.0.0.1:{free_port()}/metrics"]
    agent.registry.register(WorkerMetricsCollector(lambda: urls, skip=own))
    try:
        families = {f.name: f for f in text_string_to_metric_families(render(agent.registry).decode())}
    finally:
        for server in servers:
            server.shutdown()
    steps = {s.labels["instance"]: s.value for s in families["dls_worker_steps"].samples if s.name.endswith("_total")}
    assert steps == {"w-0": 1.0, "w-1": 2.0}
    assert "dls_node_agent_restarts" in families and "dls_worker_step_seconds" in families
    assert len([s for s in families["dls_malformed_messages"].samples]) == 0  # the agent's own, not doubled


def test_predictor_error_compares_the_prediction_at_the_threshold_used():
    remaining = {0.7: 6, 0.9: 10}
    assert predictor_error(2, remaining, 0.88, 10) == pytest.approx(2 / 8)  # 0.9's 10 vs 8 actual
    assert predictor_error(2, remaining, 0.7, 8) == pytest.approx(0.0)
    assert predictor_error(4, remaining, 0.9, 4) is None  # no step after the prediction
    assert predictor_error(0, {}, 0.9, 4) is None and predictor_error(0, remaining, None, 4) is None


def test_the_gateway_serves_metrics_after_a_request():
    test_client, _ = client()
    assert test_client.post("/v1/completions", json={"model": MODEL, "prompt": "1+1="}).status_code == 200
    reply = test_client.get("/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    assert 'dls_gateway_http_requests_total{route="/v1/completions",status="200"} 1.0' in reply.text
    assert 'dls_gateway_http_request_seconds_count{route="/v1/completions"} 1.0' in reply.text
