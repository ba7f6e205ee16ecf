"""The gateway's live views: a cluster dashboard (``/dashboard``) and a per-request timeline
(``/requests/{id}``), plain HTML and a little JavaScript from ``static/`` (no build step, nothing
fetched from outside).

The pages carry no data themselves: their scripts read it from two JSON routes under ``/v1/``,
behind the gateway's API-key middleware (``edge.py``) like every other route. A script that gets a
401 asks for a key and sends it as ``Authorization: Bearer`` (a ``#key=...`` fragment, never sent
to the server, pre-fills it). The page shells and ``/static/dashboard/`` hold no data, so the
middleware leaves them open (``edge.is_open``) and a browser can load them when keys are set.

- ``GET /v1/cluster``: live instances from the heartbeats the gateway tracks (TP degree, status,
  resident requests against the batch limit, the threshold and time of the last step the gateway saw),
  instances per TP degree, requests in flight through this gateway, the thresholds of recent steps,
  SLO attainment over time and the latest finished requests (``ClusterMonitor``: what this gateway's
  requests' events said).
- ``GET /v1/requests/{id}/timeline``: the request's stored state and per-step history (Redis) with
  the canvas as it filled in: one frame per step, rebuilt from each step's committed positions and
  the final canvas.

``mount_dashboard(app, gateway)`` adds the routes and wraps the gateway's bus in ``ObservedBus``,
which hands every event of a submitted request to the monitor on its way to the HTTP answer.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from services.gateway.answers import calibration_info
from services.gateway.schemas import LISTING_ERRORS, READ_ERRORS
from shared.messages.control import WorkerStatus
from shared.messages.events import RequestEvent, RequestFailed, RequestFinished, RequestProgress
from shared.messages.intake import CompletionRequest

STATIC_DIR = Path(__file__).parent / "static"
WINDOW_S = 600.0  # the monitor keeps this much history
BUCKET_S = 10.0  # SLO attainment over time: one point per this many seconds of finishes
RECENT_STEPS_S = 60.0  # "current thresholds": steps in the last minute
RECENT_REQUESTS = 20  # the dashboard's table of latest requests


@dataclass(frozen=True)
class Outcome:
    request_id: str
    finished_at: float  # unix time the gateway saw the final event
    ok: bool  # finished (False: failed)
    slo_met: bool
    latency_ms: float | None
    slo_ms: float
    steps: int
    thresholds: tuple[float, ...]
    instances: tuple[str, ...]
    migrations: int
    reason: str = ""  # failure reason


@dataclass
class InstanceSeen:
    last_threshold: float | None = None
    last_step_at: float | None = None
    steps: int = 0


class ClusterMonitor:
    """What the gateway saw of its requests' events, for the dashboard (pure: the caller gives times)."""

    def __init__(self, clock: Callable[[], float] = time.time, window_s: float = WINDOW_S) -> None:
        self.clock = clock
        self.window_s = window_s
        self.outcomes: deque[Outcome] = deque()
        self.steps: deque[tuple[float, str, float]] = deque()  # (time, instance, threshold) of progress events
        self.instances: dict[str, InstanceSeen] = {}
        self.in_flight = 0
        self.total_finished = 0
        self.total_met = 0
        self.total_failed = 0
        self.started_at = clock()

    def submitted(self, request: CompletionRequest) -> None:
        self.in_flight += 1

    def ended(self, request: CompletionRequest) -> None:
        self.in_flight = max(0, self.in_flight - 1)

    def observe(self, request: CompletionRequest, event: RequestEvent) -> None:
        now = self.clock()
        if isinstance(event, RequestProgress):
            self._step(now, event.instance_id, event.threshold)
        elif isinstance(event, RequestFinished):
            usage = event.usage
            self.outcomes.append(Outcome(
                event.request_id, now, True, usage.slo_met, usage.latency_s * 1000.0, request.slo_ms,
                usage.num_steps, tuple(usage.thresholds), tuple(usage.instance_ids), usage.num_migrations))
            self.total_finished += 1
            self.total_met += int(usage.slo_met)
            if not request.stream:  # no progress events came: count its steps now (their thresholds)
                for threshold in usage.thresholds:
                    self.steps.append((now, "", threshold))
        elif isinstance(event, RequestFailed):
            self.outcomes.append(Outcome(event.request_id, now, False, False, None, request.slo_ms, 0, (), (), 0,
                                         event.reason.name))
            self.total_failed += 1
        self._trim(now)

    def _step(self, now: float, instance_id: str, threshold: float) -> None:
        seen = self.instances.setdefault(instance_id, InstanceSeen())
        seen.last_threshold, seen.last_step_at, seen.steps = threshold, now, seen.steps + 1
        self.steps.append((now, instance_id, threshold))

    def _trim(self, now: float) -> None:
        while self.outcomes and self.outcomes[0].finished_at < now - self.window_s:
            self.outcomes.popleft()
        while self.steps and self.steps[0][0] < now - self.window_s:
            self.steps.popleft()

    def snapshot(self, heartbeats: Sequence, served: set[str], heard_s: dict[str, float] | None = None) -> dict:
        """The ``/v1/cluster`` body for these live heartbeats; ``heard_s``: instance id -> seconds since its
        latest heartbeat arrived (the worker's own ``sent_at`` is on its clock, which may be off)."""
        now = self.clock()
        self._trim(now)
        instances = []
        for hb in heartbeats:
            seen = self.instances.get(hb.instance_id, InstanceSeen())
            instances.append({
                "instance_id": hb.instance_id, "node": hb.node, "tp": hb.tp, "gpu_ids": list(hb.gpu_ids),
                "model": hb.model, "status": WorkerStatus(hb.status).name, "num_resident": hb.num_resident,
                "max_batch": hb.max_batch, "load": hb.num_resident / hb.max_batch if hb.max_batch else None,
                "profile_scale": hb.profile_scale, "last_threshold": seen.last_threshold,
                "profile": hb.profile or ("measured by its worker" if hb.measured is not None else ""),
                "last_step_age_s": None if seen.last_step_at is None else now - seen.last_step_at,
                "steps_seen": seen.steps,
                "heartbeat_age_s": (heard_s or {}).get(hb.instance_id, max(0.0, now - hb.sent_at)),
                "serves_this_model": hb.model in served,
            })
        recent = [t for at, _, t in self.steps if at >= now - RECENT_STEPS_S]
        finished = [o for o in self.outcomes if o.ok]
        window = [o for o in self.outcomes if o.finished_at >= now - RECENT_STEPS_S]
        return {
            "object": "dilaserve.cluster", "now": now, "models": sorted(served),
            "instances": instances,
            "tp_degrees": {str(tp): n for tp, n in sorted(Counter(i["tp"] for i in instances).items())},
            "load": {
                "in_flight": self.in_flight,
                "resident": sum(i["num_resident"] for i in instances),
                "capacity": sum(i["max_batch"] for i in instances),
            },
            "thresholds": {
                "window_s": RECENT_STEPS_S, "steps": len(recent),
                "mean": sum(recent) / len(recent) if recent else None,
                "histogram": {f"{t:g}": n for t, n in sorted(Counter(recent).items())},
            },
            "slo": {
                "finished": self.total_finished, "met": self.total_met, "failed": self.total_failed,
                "attainment": (self.total_met / (self.total_finished + self.total_failed)
                               if self.total_finished + self.total_failed else None),
                "recent_window_s": RECENT_STEPS_S,
                "recent_attainment": (sum(o.slo_met for o in window) / len(window)) if window else None,
                "bucket_s": BUCKET_S, "series": self._series(now),
                "mean_latency_ms": (sum(o.latency_ms for o in finished) / len(finished)) if finished else None,
            },
            "recent_requests": [
                {"id": o.request_id, "finished_at": o.finished_at, "ok": o.ok, "slo_met": o.slo_met,
                 "latency_ms": o.latency_ms, "slo_ms": o.slo_ms, "steps": o.steps, "instances": list(o.instances),
                 "migrations": o.migrations, "mean_threshold": (sum(o.thresholds) / len(o.thresholds)
                                                                if o.thresholds else None), "reason": o.reason}
                for o in list(self.outcomes)[-RECENT_REQUESTS:][::-1]
            ],
        }

    def _series(self, now: float) -> list[dict]:
        """SLO attainment per ``BUCKET_S`` of finishes (failures count as misses), oldest first."""
        buckets: dict[int, list[Outcome]] = {}
        for o in self.outcomes:
            buckets.setdefault(int(o.finished_at // BUCKET_S), []).append(o)
        return [{"t": k * BUCKET_S, "age_s": now - k * BUCKET_S, "requests": len(v),
                 "attainment": sum(o.slo_met for o in v) / len(v)} for k, v in sorted(buckets.items())]


class ObservedBus:
    """A ``Bus`` that shows every event of a submitted request to a ``ClusterMonitor`` first."""

    def __init__(self, inner, monitor: ClusterMonitor) -> None:
        self.inner = inner
        self.monitor = monitor

    async def submit(self, request: CompletionRequest,
                     headers: dict[str, str] | None = None) -> AsyncIterator[RequestEvent]:
        self.monitor.submitted(request)
        try:
            async for event in self.inner.submit(request, headers):
                self.monitor.observe(request, event)
                yield event
        finally:
            self.monitor.ended(request)

    def __getattr__(self, name: str):  # cancel, load_request, readiness and anything a bus adds
        return getattr(self.inner, name)


# --- the timeline ----------------------------------------------------------------------------------


def timeline(record, steps: Sequence, codec) -> dict:
    """Per-step rows and canvas frames of a stored request (``/v1/requests/{id}/timeline``).

    Frame k shows the canvas after step k: the positions committed by steps 1..k hold their final
    tokens, the rest the mask. Positions committed before the first stored step (none, normally)
    show from frame 0.
    """
    canvas = list(record.canvas)
    mask = record.mask_token_id
    tokens = [_token_text(codec, token_id, mask) for token_id in canvas]
    committed_by: dict[int, int] = {}
    for step in steps:
        for position in step.committed_positions:
            committed_by.setdefault(position, step.step_index)
    frames = []
    for k in [0, *[s.step_index for s in steps]]:
        frames.append({
            "step_index": k,
            "committed": [p for p, token_id in enumerate(canvas)
                          if token_id != mask and committed_by.get(p, 0) <= k],
            "new": [p for p, s in committed_by.items() if s == k] if k else [],
        })
    origin = record.arrival_time
    rows = [{
        "step_index": s.step_index, "instance_id": s.instance_id, "kind": s.kind.name.lower(),
        "block_index": s.block_index, "threshold": s.threshold, "batch_size": s.batch_size,
        "loaded_state": s.loaded_state, "queued": s.queued, "committed_positions": list(s.committed_positions),
        "tokens_committed": len(s.committed_positions),
        "committed_text": "".join(tokens[p] for p in s.committed_positions if 0 <= p < len(tokens)),
        "start_ms": (s.started_at - origin) * 1000.0, "duration_ms": s.duration_s * 1000.0,
        "started_at": s.started_at,  # unix time (s): steps of different requests on one instance line up
    } for s in steps]
    return {"object": "dilaserve.timeline", "id": record.request_id, "gen_length": record.gen_length,
            "block_length": record.block_length, "tokens": tokens, "mask": "_", "frames": frames, "steps": rows,
            "instances": list(dict.fromkeys(s.instance_id for s in steps))}


def _token_text(codec, token_id: int, mask: int) -> str:
    if token_id == mask:
        return "_"
    return codec.render_canvas([token_id])  # "" for EOS and pads


# --- routes ----------------------------------------------------------------------------------------


def mount_dashboard(app: FastAPI, gateway, clock: Callable[[], float] = time.time) -> ClusterMonitor:
    """Add the dashboard's pages and JSON routes to ``app``; observe ``gateway``'s requests."""
    from services.gateway.errors import ApiError
    from services.gateway.models import UnknownModelError
    from services.gateway.security import caller

    monitor = ClusterMonitor(clock)
    gateway.bus = ObservedBus(gateway.bus, monitor)
    app.state.cluster_monitor = monitor
    app.mount("/static/dashboard", StaticFiles(directory=STATIC_DIR), name="dashboard-static")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.html", headers={"Cache-Control": "no-cache"})

    @app.get("/requests/{request_id}", include_in_schema=False)
    async def timeline_page(request_id: str) -> FileResponse:
        return FileResponse(STATIC_DIR / "timeline.html", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/cluster", responses=LISTING_ERRORS)
    async def cluster() -> dict:
        """Live instances, load, recent thresholds and SLO attainment over time (the dashboard's data)."""
        state = await gateway.bus.readiness()
        served = {m.name for m in gateway.preparer.catalogue.models}
        body = monitor.snapshot(state.workers, served, state.heard_s)
        body["calibration"] = {m.name: calibration_info(m).model_dump() for m in gateway.preparer.catalogue.models}
        body["ready"] = {"nats": state.nats_connected, "redis": state.redis_ok, "detail": dict(state.detail)}
        return body

    @app.get("/v1/requests/{request_id}/timeline", responses=READ_ERRORS)
    async def request_timeline(request_id: str, request: Request) -> dict:
        """A request's steps and its canvas as it filled in (the timeline page's data)."""
        info = await gateway.request_state(request_id, caller(request))  # 404 / 503 (and owner) as /v1/requests/{id}
        loaded = await gateway.bus.load_request(request_id)
        if loaded is None:
            raise ApiError(404, f"request {request_id} not found", "request_id", "request_not_found")
        record, steps = loaded
        try:
            codec = gateway.preparer.catalogue.get(record.model).codec
        except UnknownModelError:
            codec = gateway.preparer.catalogue.models[0].codec
        body = timeline(record, steps, codec)
        body["request"] = {k: v for k, v in info.items() if k != "steps"}
        return body

    return monitor
