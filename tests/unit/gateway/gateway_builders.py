"""Builders for the gateway tests: settings, scripted events, and ``FakeBus``, a fake stand-in for
``GatewayBus`` that records submissions and answers with scripted events (no NATS, no Redis)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.gateway.bus import Readiness
from shared.messages.control import WorkerHeartbeat, WorkerStatus
from shared.messages.events import (
    FailureReason,
    RequestAccepted,
    RequestEvent,
    RequestFailed,
    RequestFinished,
    RequestProgress,
    Usage,
)
from shared.messages.intake import CompletionRequest
from shared.messages.predictor import PredictReply, PredictRequest, RemainingSteps, StepPrediction
from shared.settings import GatewaySettings
from shared.state import RequestRecord, StepRecord
from shared.tokenizer import CharTokenizer

REPO = Path(__file__).resolve().parents[3]
MODEL_DIR = REPO / "models" / "dls-tiny"
PROFILE = REPO / "models" / "dls-tiny" / "calibration" / "profile.json"
MODEL = "dls-tiny"
TOKENIZER = CharTokenizer.from_pretrained(MODEL_DIR)

Script = Callable[[CompletionRequest], list[RequestEvent]]  # a request -> the events the fake publishes


def settings(**overrides) -> GatewaySettings:
    values = {"model_dir": str(MODEL_DIR), "profile": str(PROFILE), **overrides}
    return GatewaySettings(**values)


def usage(prompt_tokens: int, completion_tokens: int, num_steps: int = 3) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, num_steps=num_steps,
                 num_recompute_steps=2, thresholds=[0.9] * num_steps, instance_ids=["local-0", "local-1"],
                 num_migrations=1, latency_s=0.25, slo_met=True)


def progress(request: CompletionRequest, step: int, positions: list[int], text: str, delta: str = "",
             threshold: float = 0.9, instance_id: str = "local-0") -> RequestProgress:
    """The progress event of ``step``: ``text`` committed at ``positions``."""
    return RequestProgress(request_id=request.request_id, seq=step + 1, num_steps=step, block_index=0,
                           committed_positions=positions, committed_token_ids=TOKENIZER.encode(text),
                           num_committed=len(positions), gen_length=request.gen_length, text_delta=delta,
                           threshold=threshold, instance_id=instance_id)


def answer_script(text: str = "42", finish_reason: str = "stop") -> Script:
    """Accepted, one progress event per character for streaming requests, then finished with ``text``."""
    def script(request: CompletionRequest) -> list[RequestEvent]:
        events: list[RequestEvent] = [RequestAccepted(request_id=request.request_id, seq=1,
                                                      prompt_tokens=len(request.prompt_token_ids or []),
                                                      deadline=request.deadline)]
        if request.stream:
            events += [progress(request, i + 1, [i], char, delta=char) for i, char in enumerate(text)]
        events.append(RequestFinished(request_id=request.request_id, seq=len(text) + 2, text=text,
                                      token_ids=TOKENIZER.encode(text), finish_reason=finish_reason,
                                      usage=usage(len(request.prompt_token_ids or []), len(text), len(text))))
        return events

    return script


def failure_script(reason: FailureReason, detail: str = "", after_progress: bool = False) -> Script:
    def script(request: CompletionRequest) -> list[RequestEvent]:
        events: list[RequestEvent] = [RequestAccepted(request_id=request.request_id, seq=1, prompt_tokens=4,
                                                      deadline=request.deadline)]
        if after_progress:
            events.append(progress(request, 1, [0], "4", delta="4"))
        events.append(RequestFailed(request_id=request.request_id, seq=len(events) + 1, reason=reason, detail=detail))
        return events

    return script


def heartbeat(instance_id: str = "local-0", status: WorkerStatus = WorkerStatus.READY, model: str = MODEL,
              ttl_s: float = 6.0, sent_at: float = 0.0) -> WorkerHeartbeat:
    return WorkerHeartbeat(instance_id=instance_id, node="local", tp=1, max_batch=16, model=model, status=status,
                           ttl_s=ttl_s, sent_at=sent_at)


class FakeBus:
    """A fake stand-in for ``GatewayBus``: records what the app sends, answers from a script."""

    def __init__(self, script: Script | None = None, hang: bool = False) -> None:
        self.script = script or answer_script()
        self.hang = hang  # never answer (timeouts, disconnects)
        self.submitted: list[CompletionRequest] = []
        self.headers: list[dict[str, str] | None] = []
        self.cancelled: list[tuple[str, str]] = []  # (request id, reason)
        self.followed: list[CompletionRequest] = []  # requests a retry joined
        self.records: dict[str, tuple[RequestRecord, list[StepRecord]]] = {}  # request id -> stored state
        self.state = Readiness(True, True, [heartbeat()])
        self.predictor_up = True  # False: predict raises, as with no predictor service
        self.predicted: list[PredictRequest] = []  # what the gateway asked the predictor service

    async def submit(self, request: CompletionRequest, headers: dict[str, str] | None = None):
        self.submitted.append(request)
        self.headers.append(headers)
        if self.hang:
            await asyncio.Event().wait()
        for event in self.script(request):
            yield event

    async def follow(self, request: CompletionRequest):
        """A retry joining ``request``: its scripted events again (as a later subscriber would hear them)."""
        self.followed.append(request)
        if self.hang:
            await asyncio.Event().wait()
        for event in self.script(request):
            yield event

    async def cancel(self, request_id: str, reason: str) -> None:
        self.cancelled.append((request_id, reason))

    async def load_request(self, request_id: str):
        return self.records.get(request_id)

    async def predict(self, request: PredictRequest) -> PredictReply:
        """The predictor service's one-shot estimate: 2 recompute and 6 cache steps whatever the query."""
        self.predicted.append(request)
        if not self.predictor_up:
            raise TimeoutError("no predictor")
        steps = {t: RemainingSteps(recompute_steps=2.0, cache_steps=6.0) for t in request.thresholds}
        return PredictReply(predictions=[StepPrediction(request_id=q.request_id, made_at_step=0, threshold_to_steps=steps)
                                         for q in request.queries])

    async def readiness(self) -> Readiness:
        return self.state

    def ready_workers(self):
        return [hb for hb in self.state.workers if hb.status == WorkerStatus.READY]


def client(bus: FakeBus | None = None, **overrides) -> tuple[TestClient, FakeBus]:
    bus = bus or FakeBus()
    return TestClient(create_app(settings(**overrides), bus=bus)), bus


def sse_events(body: str) -> list[tuple[str, str]]:
    """(event name, data) of every server-sent event, in order ("message" when unnamed)."""
    out = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        if all(line.startswith(":") for line in block.split("\n")):
            continue  # a comment (keep-alive)
        name, data = "message", []
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        out.append((name, "\n".join(data)))
    return out


def data_chunks(body: str) -> list[dict | str]:
    """The unnamed events' data, JSON-decoded except ``[DONE]``."""
    return [data if data == "[DONE]" else json.loads(data) for name, data in sse_events(body) if name == "message"]
