"""One trace per request across the services (real nats-server and redis-server, the gateway,
scheduler and two workers in one process, an in-memory span exporter), and the scheduler's
``/metrics`` after serving it.

The request is streamed; once its first step has run (its first progress event), the worker that
ran it drains, so the rest of its steps run on the other worker: the gateway's server span, the
scheduler's admission and the request-step spans of both workers share one trace id.
"""

from __future__ import annotations

import asyncio
import urllib.request

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.gateway.app import create_app
from services.gateway.bus import GatewayBus
from shared.messages import codec
from shared.messages.events import RequestEvent, RequestProgress
from shared.settings import GatewaySettings
from shared.tasks import Split, TaskGenerator
from shared.telemetry import setup_tracing
from tests.integration.conftest import free_port
from tests.integration.live import H100_PROFILE, LiveCluster
from tests.unit.gateway.gateway_builders import data_chunks

pytestmark = pytest.mark.integration

_EXPORTER: InMemorySpanExporter | None = None


def span_exporter() -> InMemorySpanExporter:
    """An in-memory exporter on the process's tracer provider (installed once per process)."""
    global _EXPORTER
    if _EXPORTER is None:
        _EXPORTER = InMemorySpanExporter()
        setup_tracing("dls-test", exporter=_EXPORTER, simple=True)
    return _EXPORTER


async def _wait_ready(http: httpx.AsyncClient) -> None:
    for _ in range(100):
        ready = await http.get("/readyz")
        if ready.status_code == 200 and ready.json()["serving"]:  # a worker is up too
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the gateway never became ready")


def test_a_migrated_request_is_one_trace_across_gateway_scheduler_and_both_workers(
        nats_server, redis_server, unique_prefix):
    exporter = span_exporter()
    metrics_port = free_port()

    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix, policy="fixed",
                              scheduler_overrides={"metrics_port": metrics_port})
        await cluster.start(num_workers=2, pace_profile=H100_PROFILE)
        settings = GatewaySettings(nats_url=nats_server.url, redis_url=redis_server.url, subject_prefix=unique_prefix,
                                   redis_key_prefix=unique_prefix, request_timeout_s=60)
        bus = GatewayBus(settings)
        await bus.start()
        assert await bus.wait_connected(10)
        app = create_app(settings, bus=bus)
        transport = httpx.ASGITransport(app=app)
        problem = TaskGenerator(seed=11).problems(1, max_shots=3, split=Split.HELD_OUT)[0]
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as http:
                await _wait_ready(http)
                body = {"model": "dls-tiny", "prompt": problem.prompt, "stream": True, "cache": "none",
                        "max_tokens": 32, "block_length": 8, "stream_options": {"include_usage": True}}
                drained: list[str] = []  # the instance that ran the first step

                async def on_event(msg) -> None:  # after the first step: drain the worker holding the request
                    event = codec.decode(RequestEvent, msg.data)
                    if isinstance(event, RequestProgress) and not drained:
                        drained.append(event.instance_id)
                        cluster.workers[event.instance_id].drain()

                events = cluster.subjects.events("any").rsplit(".", 1)[0] + ".*"
                subscription = await cluster.client.subscribe(events, cb=on_event)
                reply = await http.post("/v1/completions", json=body)
                await subscription.unsubscribe()
                assert reply.status_code == 200, reply.text
                rid = reply.headers["x-request-id"]
                usage = [c for c in data_chunks(reply.text)[:-1] if c.get("usage")][-1]["usage"]
                assert usage["migrations"] >= 1 and len(usage["instances"]) == 2, usage
                scraped = await http.get("/metrics")
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as scrape:
                scheduler_metrics = scrape.read().decode()
            return rid, usage, drained[0], set(cluster.workers), scraped.text, scheduler_metrics
        finally:
            await bus.close()
            await cluster.close()

    rid, usage, drained_id, worker_ids, gateway_metrics, scheduler_metrics = asyncio.run(main())

    spans = exporter.get_finished_spans()
    (admit,) = [s for s in spans if s.name == "scheduler.admit" and s.attributes["dls.request_id"] == rid]
    trace = [s for s in spans if s.context.trace_id == admit.context.trace_id]
    scopes = {s.instrumentation_scope.name for s in trace}
    assert {"dls.gateway", "dls.scheduler", "dls.worker"} <= scopes, scopes
    (intake,) = [s for s in trace if s.name == "gateway.intake"]
    assert intake.attributes["dls.request_id"] == rid
    assert admit.parent.span_id == intake.context.span_id  # continued from the intake message's headers
    # the HTTP server span (the gateway's middleware, or FastAPI's native one) is the trace's root
    (server,) = [s for s in trace if s.kind.name == "SERVER"]
    assert server.name == "POST /v1/completions" and server.parent is None
    by_id = {s.context.span_id: s for s in trace}
    ancestor = intake
    while ancestor.parent is not None:
        ancestor = by_id[ancestor.parent.span_id]
    assert ancestor is server

    steps = sorted((s for s in trace if s.name == "worker.request_step"), key=lambda s: s.attributes["dls.step_index"])
    assert [s.attributes["dls.step_index"] for s in steps] == list(range(1, usage["steps"] + 1))
    assert all(s.parent.span_id == admit.context.span_id for s in steps)  # the record's trace_context
    instance_ids = {s.attributes["dls.instance_id"] for s in steps}
    assert instance_ids == set(usage["instances"]) and len(instance_ids) == 2 and instance_ids <= worker_ids
    assert steps[0].attributes["dls.instance_id"] == drained_id
    moved = [s for s in steps if s.attributes["dls.instance_id"] != drained_id]
    assert moved[0].attributes["dls.loaded_state"] is True  # the new instance loaded the state from Redis
    for span in steps:
        attributes = span.attributes
        assert attributes["dls.request_id"] == rid and attributes["dls.step_kind"] in ("recompute", "cache")
        assert attributes["dls.batch_size"] >= 1 and attributes["dls.tokens_committed"] >= 1
        assert 0.0 < attributes["dls.threshold"] <= 1.0 and attributes["dls.block_index"] >= 0
    assert [s.attributes["dls.threshold"] for s in steps] == usage["thresholds"]
    assert steps[-1].attributes["dls.finished"] is True
    names = {s.name for s in trace}
    assert {"scheduler.step_command", "worker.step", "scheduler.finish"} <= names, names

    for name in ("dls_scheduler_requests_finished_total 1.0", "dls_scheduler_request_latency_seconds_count 1.0",
                 f"dls_scheduler_request_steps_total {float(usage['steps'])}", "dls_scheduler_queue_depth",
                 "dls_scheduler_batch_size_bucket", "dls_scheduler_step_threshold_bucket",
                 "dls_scheduler_migrations_total", 'dls_scheduler_instances{tp="1"}',
                 "dls_scheduler_predictor_error_bucket", "dls_scheduler_requests_slo_met_total"):
        assert name in scheduler_metrics, name
    assert 'dls_gateway_http_requests_total{route="/v1/completions",status="200"} 1.0' in gateway_metrics
