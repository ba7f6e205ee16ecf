"""Typed settings per service, read from environment variables prefixed ``DLS_``.

Every service reads the common connection settings (``DLS_NATS_URL``, ``DLS_REDIS_URL``,
``DLS_SUBJECT_PREFIX``, ...) and its own, named ``DLS_<SERVICE>_<FIELD>`` (``DLS_GATEWAY_PORT``,
``DLS_WORKER_MAX_BATCH``, ...). A service builds its settings object once in ``__main__`` and passes
it into constructors; nothing here is instantiated at import time. Keyword arguments override the
environment: ``GatewaySettings(port=9000)``. ``env_vars(cls)`` lists a class's variables, and
``shared/README.md`` documents them all (a unit test keeps the two in step).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.messages.base import CacheMode
from shared.messages.codec import DEFAULT_MAX_PAYLOAD_BYTES
from shared.pipelining import DEFAULT_HELD_REPEATS
from shared.served import model_name
from shared.state import DEFAULT_COMPLETED_TTL_S
from shared.subjects import DEFAULT_PREFIX, Subjects, check_id

ENV_PREFIX = "DLS_"


def _own(service: str, name: str, default: Any, description: str, **kwargs: Any) -> Any:
    """A service-specific field, read from ``DLS_<SERVICE>_<NAME>``."""
    return Field(default, validation_alias=f"{ENV_PREFIX}{service}_{name}".upper(), description=description,
                 **kwargs)


MODEL_DIR_ENV = f"{ENV_PREFIX}MODEL_DIR"
DEFAULT_MODEL_DIR = "models/dls-tiny"


def _model_dir(service: str, description: str) -> Any:
    """The served model's directory: ``DLS_<SERVICE>_MODEL_DIR``, else ``DLS_MODEL_DIR`` (what ``dls up
    --model``, compose and the k8s manifests set for every service at once), else the bundled model."""
    return Field(DEFAULT_MODEL_DIR, validation_alias=AliasChoices(f"{ENV_PREFIX}{service}_model_dir".upper(),
                                                                  MODEL_DIR_ENV),
                 description=description)


MODEL_DIRS_ENV = f"{ENV_PREFIX}MODEL_DIRS"


def _model_dirs(service: str) -> Any:
    """Several served models' directories, comma-separated: ``DLS_<SERVICE>_MODEL_DIRS``, else
    ``DLS_MODEL_DIRS`` (what ``dls up --model A --model B`` sets for every service at once); empty: the
    service's ``model_dir`` alone. Each basename is a model's name (what requests name)."""
    return Field("", validation_alias=AliasChoices(f"{ENV_PREFIX}{service}_model_dirs".upper(), MODEL_DIRS_ENV),
                 description="several served models: their directories, comma-separated (each basename is a "
                             "model's name; requests name one); empty: model_dir alone")


def split_model_dirs(model_dirs: str, model_dir: str) -> list[str]:
    """The served models' directories: ``model_dirs`` (comma-separated), else ``model_dir`` alone."""
    return [d.strip() for d in model_dirs.split(",") if d.strip()] or [model_dir]


class ServiceSettings(BaseSettings):
    """What every service needs: where NATS and Redis are, and the names it shares with the others."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, populate_by_name=True, extra="ignore")

    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma-separated")
    redis_url: str = Field("redis://127.0.0.1:6379/0",
                           description="Redis of the request-state store: redis://host:port/db, or "
                                       "redis+sentinel://host:port,.../<master>/db (shared/redis_target.py)")
    subject_prefix: str = Field(DEFAULT_PREFIX, description="prefix of every NATS subject and of the intake stream")
    redis_key_prefix: str = Field(DEFAULT_PREFIX, description="prefix of every Redis key")
    max_payload_bytes: int = Field(DEFAULT_MAX_PAYLOAD_BYTES, gt=0,
                                   description="largest encoded message a service publishes or accepts")
    log_level: str = Field("INFO", description="logging level name")
    otel_endpoint: str | None = Field(None, description="OTLP endpoint for traces; unset: no export")
    metrics_port: int = Field(0, ge=0, le=65535, description="port of the Prometheus /metrics endpoint; 0: off")
    metrics_host: str = Field("127.0.0.1", description="address the /metrics endpoint binds")
    intake_replicas: int = Field(1, gt=0, le=5,
                                 description="JetStream replicas of the intake stream (3 on a 3-node NATS cluster)")
    scheduler_shards: int = Field(1, gt=0, le=64,
                                  description="scheduler replicas, each owning the requests and instances whose "
                                              "ids hash to it (every service must agree)")
    calibration_dir: str = Field("", description="the served model's calibration bundle (`dls calibrate`'s "
                                                 "--out); empty: <model directory>/calibration; a model with "
                                                 "none is served uncalibrated (shared/calibration.py)")
    trust_remote_code: bool = Field(False, description="let transformers run the tokenizer code a checkpoint "
                                                       "ships (Dream's tokenization_dream.py); the gateway and "
                                                       "every worker load the tokenizer (the node agent passes "
                                                       "it on); off: a checkpoint's tokenizer.json instead, "
                                                       "where it has one")

    @field_validator("subject_prefix")
    @classmethod
    def _valid_prefix(cls, prefix: str) -> str:
        return Subjects(prefix).prefix  # SubjectError (a ValueError) names what is wrong


class ServesModels:
    """A service that serves one model or several (``model_dir``, ``model_dirs``); ``shared.served`` names
    them, refuses two of one name and gives ``calibration_dir`` to the first."""

    model_dir: str
    model_dirs: str

    @property
    def served_model_dirs(self) -> list[str]:
        """The served models' directories: ``model_dirs``, else ``model_dir`` alone."""
        return split_model_dirs(self.model_dirs, self.model_dir)


