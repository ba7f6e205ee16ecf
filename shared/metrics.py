"""Prometheus metrics of the services (prometheus-client), one registry per service object.

Each service builds its metrics object with its own ``CollectorRegistry`` (so a test that runs a
scheduler and two workers in one process sees each one's numbers), updates it from its loop, and
exposes it with ``serve_metrics(registry, port, host)`` on ``DLS_METRICS_PORT`` (0: off); the
gateway also serves ``/metrics`` on its HTTP app (``render``). The same port answers the probes of a
service that has no HTTP API of its own: ``/health`` (liveness: 200 while its event loop turns; a loop
stuck for ``LOOP_STALL_S`` answers 503) and ``/ready`` (readiness: alive, and every NATS connection it
made with ``shared.runtime.connect_nats`` connected, or what the service's own ``ready`` says).
Names (``docs/architecture.md``, "Observability"):

- scheduler: ``dls_scheduler_requests_finished_total``, ``dls_scheduler_requests_slo_met_total``
  (SLO attainment = their ratio), ``dls_scheduler_requests_rejected_total``,
  ``dls_scheduler_request_latency_seconds`` (end to end, arrival to finish),
  ``dls_scheduler_request_steps_total`` (request-steps; ``rate()`` = steps per second),
  ``dls_scheduler_queue_depth``, ``dls_scheduler_requests_in_flight``, ``dls_scheduler_batch_size``,
  ``dls_scheduler_step_threshold``, ``dls_scheduler_migrations_total``,
  ``dls_scheduler_instances{tp}`` (instances per TP degree), ``dls_scheduler_predictor_error``
  (``|predicted - actual| / actual`` remaining steps, at finish), ``dls_malformed_messages_total``;
- worker (label ``instance``): ``dls_worker_steps_total`` (batched forwards), ``dls_worker_batch_size``,
  ``dls_worker_step_seconds``, ``dls_worker_tokens_committed_total``, ``dls_worker_state_loads_total``,
  ``dls_worker_resident_requests``, ``dls_worker_kv_used_bytes``, ``dls_worker_kv_refused_total``,
  ``dls_malformed_messages_total``;
- serving (vLLM's set, label ``model_name``; ``docs/architecture.md`` maps each to its vLLM name):
  scheduler ``dls_time_to_first_token_seconds``, ``dls_inter_token_latency_seconds``,
  ``dls_request_time_per_output_token_seconds``, ``dls_e2e_request_latency_seconds``,
  ``dls_prompt_tokens_total``, ``dls_generation_tokens_total``, ``dls_num_requests_running``,
  ``dls_num_requests_waiting``; worker ``dls_tokens_per_forward``; gateway (what HTTP clients see)
  ``dls_gateway_time_to_first_token_seconds``, ``dls_gateway_inter_token_latency_seconds``,
  ``dls_gateway_e2e_request_latency_seconds``;
- gateway: ``dls_gateway_http_requests_total{route,status}``, ``dls_gateway_http_request_seconds{route}``,
  ``dls_gateway_cold_start_seconds{model_name,outcome}``;
- predictor: ``dls_predictor_queries_total``, ``dls_predictor_batch_size``, ``dls_predictor_live_error``,
  ``dls_predictor_served_error``, ``dls_predictor_served_requests_total{outcome}``,
  ``dls_predictor_retrains_total{outcome}``, ``dls_predictor_retrain_error{model}``,
  ``dls_predictor_retrain_rows{split}``, ``dls_predictor_retrain_seconds``,
  ``dls_predictor_retrain_window_rows``, and per served model (label ``model``) ``dls_predictor_model_info{kind}``,
  ``dls_predictor_model_queries_total``, ``dls_predictor_model_live_error``,
  ``dls_predictor_model_retrain_window_rows``, ``dls_predictor_model_retrains_total{outcome}``; reconfigurator:
  ``dls_reconfigurator_plans_total``, ``dls_reconfigurator_planned_gpus{model}``; node agent:
  ``dls_node_agent_workers``, ``dls_node_agent_model_workers{model}``, ``dls_node_agent_restarts_total``,
  ``dls_node_agent_hung_workers_total``, ``dls_node_agent_switch_seconds{model}``; all:
  ``dls_malformed_messages_total{subject}``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.exposition import MetricsHandler

logger = logging.getLogger(__name__)

__all__ = ["CONTENT_TYPE_LATEST", "render", "serve_metrics"]

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
STEP_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
THRESHOLD_BUCKETS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)
ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5)
# vLLM's buckets for TTFT, inter-token latency / TPOT and end-to-end latency (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
TOKENS_PER_FORWARD_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
# a scaled-to-zero model's wait for its first instance, and a slot's switch of model (an 8B model loads in 30-100 s)
COLD_START_BUCKETS_S = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0)
MODEL_LABEL = "model_name"  # vLLM's label for the served model on every serving metric
LOOP_STALL_S = 60.0  # /health fails once the service's event loop has not turned for this long


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of ``registry`` (content type ``CONTENT_TYPE_LATEST``)."""
    return generate_latest(registry)


