"""Open-loop HTTP load against a DiLaServe gateway: send each request at its arrival time, whatever
the answers before it did, and record what came back.

Requests are task prompts (``shared.tasks``), so every answer is checked; a request may instead carry
a free-text prompt (ShareGPT-style), which has no reference answer. ``run_plan`` sends a plan (plain
JSON answers, or ``stream=True`` for server-sent events, which times the first committed block as
TTFT), optionally capped at ``max_concurrency`` requests in flight, to ``/v1/completions`` or, with
``endpoint="chat"``, ``/v1/chat/completions`` (the prompt as one user message, which the served
model's chat template turns into the same prompt). Streams ask for the usage chunk
(``stream_options.include_usage``). ``summarize`` is the short report ``bench/live_overload.py``
prints; ``loadgen.report`` has the full one in vLLM's metric names.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from shared.tasks import Family, Problem, Split, TaskGenerator, check_answer

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}  # --endpoint -> path


@dataclass(frozen=True)
class PlannedRequest:
    arrival_s: float  # offset from the start of the run
    problem: Problem | None  # a task problem (its answer is checked), or None with ``text``
    slo_ms: float | None  # None: the gateway's default SLO (read back from the answer's usage)
    max_tokens: int
    text: str = ""  # a free-text prompt when ``problem`` is None (ShareGPT-style)
    block_length: int | None = None  # None: the gateway's default
    priority: int = 0
    min_threshold: float | None = None  # a quality floor (None: not sent)
    slo_class: str = "standard"

    @property
    def prompt(self) -> str:
        return self.problem.prompt if self.problem is not None else self.text

    def body(self, model: str, cache: str | None, stream: bool, endpoint: str = "completions") -> dict:
        """The ``/v1/completions`` body (``endpoint="chat"``: the ``/v1/chat/completions`` one)."""
        if endpoint == "chat":
            body = {"model": model, "messages": [{"role": "user", "content": self.prompt}],
                    "max_completion_tokens": self.max_tokens}
        else:
            body = {"model": model, "prompt": self.prompt, "max_tokens": self.max_tokens}
        optional = {"slo_ms": self.slo_ms, "cache": cache, "block_length": self.block_length,
                    "min_threshold": self.min_threshold, "priority": self.priority or None}
        body.update({k: v for k, v in optional.items() if v is not None})
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body


@dataclass
class Result:
    planned: PlannedRequest
    status: int = 0  # HTTP status (0: no answer)
    latency_s: float = float("nan")  # send to the whole answer (E2E)
    text: str = ""
    usage: dict = field(default_factory=dict)
    error: str = ""
    request_id: str = ""
    sent_s: float = float("nan")  # when it was sent, from the start of the run
    ttft_s: float = float("nan")  # streaming: send to the first chunk with text (the first committed block)
    chunk_times_s: list[float] = field(default_factory=list)  # streaming: send to each chunk with text

    @property
    def finished(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def slo_ms(self) -> float | None:
        return self.planned.slo_ms if self.planned.slo_ms is not None else self.usage.get("slo_ms")

    @property
    def slo_met(self) -> bool:
        slo = self.slo_ms
        return self.finished and slo is not None and self.latency_s * 1000.0 <= slo

    @property
    def checkable(self) -> bool:
        return self.planned.problem is not None

    @property
    def correct(self) -> bool:
        return self.finished and self.checkable and check_answer(self.planned.problem, self.text)


def poisson_plan(rate_rps: float, duration_s: float, *, slo_ms: float | None, max_tokens: int = 16,
                 max_shots: int = 4, seed: int = 0, family: Family | None = None,
                 block_length: int | None = None) -> list[PlannedRequest]:
    """Poisson arrivals at ``rate_rps`` for ``duration_s``, held-out task prompts with 0..max_shots examples
    (of ``family`` only, or the short families' mix)."""
    if rate_rps <= 0 or duration_s <= 0:
        raise ValueError(f"rate ({rate_rps}) and duration ({duration_s}) must be positive")
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate_rps, size=int(rate_rps * duration_s * 2) + 10))
    times = times[times < duration_s]
    tasks = TaskGenerator(seed=seed, family_weights={family: 1.0} if family else None)
    problems = tasks.problems(len(times), max_shots=max_shots, split=Split.HELD_OUT)
    return [PlannedRequest(float(t), p, slo_ms, max_tokens, block_length=block_length)
            for t, p in zip(times, problems, strict=True)]