class GatewaySettings(ServesModels, ServiceSettings):
    """The HTTP edge."""

    host: str = _own("gateway", "host", "127.0.0.1", "address the HTTP server binds")
    port: int = _own("gateway", "port", 8000, "HTTP port")
    api_keys: list[str] = _own("gateway", "api_keys", [], "accepted bearer tokens (JSON list); empty: no auth")
    default_slo_ms: float = _own("gateway", "default_slo_ms", 30_000.0,
                                 "SLO of requests that set none while the predictor service does not answer or "
                                 "the profile is unusable", gt=0)
    default_gen_length: int | None = _own("gateway", "default_gen_length", None,
                                          "max_tokens of requests that set none; unset: the model's")
    default_block_length: int | None = _own("gateway", "default_block_length", None,
                                            "block length of requests that set none; unset: the model's")
    max_gen_length: int = _own("gateway", "max_gen_length", 4096,
                               "longest canvas a request gets (the model's own longest also applies); a larger "
                               "max_tokens is capped, not refused", gt=0)
    min_block_length: int = _own("gateway", "min_block_length", 4,
                                 "smallest block_length a request may set (each block starts with a full recompute "
                                 "forward with a KV cache; blocks of 1-3 tokens cost a recompute per token or two); "
                                 "smaller: a 400 naming block_length", gt=0)
    max_blocks: int = _own("gateway", "max_blocks", 128,
                           "most blocks (so recompute steps with a KV cache) one request's canvas may hold: "
                           "canvas / block_length above it is a 400 naming block_length", gt=0)
    max_recompute_steps: int = _own("gateway", "max_recompute_steps", 512,
                                    "most full forwards one request may need at worst: its blocks with a KV cache, "
                                    "its canvas without one (cache none commits a token per step at worst); more: a "
                                    "400 naming cache", gt=0)
    request_timeout_s: float = _own("gateway", "request_timeout_s", 300.0,
                                    "give up waiting for a request's final event after this long", gt=0)
    cold_start_timeout_s: float = _own("gateway", "cold_start_timeout_s", 180.0,
                                       "a request for a served model with no READY instance, while a worker of "
                                       "another served model is READY (the model scaled to zero), is admitted and "
                                       "waits this long for one of its instances to be READY (a cold start), then "
                                       "gets a 503 naming the model; 0: such a request gets the 503 at once",
                                       ge=0)
    model_dir: str = _model_dir("gateway", "served model's directory (tokenizer, config, calibration); its basename "
                                           "is the model name")
    model_dirs: str = _model_dirs("gateway")
    model_slo_ms: str = _own("gateway", "model_slo_ms", "",
                             "a default SLO (ms) per model, as name=ms pairs, comma-separated (what a request that "
                             "sets no slo_ms gets); a model not named: from its profile, as default_slo_ms says")
    chat_template: str = _own("gateway", "chat_template", "",
                              "chat template (Jinja) to use instead of the model's: a file path or the template "
                              "itself; empty: the tokenizer's own")
    profile: str = _own("gateway", "profile", "",
                        "step-latency profile for default SLOs (TP-1 latency at batch 1); empty: the served "
                        "model's calibration's (uncalibrated: DLS_GATEWAY_DEFAULT_SLO_MS)")
    profile_scale: float = _own("gateway", "profile_scale", 1.0,
                                "multiply the profile's latencies by this (as the workers' DLS_WORKER_PACE_SCALE)", gt=0)
    default_slo_factor: float = _own("gateway", "default_slo_factor", 5.0,
                                     "default SLO = this times the predicted isolated latency", gt=0)
    min_default_slo_ms: float = _own("gateway", "min_default_slo_ms", 1000.0,
                                     "floor of a computed default SLO (NATS/Redis round trips on a busy host)",
                                     ge=0)
    max_request_bytes: int = _own("gateway", "max_request_bytes", 1_048_576, "largest HTTP request body accepted",
                                  gt=0)
    max_messages: int = _own("gateway", "max_messages", 256, "most chat messages in one request", gt=0)
    retry_after_s: int = _own("gateway", "retry_after_s", 2,
                              "Retry-After (s) of 429 (SLO infeasible now) and 503 (no instance) answers", ge=0)
    rate_limit_per_min: int = _own("gateway", "rate_limit_per_min", 0,
                                   "completions one API key (or, without keys, one client address) may send per "
                                   "minute, counted in Redis; 0: no limit", ge=0)
    max_in_flight: int = _own("gateway", "max_in_flight", 1024,
                              "most requests this gateway holds open at once; more get 429 with Retry-After", gt=0)
    graceful_shutdown_s: float = _own("gateway", "graceful_shutdown_s", 30.0,
                                      "on SIGTERM, open requests get this long to finish before the server closes "
                                      "them (keep it under the pod's terminationGracePeriodSeconds less its preStop "
                                      "delay)", gt=0)
    result_poll_s: float = _own("gateway", "result_poll_s", 5.0,
                                "a request that heard no event for this long is looked up in Redis (delivers a "
                                "result whose final event was lost)", gt=0)
    sse_keepalive_s: float = _own("gateway", "sse_keepalive_s", 5.0,
                                  "a stream that sent nothing for this long gets a `: keep-alive` comment line "
                                  "(proxies cut idle streams), and a streamed request queued this long after the "
                                  "scheduler accepted it has its stream opened with one; 0: none", ge=0)
    retry_grace_s: float = _own("gateway", "retry_grace_s", 10.0,
                                "a request under a retry key (Idempotency-Key, or the OpenAI SDK's retry header) "
                                "whose client left waits this long for a retry to join it before it is cancelled; "
                                "0: cancelled at once", ge=0)
    idempotency_ttl_s: float = _own("gateway", "idempotency_ttl_s", 600.0,
                                    "how long a retry key stands for its request (a retry after it finished gets "
                                    "the stored answer while the key and the result last)", gt=0)

    @field_validator("model_slo_ms")
    @classmethod
    def _slo_pairs(cls, value: str) -> str:
        parse_model_slos(value)  # a ValueError naming the pair that is wrong
        return value


    @property
    def slo_ms_by_model(self) -> dict[str, float]:
        return parse_model_slos(self.model_slo_ms)