class LoopWatch:
    """Liveness of an event loop: a task on it stamps the time every second; ``alive`` while the stamp
    is younger than ``stall_s`` (a loop blocked by a call that never returns stops stamping)."""

    def __init__(self, stall_s: float = LOOP_STALL_S) -> None:
        self.stall_s = stall_s
        self.last_tick = time.monotonic()
        self.task: asyncio.Task | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> LoopWatch:
        self.task = loop.create_task(self._tick(), name="loop-watch")
        return self

    async def _tick(self) -> None:
        while True:
            self.last_tick = time.monotonic()
            await asyncio.sleep(1.0)

    def alive(self) -> bool:
        return time.monotonic() - self.last_tick < self.stall_s


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1",
                  ready: Callable[[], bool] | None = None):
    """Serve ``registry`` on ``http://host:port/metrics``, and ``/health`` and ``/ready``, in a daemon
    thread; None when ``port`` is 0.

    ``/health`` watches the event loop running when this is called (none: always alive); ``/ready`` is
    alive and ``ready()`` (default: the NATS connections of ``shared.runtime.connect_nats`` are up).
    Returns the HTTP server (``server.server_port`` is the bound port; ``shutdown()`` stops it). A port
    that cannot be bound is logged and leaves metrics off: it must not stop the service from serving.
    """
    if not port:
        return None
    from shared.runtime import nats_connected

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    watch = LoopWatch().start(loop) if loop is not None else None
    alive = watch.alive if watch is not None else (lambda: True)
    is_ready = ready or nats_connected
    probes = {"/health": alive, "/ready": lambda: alive() and is_ready()}  # path -> check

    class Handler(MetricsHandler.factory(registry)):
        def do_GET(self) -> None:
            check = probes.get(self.path.split("?", 1)[0])
            if check is None:
                return super().do_GET()
            ok = check()
            body = b"ok\n" if ok else b"unavailable\n"
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
            pass  # scrapes and probes every few seconds: not worth a log line each

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        logger.error("cannot serve metrics on %s:%d (%s); metrics are off", host, port, exc)
        return None
    server.daemon_threads = True
    server.loop_watch = watch  # keeps the watch task referenced
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    logger.info("metrics on http://%s:%d/metrics (probes /health, /ready)", host, server.server_port)
    return server


def predictor_error(made_at_step: int, threshold_to_remaining: dict[float, int], mean_threshold: float | None,
                    num_steps: int) -> float | None:
    """``|predicted - actual| / actual`` remaining steps of a finished request.

    The prediction was made at step ``made_at_step`` (threshold -> predicted remaining steps); the
    request finished after ``num_steps`` steps at thresholds averaging ``mean_threshold``, so the
    prediction compared is the one at the candidate threshold nearest that mean. None when there is
    nothing to compare (no steps after the prediction, no candidates, no threshold).
    """
    actual = num_steps - made_at_step
    if actual <= 0 or not threshold_to_remaining or mean_threshold is None:
        return None
    nearest = min(threshold_to_remaining, key=lambda t: (abs(t - mean_threshold), t))
    return abs(threshold_to_remaining[nearest] - actual) / actual


def _malformed(registry: CollectorRegistry) -> Counter:
    return Counter("dls_malformed_messages", "messages dropped because they did not decode", ["subject"],
                   registry=registry)


