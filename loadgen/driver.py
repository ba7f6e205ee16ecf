"""Open-loop HTTP load against a DiLaServe gateway: send each request at its arrival time, whatever
the answers before it did, and record what came back.

Requests are task prompts (``shared.tasks``), so every answer is checked. The report has SLO
attainment (a request counts when it finished within its SLO), accuracy over finished requests,
latency percentiles and the thresholds the scheduler chose (``usage.thresholds``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from shared.tasks import Problem, Split, TaskGenerator, check_answer


@dataclass(frozen=True)
class PlannedRequest:
    arrival_s: float  # offset from the start of the run
    problem: Problem
    slo_ms: float
    max_tokens: int


@dataclass
class Result:
    planned: PlannedRequest
    status: int = 0  # HTTP status (0: no answer)
    latency_s: float = float("nan")
    text: str = ""
    usage: dict = field(default_factory=dict)
    error: str = ""

    @property
    def finished(self) -> bool:
        return self.status == 200

    @property
    def slo_met(self) -> bool:
        return self.finished and self.latency_s * 1000.0 <= self.planned.slo_ms

    @property
    def correct(self) -> bool:
        return self.finished and check_answer(self.planned.problem, self.text)


def poisson_plan(rate_rps: float, duration_s: float, *, slo_ms: float, max_tokens: int = 16, max_shots: int = 4,
                 seed: int = 0) -> list[PlannedRequest]:
    """Poisson arrivals at ``rate_rps`` for ``duration_s``, held-out task prompts with 0..max_shots examples."""
    if rate_rps <= 0 or duration_s <= 0:
        raise ValueError(f"rate ({rate_rps}) and duration ({duration_s}) must be positive")
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate_rps, size=int(rate_rps * duration_s * 2) + 10))
    times = times[times < duration_s]
    problems = TaskGenerator(seed=seed).problems(len(times), max_shots=max_shots, split=Split.HELD_OUT)
    return [PlannedRequest(float(t), p, slo_ms, max_tokens) for t, p in zip(times, problems, strict=True)]


async def run_plan(base_url: str, plan: list[PlannedRequest], *, model: str = "dls-tiny", cache: str = "dual",
                   timeout_s: float = 120.0, progress=None) -> list[Result]:
    """Send every planned request at its time (open loop); return the results in plan order."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def one(planned: PlannedRequest) -> Result:
            delay = planned.arrival_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            result = Result(planned)
            body = {"model": model, "prompt": planned.problem.prompt, "max_tokens": planned.max_tokens,
                    "slo_ms": planned.slo_ms, "cache": cache}
            sent = time.perf_counter()
            try:
                reply = await client.post("/v1/completions", json=body)
                result.latency_s = time.perf_counter() - sent
                result.status = reply.status_code
                data = reply.json()
                if reply.status_code == 200:
                    result.text = data["choices"][0]["text"]
                    result.usage = data.get("usage", {})
                else:
                    result.error = str(data.get("error", {}).get("message", data))[:200]
            except (httpx.HTTPError, ValueError) as exc:
                result.error = f"{type(exc).__name__}: {exc}"[:200]
            if progress is not None:
                progress(result)
            return result

        return list(await asyncio.gather(*(one(p) for p in plan)))


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
        "accuracy": sum(r.correct for r in finished) / max(len(finished), 1),
        "mean_latency_s": float(np.mean(latencies)),
        "p50_latency_s": float(np.percentile(latencies, 50)),
        "p99_latency_s": float(np.percentile(latencies, 99)),
        "mean_threshold": float(np.mean(thresholds)) if thresholds else None,
        "threshold_histogram": {str(t): thresholds.count(t) for t in sorted(set(thresholds))},
        "mean_steps": float(np.mean([r.usage.get("steps", 0) for r in finished])) if finished else None,
        "migrations": sum(r.usage.get("migrations", 0) for r in finished),
    }