def parse_model_slos(text: str) -> dict[str, float]:
    """``name=ms,name=ms`` as a dict; ``ValueError`` naming the field and the pair that is wrong."""
    out: dict[str, float] = {}
    for pair in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, ms = pair.partition("=")
        try:
            value = float(ms) if sep and name.strip() else -1.0
        except ValueError:
            value = -1.0
        if value <= 0:
            raise ValueError(f"DLS_GATEWAY_MODEL_SLO_MS: {pair!r} is not name=ms with ms > 0")
        out[name.strip()] = value
    return out


class SchedulerSettings(ServesModels, ServiceSettings):
    """The step loop."""

    policy: str = _own("scheduler", "policy", "dilaserve", "scheduling policy, by registry name")
    policy_config: str | None = _own("scheduler", "policy_config", None, "JSON file with the policy's config")
    thresholds: list[float] = _own("scheduler", "thresholds", [0.5, 0.6, 0.7, 0.8, 0.9],
                                   "candidate confidence thresholds (JSON list)")
    quality_budget_pp: float = _own("scheduler", "quality_budget_pp", 1.0,
                                    "keep the candidate thresholds whose accuracy on the served model's measured "
                                    "curve (<model_dir>/quality.json) is within this many points of the highest's; "
                                    "negative: all of them")
    quality_curves: list[str] = _own("scheduler", "quality_curves", [],
                                     "the curves of quality.json the budget applies to (JSON list: 'accuracy' for the "
                                     "short families' mix, 'accuracy_dual_cache', 'accuracy@<canvas>' for the mix on "
                                     "one canvas, task family names, '<family>@<block>'); empty: the mix and every "
                                     "family at the default canvas")
    profile: str = _own("scheduler", "profile", "",
                        "step-latency profile for instances whose heartbeat names none (or an unreadable one); "
                        "empty: the served model's calibration's")
    model_dir: str = _model_dir("scheduler", "served model (its config gives the mask id; its calibration the "
                                             "candidate thresholds)")
    model_dirs: str = _model_dirs("scheduler")
    consumer_name: str = _own("scheduler", "consumer_name", "scheduler", "durable JetStream consumer on the intake")
    intake_batch: int = _own("scheduler", "intake_batch", 64, "most intake messages fetched at once", gt=0)
    ack_wait_s: float = _own("scheduler", "ack_wait_s", 30.0,
                             "an intake message not acked within this long is redelivered", gt=0)
    predict_wait_s: float = _own("scheduler", "predict_wait_s", 0.05,
                                 "hold a step's results this long at most for the fresh predictions, so the next "
                                 "thresholds use them; 0: predictions always arrive asynchronously", ge=0)
    predictor_timeout_s: float = _own("scheduler", "predictor_timeout_s", 0.5,
                                      "wait this long for a prediction before keeping the last one", gt=0)
    overlap_min_tokens: int = _own("scheduler", "overlap_min_tokens", 32,
                                   "overlap: an instance whose requests all have at least this many tokens left and "
                                   "no block start next gets its next step before the scheduling pass, which then "
                                   "sets their thresholds for the step after (one step late); 0: off", ge=0)
    shard: int = _own("scheduler", "shard", 0, "this replica's shard, 0 .. DLS_SCHEDULER_SHARDS - 1", ge=0)
    pipeline_steps: bool = _own("scheduler", "pipeline_steps", True,
                                "pipelining (with overlap): while a step runs, send the command for the step after "
                                "it, which the worker runs at once if its batch is unchanged (no round trip)")
    held_repeats: int = _own("scheduler", "held_repeats", DEFAULT_HELD_REPEATS,
                             "pipelining: a command may run again up to this many steps where its worker has no "
                             "newer one in hand when a step ends (the scheduler lags behind the workers); 0: never",
                             ge=0)
    recompute_tokens: int | None = _own("scheduler", "recompute_tokens", None,
                                        "the recompute tokens one step carries at most: block starts over it wait "
                                        "for the next steps, in order of deadline (chunked prefill's token budget "
                                        "for a DLM's full forwards); unset: each instance's profile's budget (the "
                                        "batch where a recompute step's throughput stops growing, times the "
                                        "profile's context); 0: no cap", ge=0)
    first_step_waits: bool = _own("scheduler", "first_step_waits", True,
                                  "pipelining: a short answer's second step waits for the scheduling pass that "
                                  "plans it with the first step's prediction, instead of going on at the first "
                                  "step's provisional threshold (costs its instance one round trip)")
    shadow_rate: float = _own("scheduler", "shadow_rate", 0.01,
                              "share of finished requests that ran below the highest candidate threshold decoded "
                              "again at the highest, at the lowest priority (only in a free slot), to watch the "
                              "quality curve's promise (services/scheduler/core/quality_watch.py); 0: off", ge=0, le=1)
    shadow_step_budget: float = _own("scheduler", "shadow_step_budget", 0.02,
                                     "shadow decodings' most request-steps as a share of all: none starts while "
                                     "they took more", ge=0, le=1)
    shadow_max_in_flight: int = _own("scheduler", "shadow_max_in_flight", 4,
                                     "most shadow decodings queued or running at once", ge=0)
    shadow_min_samples: int = _own("scheduler", "shadow_min_samples", 20,
                                   "shadow decodings a threshold needs before its agreement can tighten the "
                                   "candidates", gt=0)
    shadow_tolerance_pp: float = _own("scheduler", "shadow_tolerance_pp", 2.0,
                                      "a threshold whose agreement falls more than this many points below what the "
                                      "curve promised leaves the candidates, with every one below it", ge=0)
    stats_interval_s: float = _own("scheduler", "stats_interval_s", 10.0, "period of workload stats", gt=0)
    completed_ttl_s: float = _own("scheduler", "completed_ttl_s", DEFAULT_COMPLETED_TTL_S,
                                  "finished requests stay in Redis this long", gt=0)
    step_timeout_s: float = _own("scheduler", "step_timeout_s", 120.0,
                                 "a step whose results have not come back after this long is lost (command or "
                                 "results dropped): its requests resume from Redis", gt=0)

    @model_validator(mode="after")
    def _shard_in_range(self) -> SchedulerSettings:
        if self.shard >= self.scheduler_shards:
            raise ValueError(f"DLS_SCHEDULER_SHARD {self.shard} is not below DLS_SCHEDULER_SHARDS {self.scheduler_shards}")
        return self