class SchedulerMetrics:
    """The step loop's numbers."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.finished = Counter("dls_scheduler_requests_finished", "requests that finished", registry=r)
        self.slo_met = Counter("dls_scheduler_requests_slo_met", "finished requests that met their SLO", registry=r)
        self.rejected = Counter("dls_scheduler_requests_rejected", "requests rejected at admission", registry=r)
        self.latency = Histogram("dls_scheduler_request_latency_seconds", "end-to-end latency, arrival to finish",
                                 buckets=LATENCY_BUCKETS_S, registry=r)
        self.steps = Counter("dls_scheduler_request_steps", "request-steps reported by workers", registry=r)
        self.queue_depth = Gauge("dls_scheduler_queue_depth", "requests waiting in the admission queue", registry=r)
        self.in_flight = Gauge("dls_scheduler_requests_in_flight", "requests admitted and not finished", registry=r)
        self.batch_size = Histogram("dls_scheduler_batch_size", "requests per step command",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.threshold = Histogram("dls_scheduler_step_threshold", "threshold each request-step ran at",
                                   buckets=THRESHOLD_BUCKETS, registry=r)
        self.migrations = Counter("dls_scheduler_migrations", "steps placed on another instance than the last",
                                  registry=r)
        self.preemptions = Counter("dls_scheduler_preemptions", "requests that yielded their KV memory (back to the "
                                   "queue, resumed from their stored state)", registry=r)
        self.instances = Gauge("dls_scheduler_instances", "live instances per TP degree", ["tp"], registry=r)
        self.predictor_error = Histogram(
            "dls_scheduler_predictor_error", "|predicted - actual| / actual remaining steps, measured at finish",
            buckets=ERROR_BUCKETS, registry=r)
        self.malformed = _malformed(r)
        serving = ServingMetrics(r)
        self.ttft, self.itl, self.tpot, self.e2e = serving.ttft, serving.itl, serving.tpot, serving.e2e
        self.prompt_tokens = Counter("dls_prompt_tokens", "prompt tokens of admitted requests", [MODEL_LABEL],
                                     registry=r)
        self.generation_tokens = Counter("dls_generation_tokens", "answer tokens of finished requests",
                                         [MODEL_LABEL], registry=r)
        self.running = Gauge("dls_num_requests_running", "admitted requests placed on an instance",
                             [MODEL_LABEL], registry=r)
        self.waiting = Gauge("dls_num_requests_waiting", "admitted requests waiting for an instance",
                             [MODEL_LABEL], registry=r)
        self.shadow_steps = Counter("dls_scheduler_shadow_steps", "request-steps of shadow decodings (in "
                                    "dls_scheduler_request_steps too)", registry=r)
        self.shadow_agreement = Gauge("dls_scheduler_shadow_agreement", "share of shadow decodings whose answer "
                                      "equals the served one, by the lowest threshold it was served at",
                                      ["threshold"], registry=r)
        self.shadow_decodings = Counter("dls_scheduler_shadow_decodings", "shadow decodings judged, by the lowest "
                                        "threshold the request was served at", ["threshold"], registry=r)
        self.quality_floor = Gauge("dls_scheduler_quality_floor", "lowest candidate threshold shadow decoding "
                                   "still allows (0: any)", registry=r)

    def set_instances(self, tp_to_count: dict[int, int]) -> None:
        """Live instances per TP degree (degrees seen before and now gone read 0)."""
        for tp in {int(s.labels["tp"]) for m in self.instances.collect() for s in m.samples} - set(tp_to_count):
            self.instances.labels(tp=str(tp)).set(0)
        for tp, count in tp_to_count.items():
            self.instances.labels(tp=str(tp)).set(count)


class ServingMetrics:
    """TTFT, inter-token latency, time per output token and end-to-end latency (label ``model_name``),
    as vLLM names them, under a prefix (``dls`` for the scheduler's view, ``dls_gateway`` for what HTTP
    clients see)."""

    def __init__(self, registry: CollectorRegistry, prefix: str = "dls", what: str = "") -> None:
        self.ttft = Histogram(f"{prefix}_time_to_first_token_seconds", f"arrival to the first committed block of "
                              f"the answer{what}", [MODEL_LABEL], buckets=TTFT_BUCKETS_S, registry=registry)
        self.itl = Histogram(f"{prefix}_inter_token_latency_seconds", f"gap between two committed blocks of an "
                             f"answer (a stream's chunks){what}", [MODEL_LABEL], buckets=ITL_BUCKETS_S,
                             registry=registry)
        self.tpot = Histogram(f"{prefix}_request_time_per_output_token_seconds", f"(end to end - TTFT) / (answer "
                              f"tokens - 1) per request{what}", [MODEL_LABEL], buckets=ITL_BUCKETS_S,
                              registry=registry)
        self.e2e = Histogram(f"{prefix}_e2e_request_latency_seconds", f"arrival to the answer{what}", [MODEL_LABEL],
                             buckets=E2E_BUCKETS_S, registry=registry)


class WorkerMetrics:
    """One instance's numbers (label ``instance``: its id)."""

    def __init__(self, instance_id: str, registry: CollectorRegistry | None = None, model_name: str = "") -> None:
        self.registry = r = registry or CollectorRegistry()
        self.tokens_per_forward = Histogram(
            "dls_tokens_per_forward", "canvas positions a request committed in one forward (a decoder commits 1)",
            [MODEL_LABEL, "instance"], buckets=TOKENS_PER_FORWARD_BUCKETS, registry=r).labels(model_name, instance_id)
        labels = ["instance"]
        self.steps = Counter("dls_worker_steps", "batched forwards run", labels, registry=r).labels(instance_id)
        self.batch_size = Histogram("dls_worker_batch_size", "requests per forward", labels,
                                    buckets=BATCH_BUCKETS, registry=r).labels(instance_id)
        self.step_seconds = Histogram("dls_worker_step_seconds", "step time (state load and save included)", labels,
                                      buckets=STEP_BUCKETS_S, registry=r).labels(instance_id)
        self.tokens = Counter("dls_worker_tokens_committed", "canvas positions committed", labels,
                              registry=r).labels(instance_id)
        self.blocks_skipped = Counter("dls_worker_blocks_skipped", "blocks left undecoded by early stop at EOS "
                                      "(each saves one forward at least)", labels, registry=r).labels(instance_id)
        self.loads = Counter("dls_worker_state_loads", "request states loaded from Redis (migrations, restarts)",
                             labels, registry=r).labels(instance_id)
        self.resident = Gauge("dls_worker_resident_requests", "requests whose local copy it holds", labels,
                              registry=r).labels(instance_id)
        self.kv_used = Gauge("dls_worker_kv_used_bytes", "KV cache bytes in pages its requests hold (per GPU)", labels,
                             registry=r).labels(instance_id)
        self.kv_refused = Counter("dls_worker_kv_refused", "request-steps refused because their KV cache would not "
                                  "fit the budget (back to the scheduler's queue)", labels,
                                  registry=r).labels(instance_id)
        self.malformed = _malformed(r)


