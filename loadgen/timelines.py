"""What a live step costs besides its forward, from the requests' stored timelines.

``GET /v1/requests/{id}/timeline`` lists every step of a request: the instance, when the forward
started (worker clock) and how long it took (``duration_ms``: the forward, paced where the workers
are paced). Between two steps of an instance, nothing computes: the worker writes the states and
publishes the events and results, and the next step waits for its command (the scheduling pass and
two NATS hops) unless it was sent ahead (pipelining). That is the live stack's *control-plane time*
per step, which the simulator leaves out unless told (``dls sim --control-plane-ms``).

``step_gaps`` measures it where the instance had work waiting: the gap from the end of an instance's
step to the start of its next one, over the pairs of consecutive steps that share a request (it was
ready the moment the first ended, so the gap is not idle time). ``dls loadgen --timelines`` fetches
the timelines of the requests it sent and reports the figures under ``control_plane``.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable, Sequence

import httpx
import numpy as np

# two steps of one instance whose recorded starts lie closer than this are the same batched step
SAME_STEP_S = 1e-4


async def fetch_timelines(base_url: str, request_ids: Sequence[str], *, api_key: str | None = None,
                          concurrency: int = 16, timeout_s: float = 30.0) -> list[dict]:
    """The timelines of ``request_ids`` (those the gateway no longer has are left out)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    slots = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, headers=headers) as client:
        async def one(request_id: str) -> dict | None:
            async with slots:
                reply = await client.get(f"/v1/requests/{request_id}/timeline")
            return reply.json() if reply.status_code == 200 else None

        found = await asyncio.gather(*(one(rid) for rid in request_ids))
    return [t for t in found if t is not None]


def instance_steps(timelines: Iterable[dict]) -> dict[str, list[tuple[float, float, frozenset[str]]]]:
    """instance id -> its steps in time order: (start, end, the requests in it), merged across the
    requests' timelines (a batched step appears once per request in it)."""
    rows: dict[str, list[tuple[float, float, str]]] = defaultdict(list)  # instance -> (start, end, request)
    for timeline in timelines:
        for step in timeline.get("steps", []):
            start = float(step["started_at"])
            rows[step["instance_id"]].append((start, start + float(step["duration_ms"]) / 1000.0, timeline["id"]))
    merged: dict[str, list[tuple[float, float, frozenset[str]]]] = {}
    for instance, steps in rows.items():
        steps.sort()
        out: list[tuple[float, float, set[str]]] = []
        for start, end, request_id in steps:
            if out and start - out[-1][0] < SAME_STEP_S:
                out[-1][2].add(request_id)
            else:
                out.append((start, end, {request_id}))
        merged[instance] = [(s, e, frozenset(ids)) for s, e, ids in out]
    return merged


def step_gaps(timelines: Iterable[dict]) -> dict:
    """Control-plane time per step (module docstring): the gaps between consecutive steps of an
    instance that share a request, in ms (mean, quantiles, how many), and the forwards' mean time."""
    gaps, forwards = [], []
    for steps in instance_steps(timelines).values():
        forwards.extend(end - start for start, end, _ in steps)
        for (_, end, ids), (start, _, next_ids) in zip(steps, steps[1:], strict=False):
            if ids & next_ids:
                gaps.append(max(0.0, start - end))
    if not gaps:
        return {"num_gaps": 0, "mean_ms": None, "p50_ms": None, "p90_ms": None, "p99_ms": None,
                "mean_forward_ms": round(1000.0 * float(np.mean(forwards)), 3) if forwards else None}
    ms = 1000.0 * np.asarray(gaps)
    return {
        "num_gaps": len(gaps),
        "mean_ms": round(float(ms.mean()), 3),
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p90_ms": round(float(np.percentile(ms, 90)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "mean_forward_ms": round(1000.0 * float(np.mean(forwards)), 3),
    }


def batch_when_queued(timelines: Iterable[dict]) -> dict:
    """The requests per batched step among the steps that started while some request waited for its
    first step (and was not in that step): the live side of the simulator's ``mean_batch_when_queued``
    (``sim/simulator.py`` counts the same steps). A request waits from its arrival (the timeline's
    origin: ``started_at - start_ms``) until its first step starts; ``mean_first_step_wait_s`` is
    that wait's mean (the simulator's ``breakdown.queueing_s``)."""
    timelines = list(timelines)
    waits = []  # (arrival, first step start, request id)
    for timeline in timelines:
        steps = timeline.get("steps", [])
        if steps:
            first = min(steps, key=lambda s: float(s["started_at"]))
            start = float(first["started_at"])
            waits.append((start - float(first["start_ms"]) / 1000.0, start, timeline["id"]))
    sizes = []
    for steps in instance_steps(timelines).values():
        for start, _, ids in steps:
            if any(arrived <= start < began and rid not in ids for arrived, began, rid in waits):
                sizes.append(len(ids))
    waited = [began - arrived for arrived, began, _ in waits]
    return {"num_steps": len(sizes), "mean_batch": round(float(np.mean(sizes)), 3) if sizes else None,
            # from arrival to the first step's start, per request (the simulator's breakdown.queueing_s)
            "mean_first_step_wait_s": round(float(np.mean(waited)), 3) if waited else None}