class WorkerSettings(ServiceSettings):
    """One model instance."""

    instance_id: str | None = _own("worker", "instance_id", None, "instance id; unset: <node>-<gpus>-<pid>")
    node: str = _own("worker", "node", "local", "node name (the node agent sets it)")
    gpu_ids: list[int] = _own("worker", "gpu_ids", [], "GPUs of the node this instance holds (JSON list)")
    shard: int | None = _own("worker", "shard", None, "the scheduler shard that owns this instance (the node agent "
                             "sets it); unset: by hash of the instance id", ge=0)
    tp: int = _own("worker", "tp", 1, "tensor-parallel degree", gt=0)
    model_dir: str = _model_dir("worker", "model directory (bundled, LLaDA or Dream)")
    device: str = _own("worker", "device", "cpu",
                       "torch device: cpu, cuda or cuda:N (rank r on cuda:N+r of the GPUs this process sees; "
                       "the node agent pins each worker to its slot's GPUs with CUDA_VISIBLE_DEVICES)")
    max_batch: int = _own("worker", "max_batch", 16, "most requests one step carries", gt=0)
    kv_budget_bytes: int = _own("worker", "kv_budget_bytes", 0,
                                "bytes the KV cache pool may take per GPU; 0: on CUDA, kv_memory_fraction of the "
                                "GPU memory free once the model is loaded; elsewhere no cap", ge=0)
    kv_memory_fraction: float = _own("worker", "kv_memory_fraction", 0.9,
                                     "on CUDA without kv_budget_bytes: the share of free GPU memory the KV pool may "
                                     "take", gt=0, le=1)
    heartbeat_interval_s: float = _own("worker", "heartbeat_interval_s", 2.0, "period of heartbeats", gt=0)
    lease_ttl_s: float = _own("worker", "lease_ttl_s", 6.0, "the scheduler drops the instance after this silence",
                              gt=0)
    profile: str = _own("worker", "profile", "",
                        "latency profile the scheduler plans this instance with when it is not paced; empty: "
                        "the served model's calibration's, for this device (uncalibrated: the step times this "
                        "worker measures, sent in its heartbeats)")
    drain_timeout_s: float = _own("worker", "drain_timeout_s", 30.0,
                                  "a draining worker leaves after this long even if requests are still on it "
                                  "(they resume elsewhere from Redis)", gt=0)
    pace_scale: float = _own("worker", "pace_scale", 1.0,
                             "multiply the paced latencies by this (e.g. one small-model step as many big-model steps)",
                             gt=0)
    pace_context_tokens: int | None = _own(
        "worker", "pace_context_tokens", None,
        "context (prompt + generation tokens) at which the paced latencies apply; a step's recompute part is "
        "scaled by its requests' mean context over it; unset: the profile's latencies as they are", gt=0)
    pace_profile: str | None = _own("worker", "pace_profile", None,
                                    "latency profile to pace steps to (emulate a GPU); unset: run at own speed")
    clock_offset_s: float = Field(0.0, validation_alias=f"{ENV_PREFIX}TEST_CLOCK_OFFSET_S",
                                  description="TESTS ONLY: the worker's clock runs this many seconds ahead (negative: "
                                              "behind), as on a host with a skewed clock")

    @field_validator("instance_id")
    @classmethod
    def _valid_instance_id(cls, instance_id: str | None) -> str | None:
        return None if instance_id is None else check_id(instance_id, "instance id")  # it is a subject token