class GatewayMetrics:
    """HTTP requests, and the serving latencies HTTP clients see (``model_name``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter("dls_gateway_http_requests", "HTTP requests answered", ["route", "status"],
                                registry=r)
        self.seconds = Histogram("dls_gateway_http_request_seconds", "HTTP request time (streams: to the end)",
                                 ["route"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.malformed = _malformed(r)
        serving = ServingMetrics(r, "dls_gateway", ", as the HTTP client sees it (TTFT, inter-token: streams)")
        self.ttft, self.itl, self.tpot, self.e2e = serving.ttft, serving.itl, serving.tpot, serving.e2e
        self.idempotent_joins = Counter("dls_gateway_idempotent_joins", "requests answered by joining a running "
                                        "or finished one (a retry: Idempotency-Key, or the SDK's retry header)",
                                        registry=r)
        self.abandoned = Counter("dls_gateway_abandoned_requests", "requests cancelled because their client "
                                 "left (disconnected or timed out) and no retry joined them", registry=r)
        self.cold_start_seconds = Histogram(
            "dls_gateway_cold_start_seconds", "how long requests for a model scaled to zero waited for its first "
            "READY instance (the cold start; DLS_GATEWAY_COLD_START_TIMEOUT_S), by outcome (served; ended: refused "
            "or failed while it waited; timed_out)", [MODEL_LABEL, "outcome"], buckets=COLD_START_BUCKETS_S,
            registry=r)


class PredictorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.queries = Counter("dls_predictor_queries", "requests predicted", registry=r)
        self.batch_size = Histogram("dls_predictor_batch_size", "queries per predict call", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.malformed = _malformed(r)
        # served requests, read back when they finish (services/predictor/core/served.py, retraining.py)
        self.live_error = Gauge("dls_predictor_live_error", "mean relative error of the remaining steps the serving "
                                "predictor gives, over the most recent rows of finished requests "
                                "(DLS_PREDICTOR_LIVE_ERROR_ROWS)", registry=r)
        self.served_error = Histogram("dls_predictor_served_error", "|predicted - actual| / actual remaining steps "
                                      "per row of a finished request, by the predictor serving when it finished "
                                      "(sum / count over any interval: its mean relative error)",
                                      buckets=ERROR_BUCKETS, registry=r)
        self.served_requests = Counter("dls_predictor_served_requests", "finished requests read back, by outcome "
                                       "(used; no_rows: no state ran at one threshold to the end; unusable: record "
                                       "or steps missing or inconsistent; not_served: of a model this predictor "
                                       "does not serve)", ["outcome"], registry=r)
        self.window_rows = Gauge("dls_predictor_retrain_window_rows", "rows kept to retrain on", registry=r)
        self.retrains = Counter("dls_predictor_retrains", "retrains run, by outcome (swapped: the new model serves; "
                                "kept: the serving one was as good; failed)", ["outcome"], registry=r)
        self.retrain_error = Gauge("dls_predictor_retrain_error", "the last retrain's mean relative error on its "
                                   "held-out rows, of the serving model (old) and the new one (new)", ["model"],
                                   registry=r)
        self.retrain_rows = Gauge("dls_predictor_retrain_rows", "rows the last retrain trained on (train) and "
                                  "scored on (holdout)", ["split"], registry=r)
        self.retrain_seconds = Gauge("dls_predictor_retrain_seconds", "the last retrain's duration", registry=r)
        self.by_model = PredictorModelMetrics(r)


class PredictorModelMetrics:
    """The predictor's series split by served model (label ``model``: the name queries and records use);
    ``PredictorMetrics``' own series stay every model's together (a one-model service reads as before)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.version = Info("dls_predictor_model", "the version of each served model's predictor answering now, by "
                            "kind (online, one_shot)", ["model", "kind"], registry=r)
        self.queries = Counter("dls_predictor_model_queries", "queries answered, by the model they named", ["model"],
                               registry=r)
        self.live_error = Gauge("dls_predictor_model_live_error", "dls_predictor_live_error of one served model: "
                                "the mean relative error of its serving predictor over its most recent rows",
                                ["model"], registry=r)
        self.window_rows = Gauge("dls_predictor_model_retrain_window_rows", "rows of one model's finished requests "
                                 "kept to retrain its predictor on", ["model"], registry=r)
        self.retrains = Counter("dls_predictor_model_retrains", "retrains of one model's predictor, by outcome "
                                "(swapped, kept, failed)", ["model", "outcome"], registry=r)

    def serving(self, model: str, one_shot: bool, version: str) -> None:
        """The version now answering ``model``'s queries of one kind."""
        self.version.labels(model=model, kind="one_shot" if one_shot else "online").info({"version": version})


class ReconfiguratorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.plans = Counter("dls_reconfigurator_plans", "plans published", registry=r)
        self.planned_gpus = Gauge("dls_reconfigurator_planned_gpus", "GPUs the last published division gives each "
                                  "served model (several models only)", ["model"], registry=r)
        self.malformed = _malformed(r)

    def set_division(self, gpus_by_model: dict[str, int]) -> None:
        """Planned GPUs per model (models planned before and left out now read 0)."""
        for model in {s.labels["model"] for m in self.planned_gpus.collect() for s in m.samples} - set(gpus_by_model):
            self.planned_gpus.labels(model=model).set(0)
        for model, num_gpus in gpus_by_model.items():
            self.planned_gpus.labels(model=model).set(num_gpus)


class NodeAgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.workers = Gauge("dls_node_agent_workers", "worker processes it manages", registry=r)
        self.restarts = Counter("dls_node_agent_restarts", "workers restarted after exiting unasked", registry=r)
        self.hung = Counter("dls_node_agent_hung_workers", "workers killed as hung (silent, or a step that never "
                            "returns)", registry=r)
        self.model_workers = Gauge("dls_node_agent_model_workers", "worker processes it manages, by the model they "
                                   "serve", ["model"], registry=r)
        self.switch_seconds = Histogram(
            "dls_node_agent_switch_seconds", "a slot's switch of model made before break "
            "(DLS_NODE_AGENT_OVERLAP_SWITCH), from the plan's decision to the outgoing instance stopped: the "
            "incoming worker's load beside it, then the outgoing one's drain; by the incoming model",
            ["model"], buckets=COLD_START_BUCKETS_S, registry=r)
        self.malformed = _malformed(r)
