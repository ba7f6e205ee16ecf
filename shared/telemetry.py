"""OpenTelemetry bootstrap and trace-context propagation over NATS headers.

``setup_tracing(service_name, settings)`` installs a ``TracerProvider`` exporting over OTLP when an
endpoint is configured: ``DLS_OTEL_ENDPOINT`` (``settings.otel_endpoint``), else the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``. The protocol comes from
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc`` or
``http/protobuf``; unset: ``grpc`` for port 4317, else ``http/protobuf``); the service name from
``OTEL_SERVICE_NAME`` (else ``service_name``), other resource attributes from
``OTEL_RESOURCE_ATTRIBUTES``, sampling from ``OTEL_TRACES_SAMPLER``, batching from ``OTEL_BSP_*``.
With no endpoint (or ``OTEL_SDK_DISABLED=true``) nothing is installed: the API's no-op tracer makes
every span a non-recording one, and the services skip their attribute work (``tracing_active()``,
``span.is_recording()``).

Context travels in NATS message headers (W3C ``traceparent``/``tracestate``, via the configured
propagators), never in message bodies: ``inject_headers`` before a publish, ``extract_context`` in
the subscriber. A request's own context (the scheduler's admission span) is also kept as a
``traceparent`` string in its Redis record (``RequestRecord.trace_context``): a batched step command
serves many requests, so the worker parents each request's step span on the record it loads anyway,
and a restarted scheduler continues the same trace (``traceparent_of``, ``context_of``).
"""

from __future__ import annotations

import logging
import os
from urllib.parse import urlparse

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, Span, SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"  # W3C trace-context header
_W3C = TraceContextTextMapPropagator()


def _endpoint(settings) -> str | None:
    return (getattr(settings, "otel_endpoint", None) or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def _protocol(endpoint: str) -> str:
    explicit = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if explicit:
        return explicit.strip().lower()
    return "grpc" if urlparse(endpoint).port == 4317 else "http/protobuf"


def _otlp_exporter(endpoint: str, from_dls_setting: bool):
    """The OTLP span exporter for ``endpoint`` (gRPC or HTTP)."""
    if _protocol(endpoint) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint) if from_dls_setting else OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if not from_dls_setting:
        return OTLPSpanExporter()  # reads the OTEL_* variables itself (and appends /v1/traces)
    url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=url)


def setup_tracing(service_name: str, settings=None, exporter=None, *, simple: bool = False):
    """Install the process's ``TracerProvider``; returns it, or None when tracing stays off.

    ``exporter``: a span exporter to use instead of OTLP (tests pass an ``InMemorySpanExporter``;
    ``simple``: export each span as it ends instead of in batches). A process has one provider: when
    an SDK provider is already installed, the exporter is added to it.
    """
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    endpoint = _endpoint(settings)
    if exporter is None and endpoint is None:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    if exporter is None:
        exporter = _otlp_exporter(endpoint, bool(getattr(settings, "otel_endpoint", None)))
    processor = SimpleSpanProcessor(exporter) if simple else BatchSpanProcessor(exporter)
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        current.add_span_processor(processor)
        return current
    # OTEL_SERVICE_NAME, when set, wins over the name the service gives itself
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    logger.info("tracing on: %s exporter%s", type(exporter).__name__, f" to {endpoint}" if endpoint else "")
    return provider


def shutdown_tracing() -> None:
    """Flush and stop the installed provider (at process exit; a no-op when tracing is off)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def tracing_active() -> bool:
    """Whether an SDK tracer provider is installed (``setup_tracing`` ran with an exporter).

    When it is not, every span is a non-recording no-op: hot paths (a span per step command or
    request-step) check this first and skip building span attributes, links and headers.
    """
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def tracer(name: str) -> trace.Tracer:
    """The tracer of one service (``dls.gateway``, ``dls.scheduler``, ...): its instrumentation scope."""
    return trace.get_tracer(name)


# --- NATS headers --------------------------------------------------------------------------------


def inject_headers(headers: dict[str, str] | None = None, context: otel_context.Context | None = None
                   ) -> dict[str, str]:
    """``headers`` plus the trace context of ``context`` (default: the current one)."""
    out = dict(headers or {})
    propagate.inject(out, context=context)
    return out


def extract_context(headers: dict[str, str] | None) -> otel_context.Context:
    """The trace context carried by a NATS message's headers (an empty context when none)."""
    return propagate.extract(dict(headers or {}))


def header_context(span: Span) -> dict[str, str]:
    """NATS headers carrying ``span``'s context; empty when tracing is off."""
    if not span.get_span_context().is_valid:
        return {}
    return inject_headers(context=trace.set_span_in_context(span))


# --- the per-request context kept in Redis ----------------------------------------------------------


def traceparent_of(span: Span) -> str:
    """``span``'s W3C ``traceparent`` (for ``RequestRecord.trace_context``); "" when tracing is off."""
    if not span.get_span_context().is_valid:
        return ""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


def context_of(traceparent: str) -> otel_context.Context | None:
    """The context a stored ``traceparent`` names (the parent of spans about that request); None if ""."""
    if not traceparent:
        return None
    return _W3C.extract({TRACEPARENT: traceparent})


def link_to(traceparent: str) -> Link | None:
    """A span link to a stored ``traceparent`` (a batched span pointing at each request's trace)."""
    ctx = context_of(traceparent)
    span_context: SpanContext | None = trace.get_current_span(ctx).get_span_context() if ctx else None
    return Link(span_context) if span_context is not None and span_context.is_valid else None