class PredictorSettings(ServesModels, ServiceSettings):
    """The remaining-step predictor."""

    model_dir: str = _model_dir("predictor", "served model: its calibration's predictor answers (uncalibrated: a "
                                             "model-free bound)")
    model_dirs: str = _model_dirs("predictor")
    mode: Literal["online", "one-shot"] = _own("predictor", "mode", "online",
                                               "online (progress features) or one-shot (arrival estimate)")
    queue_group: str = _own("predictor", "queue_group", "predictor", "NATS queue group of predictor replicas")
    # keeping the predictor true while serving (services/predictor/core/retraining.py)
    retrain: bool = _own("predictor", "retrain", True,
                         "retrain the online predictor on the served requests' steps in the background; a new "
                         "model replaces the serving one only where its error on the most recent requests is "
                         "lower (false: the live error is still measured)")
    retrain_interval_s: float = _own("predictor", "retrain_interval_s", 300.0, "period between retrains", gt=0)
    retrain_min_rows: int = _own("predictor", "retrain_min_rows", 500,
                                 "rows (states of finished requests) in the window before a retrain", ge=2)
    retrain_holdout_share: float = _own("predictor", "retrain_holdout_share", 0.2,
                                        "share of the window's rows held out (the most recent requests') to score "
                                        "the new model against the serving one", gt=0, lt=1)
    retrain_window_rows: int = _own("predictor", "retrain_window_rows", 20_000,
                                    "rows of the most recent finished requests kept to retrain on", ge=1)
    live_error_rows: int = _own("predictor", "live_error_rows", 1000,
                                "the live error metric is over this many most recent rows; 0 with retrain off: "
                                "finished requests are not read at all", ge=0)
    live_dir: str = _own("predictor", "live_dir", "",
                         "a retrained model that replaced the serving one is written here; empty: kept in memory "
                         "only (never loaded at start: copy it into the calibration's predictor/ to keep it)")

    @property
    def reads_served_requests(self) -> bool:
        """Whether the service reads finished requests' steps (for the live error or retraining)."""
        return self.retrain or self.live_error_rows > 0


