"""An in-process live cluster for integration tests: the real scheduler and worker services (each on
its own NATS connection) against real nats-server and redis-server, driven by publishing intake
requests and reading per-request events, as the gateway does."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import nats

from services.scheduler.service import SchedulerService
from services.worker.engine.engine import CacheMode, DLMEngine
from services.worker.service.service import WorkerService
from services.worker.service.startup import worker_clock
from shared.jetstream import ensure_intake_stream, publish_request
from shared.messages import codec
from shared.messages.base import CacheMode as WireCacheMode
from shared.messages.events import RequestEvent, RequestFailed, RequestFinished, RequestProgress
from shared.messages.intake import CompletionRequest
from shared.settings import SchedulerSettings, WorkerSettings
from shared.state import RedisStateStore
from shared.subjects import Subjects

MODEL_DIR = "models/dls-tiny"
H100_PROFILE = "profiles/llada-8b-h100.json"

_ENGINE: DLMEngine | None = None


def engine() -> DLMEngine:
    """The bundled model's engine, loaded once per test session (workers get their own copies)."""
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = DLMEngine.from_pretrained(MODEL_DIR)
    return _ENGINE


def fresh_engine() -> DLMEngine:
    e = engine()
    return DLMEngine(e.model, e.tokenizer, e.default_gen_length, e.default_block_length, name=e.name)


@dataclass
class Outcome:
    request_id: str
    events: list = field(default_factory=list)

    @property
    def final(self):
        return self.events[-1] if self.events else None

    @property
    def progress(self) -> list[RequestProgress]:
        return [e for e in self.events if isinstance(e, RequestProgress)]


class LiveCluster:
    """Scheduler + workers of one test, with their own subject and key prefix."""

    def __init__(self, nats_url: str, redis_url: str, prefix: str, policy: str = "dilaserve",
                 scheduler_overrides: dict | None = None) -> None:
        self.nats_url, self.redis_url, self.prefix = nats_url, redis_url, prefix
        self.subjects = Subjects(prefix)
        common = dict(nats_url=nats_url, redis_url=redis_url, subject_prefix=prefix, redis_key_prefix=prefix)
        self.common = common
        self.scheduler_settings = SchedulerSettings(
            **common, policy=policy, consumer_name=f"sched-{prefix}", stats_interval_s=1.0,
            predictor_timeout_s=0.2, **(scheduler_overrides or {}),
        )
        self.workers: dict[str, WorkerService] = {}
        self._connections = []
        self.scheduler: SchedulerService | None = None

    async def _connect(self):
        nc = await nats.connect(self.nats_url)
        self._connections.append(nc)
        return nc

    async def start(self, num_workers: int = 1, **worker_overrides) -> None:
        self.client = await self._connect()
        self.js = self.client.jetstream()
        await ensure_intake_stream(self.js, self.subjects)
        await self.start_scheduler()
        for _ in range(num_workers):
            await self.add_worker(**worker_overrides)

    async def start_scheduler(self) -> SchedulerService:
        nc = await self._connect()
        store = RedisStateStore.from_url(self.redis_url, self.prefix)
        self.scheduler = SchedulerService(self.scheduler_settings, nc, nc.jetstream(), store)
        await self.scheduler.start()
        return self.scheduler

    async def add_worker(self, instance_id: str | None = None, engine=None, wait: bool = True,
                         **overrides) -> WorkerService:
        """Start a worker service (settings ``overrides``); ``wait``: until the scheduler has it."""
        instance_id = instance_id or f"w{len(self.workers)}-{uuid.uuid4().hex[:6]}"
        settings = WorkerSettings(**self.common, **{"heartbeat_interval_s": 0.3, "lease_ttl_s": 1.5, **overrides})
        nc = await self._connect()
        store = RedisStateStore.from_url(self.redis_url, self.prefix)
        worker = WorkerService(settings, engine or fresh_engine(), nc, store, instance_id=instance_id,
                               clock=worker_clock(settings.clock_offset_s))
        await worker.start()
        self.workers[instance_id] = worker
        if wait:
            await self.wait_for(lambda: instance_id in self.scheduler.view.instances, what=f"{instance_id} joined")
        return worker

    async def wait_for(self, condition, timeout_s: float = 20.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            await asyncio.sleep(0.02)

    async def submit(self, prompt_ids: list[int], *, gen_length: int = 16, block_length: int = 8,
                     cache: WireCacheMode = WireCacheMode.NONE, slo_ms: float = 60_000.0, stream: bool = False,
                     on_event=None, **fields) -> Outcome:
        """Publish one request as the gateway does and wait for its terminal event."""
        rid = f"cmpl-{uuid.uuid4().hex}"
        outcome = Outcome(rid)
        done = asyncio.Event()

        async def on_msg(msg):
            event = codec.decode(RequestEvent, msg.data)
            outcome.events.append(event)
            if on_event is not None:
                await on_event(event)
            if isinstance(event, RequestFinished | RequestFailed):
                done.set()

        sub = await self.client.subscribe(self.subjects.events(rid), cb=on_msg)
        request = CompletionRequest(request_id=rid, prompt_token_ids=prompt_ids, gen_length=gen_length,
                                    block_length=block_length, cache_mode=cache, slo_ms=slo_ms,
                                    arrival_time=time.time(), stream=stream, **fields)
        await publish_request(self.js, self.subjects, request, shards=self.scheduler_settings.scheduler_shards)
        try:
            await asyncio.wait_for(done.wait(), 60)
        finally:
            await sub.unsubscribe()
        return outcome

    async def close(self) -> None:
        for worker in self.workers.values():
            await worker.stop()
        if self.scheduler is not None:
            await self.scheduler.stop()
        for nc in self._connections:
            await nc.close()


def offline_tokens(prompt_ids: list[int], thresholds: list[float], gen_length: int = 16, block_length: int = 8,
                   cache: CacheMode = CacheMode.NONE) -> list[int]:
    """What the engine alone commits for this prompt stepping at exactly these thresholds."""
    e = fresh_engine()
    state = e.new_request("offline", prompt_ids, gen_length, block_length, cache)
    for tau in thresholds:
        assert not state.finished, "more thresholds than steps"
        e.step([(state, tau)])
    assert state.finished, "fewer thresholds than steps"
    canvas = state.canvas
    return canvas[: canvas.index(e.eos_id)] if e.eos_id in canvas else canvas
