"""The gateway's traces and metrics: a server span per HTTP request, and ``/metrics``.

``install_observability(app)`` adds an ASGI middleware (outermost, so refusals are counted too)
that opens a SERVER span per HTTP request, a child of the caller's ``traceparent`` when it sends
one (FastAPI versions with native telemetry open that span themselves; the middleware then leaves it
to them). The completion handler adds a ``gateway.intake`` span and sends its context in the intake
message's NATS headers (``intake_headers``), so the scheduler's admission span continues the trace.
It counts requests and their time per route template (``GatewayMetrics``) and serves them on
``GET /metrics`` (Prometheus text); ``DLS_METRICS_PORT`` serves the same registry on a port of its own
(``__main__``), which is what the compose stack and Kubernetes scrape.
"""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import Response
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shared.messages.intake import CompletionRequest
from shared.metrics import CONTENT_TYPE_LATEST, GatewayMetrics, render
from shared.telemetry import extract_context, inject_headers, tracer

UNTRACED_PATHS = frozenset({"/metrics", "/health", "/healthz", "/readyz"})  # probes and scrapes: counted, no spans
OTHER_ROUTE = "other"  # route label of paths no route matched (keeps the label set small)


class TelemetryMiddleware:
    """Pure ASGI (no body buffering, so SSE streams pass through untouched)."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics
        self._tracer = tracer("dls.gateway")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # unless the app answers

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        t0 = time.perf_counter()
        try:
            if scope["path"] in UNTRACED_PATHS:
                await self.app(scope, receive, send_and_note)
                return
            await self._traced(scope, receive, send_and_note, lambda: status)
        finally:
            route = _route(scope)
            self.metrics.requests.labels(route=route, status=str(status)).inc()
            self.metrics.seconds.labels(route=route).observe(time.perf_counter() - t0)

    async def _traced(self, scope, receive, send, status) -> None:
        current = trace.get_current_span()
        if current.is_recording():  # FastAPI's own server span (its native telemetry) is this request's
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        method = scope.get("method", "GET")
        with self._tracer.start_as_current_span(
                f"{method} {scope['path']}", context=extract_context(headers), kind=SpanKind.SERVER,
                attributes={"http.request.method": method, "url.path": scope["path"]}) as span:
            await self.app(scope, receive, send)
            if span.is_recording():
                span.update_name(f"{method} {_route(scope)}")
                span.set_attribute("http.route", _route(scope))
                span.set_attribute("http.response.status_code", status())
                if status() >= 500:
                    span.set_status(Status(StatusCode.ERROR))


def intake_headers(request: CompletionRequest) -> dict[str, str]:
    """NATS headers for the intake message: the context of a ``gateway.intake`` span (a child of the HTTP
    request's span, naming the request id, so a trace can be found by it); the caller's own
    ``traceparent`` passes through unchanged when tracing is off."""
    span = tracer("dls.gateway").start_span("gateway.intake", kind=SpanKind.PRODUCER, attributes={
        "dls.request_id": request.request_id, "dls.prompt_tokens": len(request.prompt_token_ids or []),
        "dls.gen_length": request.gen_length, "dls.slo_ms": request.slo_ms, "dls.stream": request.stream})
    try:
        return inject_headers(context=trace.set_span_in_context(span))
    finally:
        span.end()


def _route(scope) -> str:
    """The matched route's template (``/v1/requests/{request_id}``), else ``other``."""
    route = scope.get("route")
    return getattr(route, "path", None) or OTHER_ROUTE


def install_observability(app: FastAPI, metrics: GatewayMetrics | None = None) -> GatewayMetrics:
    """Add the tracing/metrics middleware and ``GET /metrics``; call after the other middleware."""
    metrics = metrics or GatewayMetrics()
    app.state.metrics = metrics

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition of the gateway's metrics."""
        return Response(render(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(TelemetryMiddleware, metrics=metrics)
    return metrics