DEFAULT_SWITCH_S = 60.0  # a model's switch time when DLS_RECONFIGURATOR_SWITCH_S names it not (the simulator's)
DEFAULT_MIN_INSTANCES = 1  # what a model keeps with no load when DLS_RECONFIGURATOR_MIN_INSTANCES names it not


def parse_model_pairs(text: str, setting: str, unit: str, cast: type, minimum: float) -> dict[str, Any]:
    """``name=value,name=value`` as a dict; ``ValueError`` naming ``setting`` and the pair that is wrong
    (a value that ``cast`` refuses or below ``minimum``, no name, or a name twice)."""
    out: dict[str, Any] = {}
    for pair in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, raw = (part.strip() for part in pair.partition("="))
        try:
            value = cast(raw) if sep and name else None
        except ValueError:
            value = None
        if value is None or not minimum <= value < float("inf"):  # NaN and infinity too
            raise ValueError(f"{setting}: {pair!r} is not name={unit} with {unit} >= {minimum:g}")
        if name in out:
            raise ValueError(f"{setting}: {name!r} is named twice")
        out[name] = value
    return out


class ReconfiguratorSettings(ServesModels, ServiceSettings):
    """The periodic cluster planner."""

    model_dir: str = _model_dir("reconfigurator", "served model: its calibration's profile plans the cluster "
                                                  "(uncalibrated: no plans; with several models, one uncalibrated "
                                                  "among them: no plans)")
    model_dirs: str = _model_dirs("reconfigurator")
    enabled: bool = _own("reconfigurator", "enabled", True, "publish plans; false: observe only")
    interval_s: float = _own("reconfigurator", "interval_s", 300.0, "period between plans", gt=0)
    cluster: str | None = _own("reconfigurator", "cluster", None,
                               "cluster spec: inline JSON or a JSON file (nodes, GPUs); unset: the nodes and "
                               "GPUs seen in heartbeats")
    profile: str = _own("reconfigurator", "profile", "",
                        "step-latency profile file (with several models: every one is planned with it, as the "
                        "workers of `dls up --pace` all step at its times); empty: each served model's "
                        "calibration's")
    profile_scale: float = _own("reconfigurator", "profile_scale", 1.0,
                                "multiply the planning profile's latencies by this, every served model's (as the "
                                "workers' DLS_WORKER_PACE_SCALE and DLS_GATEWAY_PROFILE_SCALE; `dls up --pace-scale` "
                                "sets it)", gt=0)
    block_length: int | None = _own("reconfigurator", "block_length", None,
                                    "block length the workload monitor counts steps in (keep it what requests get); "
                                    "unset: each served model's default block (its training_info.json, as the "
                                    "gateway's for a request that sets none; 32 where it records none)", gt=0)
    cache: CacheMode = _own("reconfigurator", "cache", CacheMode.DUAL,
                            "KV cache mode the workload monitor counts steps for: none (every step a full forward) "
                            "or prefix / dual (a full forward per block, cache steps between; prefix is planned as "
                            "dual); default dual, what a request that names no cache gets")
    improvement_margin: float = _own("reconfigurator", "improvement_margin", 0.1,
                                     "apply a plan only when Stage 1 improves by this fraction", ge=0)
    solver_time_limit_s: float = _own("reconfigurator", "solver_time_limit_s", 30.0, "HiGHS time limit", gt=0)
    kv_budget_bytes: int = _own("reconfigurator", "kv_budget_bytes", 0,
                                "KV cache memory per GPU the plans count (as DLS_WORKER_KV_BUDGET_BYTES; a degree-d "
                                "instance holds d times it); 0: plans are not limited by memory", ge=0)
    window_s: float = _own("reconfigurator", "window_s", 300.0, "arrival rates are measured over this sliding window",
                           gt=0)
    peak_windows: int | None = _own("reconfigurator", "peak_windows", None,
                                    "plan for the highest rate of the last this many windows, and make no plan "
                                    "for a gain alone before watching that long (unset: the monitor's default, 8; "
                                    "1: the last window alone)", ge=1)
    ack_timeout_s: float = _own("reconfigurator", "ack_timeout_s", 300.0,
                                "a plan (or one wave of a rolling plan) not acknowledged by all its nodes within "
                                "this long stops holding back the next", gt=0)
    rolling: bool = _own("reconfigurator", "rolling", True,
                         "publish a plan one changed node at a time, each once the previous node acknowledged "
                         "(its new instances are up); false: every node at once")
    switch_s: str = _own("reconfigurator", "switch_s", "",
                         "with several models: each one's switch time, the seconds from deciding to start one of "
                         "its instances to that instance serving (drain, stop, load its weights, warm up), which "
                         "the division weighs against what a move gains; name=seconds pairs, comma-separated; a "
                         f"model not named: {DEFAULT_SWITCH_S:g}")
    hedge_share: float = _own("reconfigurator", "hedge_share", 1.0,
                              "with several models: while the GPUs allow (at the lowest thresholds), each model with "
                              "load is planned for at least this share of all the cluster's arrivals, so that a flip "
                              "of the mix does not find it with the few GPUs its own load needs; the share is lowered "
                              "until the plans fit, to 0 where the models' own loads fill the cluster; 0: each model "
                              "planned for its own load alone", ge=0, le=1)
    min_instances: str = _own("reconfigurator", "min_instances", "",
                              "with several models: the instances each one keeps with no load, as name=n pairs, "
                              f"comma-separated (0 allowed); a model not named: {DEFAULT_MIN_INSTANCES}")

    @model_validator(mode="after")
    def _model_pairs(self) -> ReconfiguratorSettings:
        served = [model_name(d) for d in self.served_model_dirs]  # as shared.served names them
        for setting, pairs in (("DLS_RECONFIGURATOR_SWITCH_S", self.switch_s_by_model),
                               ("DLS_RECONFIGURATOR_MIN_INSTANCES", self.min_instances_by_model)):
            unknown = sorted(set(pairs) - set(served))
            if unknown:
                raise ValueError(f"{setting} names {', '.join(unknown)}, which is not served (served: "
                                 f"{', '.join(served)}; a model's name is its directory's basename)")
        return self

    @property
    def switch_s_by_model(self) -> dict[str, float]:
        # model name -> switch time (s); models not named: DEFAULT_SWITCH_S
        return parse_model_pairs(self.switch_s, "DLS_RECONFIGURATOR_SWITCH_S", "seconds", float, 0.0)

    @property
    def min_instances_by_model(self) -> dict[str, int]:
        # model name -> instances kept with no load; models not named: DEFAULT_MIN_INSTANCES
        return parse_model_pairs(self.min_instances, "DLS_RECONFIGURATOR_MIN_INSTANCES", "n", int, 0)