async def run_plan(base_url: str, plan: list[PlannedRequest], *, model: str = "dls-tiny", cache: str | None = "dual",
                   timeout_s: float = 120.0, progress=None, stream: bool = False, max_concurrency: int | None = None,
                   api_key: str | None = None, endpoint: str = "completions") -> list[Result]:
    """Send every planned request at its time (open loop); return the results in plan order.

    ``max_concurrency``: a request due while that many are in flight waits for one to finish (its
    latency counts from when it is sent). ``progress(result)`` is called as each one ends.
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits, headers=headers) as client:
        start = time.perf_counter()

        async def one(planned: PlannedRequest) -> Result:
            delay = planned.arrival_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is not None:
                await slots.acquire()
            try:
                result = Result(planned)
                result.sent_s = time.perf_counter() - start
                send = _send_stream if stream else _send_plain
                try:
                    await send(client, planned.body(model, cache, stream, endpoint), result, endpoint)
                except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                    result.error = f"{type(exc).__name__}: {exc}"[:200]
            finally:
                if slots is not None:
                    slots.release()
            if progress is not None:
                progress(result)
            return result

        return list(await asyncio.gather(*(one(p) for p in plan)))


def _text(choice: dict) -> str:
    """A choice's text: completions' ``text``, chat's ``message.content`` or a chunk's ``delta.content``."""
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("message") or choice.get("delta") or {}).get("content") or ""


async def _send_plain(client: httpx.AsyncClient, body: dict, result: Result, endpoint: str = "completions") -> None:
    sent = time.perf_counter()
    reply = await client.post(ENDPOINTS[endpoint], json=body)
    result.latency_s = time.perf_counter() - sent
    result.status = reply.status_code
    result.request_id = reply.headers.get("x-request-id", "")
    data = reply.json()
    if reply.status_code == 200:
        result.text = _text(data["choices"][0])
        result.usage = data.get("usage") or {}
        result.request_id = data.get("id", result.request_id)
    else:
        result.error = str(data.get("error", {}).get("message", data))[:200]


async def _send_stream(client: httpx.AsyncClient, body: dict, result: Result, endpoint: str = "completions") -> None:
    """Server-sent events: TTFT at the first chunk with text, E2E at ``[DONE]``."""
    sent = time.perf_counter()
    async with client.stream("POST", ENDPOINTS[endpoint], json=body) as reply:
        result.status = reply.status_code
        result.request_id = reply.headers.get("x-request-id", "")
        if reply.status_code != 200:
            data = json.loads(await reply.aread())
            result.latency_s = time.perf_counter() - sent
            result.error = str(data.get("error", {}).get("message", data))[:200]
            return
        texts = []
        async for line in reply.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, "event: progress" lines (their data is a dict without choices)
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                result.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                continue
            if "choices" not in chunk:
                continue  # a progress line's data
            text = _text(chunk["choices"][0]) if chunk["choices"] else ""  # the usage chunk has none
            if text:
                now = time.perf_counter() - sent
                if not texts:
                    result.ttft_s = now
                result.chunk_times_s.append(now)
                texts.append(text)
            if chunk.get("usage"):
                result.usage = chunk["usage"]
        result.latency_s = time.perf_counter() - sent
        result.text = "".join(texts)
        if not result.usage and not result.error:
            result.error = "the stream ended without its usage chunk"


def summarize(results: list[Result], duration_s: float) -> dict:
    finished = [r for r in results if r.finished]
    latencies = np.array([r.latency_s for r in finished]) if finished else np.array([np.nan])
    thresholds = [t for r in finished for t in r.usage.get("thresholds", [])]
    return {
        "num_requests": len(results),
        "num_finished": len(finished),
        "num_errors": len(results) - len(finished),
        "error_statuses": sorted({r.status for r in results if not r.finished}),
        "request_rate_rps": len(results) / duration_s,
        "throughput_rps": len(finished) / duration_s,
        "slo_attainment": sum(r.slo_met for r in results) / max(len(results), 1),
        "goodput_rps": sum(r.slo_met for r in results) / duration_s,
        "accuracy": sum(r.correct for r in finished) / max(sum(r.checkable for r in finished), 1),
        "mean_latency_s": float(np.mean(latencies)),
        "p50_latency_s": float(np.percentile(latencies, 50)),
        "p99_latency_s": float(np.percentile(latencies, 99)),
        "mean_threshold": float(np.mean(thresholds)) if thresholds else None,
        "threshold_histogram": {str(t): thresholds.count(t) for t in sorted(set(thresholds))},
        "mean_steps": float(np.mean([r.usage.get("steps", 0) for r in finished])) if finished else None,
        "migrations": sum(r.usage.get("migrations", 0) for r in finished),
    }