class NodeAgentSettings(ServesModels, ServiceSettings):
    """Starts and stops worker processes on one node."""

    node: str = _own("node_agent", "node", "local", "this node's name (plans address it)")
    # NOTE: DLS_WORKER_MODEL_DIR too, so an agent whose environment names its workers' model that way (as
    # `dls up` did, and as "any DLS_WORKER_* set for the agent reaches every worker" allowed) serves it still.
    model_dir: str = Field(DEFAULT_MODEL_DIR,
                           validation_alias=AliasChoices("DLS_NODE_AGENT_MODEL_DIR", "DLS_WORKER_MODEL_DIR",
                                                         MODEL_DIR_ENV),
                           description="the model its workers serve (each worker gets it as DLS_WORKER_MODEL_DIR); "
                                       "with several models, the first of them is also the one of a plan's slot "
                                       "that names none")
    model_dirs: str = _model_dirs("node_agent")
    initial_models: list[str] = _own("node_agent", "initial_models", [],
                                     "the served model of each worker started at boot, by name (a directory's "
                                     "basename), in the order of DLS_NODE_AGENT_INITIAL_INSTANCES (JSON list as "
                                     "long as it); empty: the served models in turn")
    gpu_ids: list[int] = _own("node_agent", "gpu_ids", [0], "GPUs this agent manages (JSON list)")
    num_gpus: int | None = _own("node_agent", "num_gpus", None,
                                "GPUs of this node; with DLS_NODE_AGENT_GPU_IDS unset they are 0..n-1, and with "
                                "DLS_NODE_AGENT_INITIAL_INSTANCES unset one TP-1 worker starts on each", gt=0)
    worker_command: str = _own("node_agent", "worker_command", "python -m services.worker",
                               "command that starts a worker (settings passed as DLS_WORKER_* variables)")
    start_timeout_s: float = _own("node_agent", "start_timeout_s", 120.0,
                                  "a worker that sends no READY heartbeat within this long failed to start", gt=0)
    initial_instances: list[int] = _own("node_agent", "initial_instances", [1],
                                        "TP degrees of the workers started at boot, on the first free slots "
                                        "(JSON list)")
    stop_timeout_s: float = _own("node_agent", "stop_timeout_s", 60.0,
                                 "a worker still running this long after SIGTERM is killed", gt=0)
    log_dir: str = _own("node_agent", "log_dir", "runs/logs", "directory of the workers' logs (<instance id>.log)")
    restart_backoff_s: float = _own("node_agent", "restart_backoff_s", 1.0,
                                    "delay before restarting a worker that exited unasked; doubles per "
                                    "consecutive crash", gt=0)
    restart_backoff_max_s: float = _own("node_agent", "restart_backoff_max_s", 60.0, "longest restart delay", gt=0)
    hang_timeout_s: float = _own("node_agent", "hang_timeout_s", 30.0,
                                 "a READY worker silent for this long, or reporting a step computing for this long, "
                                 "is hung: killed and restarted", gt=0)
    overlap_switch: Literal["auto", "on", "off"] = _own(
        "node_agent", "overlap_switch", "auto",
        "a plan's start of one model on GPUs where it stops another: on, the new worker loads beside the old one, "
        "which serves until the new one is READY and is stopped then (make before break); off, the old one is "
        "stopped first and the GPUs serve nothing while the new model loads; auto, on unless the workers run on "
        "CUDA (DLS_WORKER_DEVICE). On CUDA both models' weights and both workers' KV pools must fit one GPU: on "
        "needs DLS_WORKER_KV_BUDGET_BYTES")

    @model_validator(mode="after")
    def _gpus_from_count(self) -> NodeAgentSettings:
        if self.num_gpus is None:
            return self
        if "gpu_ids" not in self.model_fields_set:
            self.gpu_ids = list(range(self.num_gpus))
        elif len(self.gpu_ids) != self.num_gpus:
            raise ValueError(f"DLS_NODE_AGENT_GPU_IDS {self.gpu_ids} are not DLS_NODE_AGENT_NUM_GPUS "
                             f"{self.num_gpus} GPUs")
        if "initial_instances" not in self.model_fields_set:
            self.initial_instances = [1] * self.num_gpus
        return self


SERVICE_SETTINGS: dict[str, type[ServiceSettings]] = {  # service name -> its settings class
    "gateway": GatewaySettings,
    "scheduler": SchedulerSettings,
    "worker": WorkerSettings,
    "predictor": PredictorSettings,
    "reconfigurator": ReconfiguratorSettings,
    "node-agent": NodeAgentSettings,
}


def redact_urls(urls: str) -> str:
    """``urls`` (comma-separated) with any password replaced by ``***``, for logs and error messages."""
    from urllib.parse import urlsplit, urlunsplit

    out = []
    for url in urls.split(","):
        parts = urlsplit(url.strip())
        if parts.password is not None or (parts.username and "@" in parts.netloc):
            host = parts.netloc.rsplit("@", 1)[1]
            user = parts.username or ""
            parts = parts._replace(netloc=f"{user}:***@{host}" if parts.password is not None else f"***@{host}")
        out.append(urlunsplit(parts))
    return ",".join(out)


def env_vars(settings_cls: type[BaseSettings]) -> dict[str, str]:
    """Environment variable -> description, for every field of ``settings_cls``."""
    out = {}
    for name, info in settings_cls.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):  # its own variable, then the shared one (DLS_MODEL_DIR)
            for choice in alias.choices:
                out.setdefault(str(choice), info.description or "")
            continue
        alias = alias if isinstance(alias, str) else None
        out[alias or f"{ENV_PREFIX}{name}".upper()] = info.description or ""
    return out
