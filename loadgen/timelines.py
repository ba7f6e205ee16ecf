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


def instance_steps(timelines: Iterable[dict]) -> dict[str, list[tuple[float, float, frozenset[str], int]]]:
    """instance id -> its steps in time order: (start, end, the requests in it, the requests queued at
    the scheduler when it composed the step), merged across the requests' timelines (a batched step
    appears once per request in it)."""
    rows: dict[str, list[tuple[float, float, str, int]]] = defaultdict(list)
    for timeline in timelines:
        for step in timeline.get("steps", []):
            start = float(step["started_at"])
            rows[step["instance_id"]].append((start, start + float(step["duration_ms"]) / 1000.0, timeline["id"],
                                              int(step.get("queued", 0))))
    merged: dict[str, list[tuple[float, float, frozenset[str], int]]] = {}
    for instance, steps in rows.items():
        steps.sort()
        out: list[list] = []
        for start, end, request_id, queued in steps:
            if out and start - out[-1][0] < SAME_STEP_S:
                out[-1][2].add(request_id)
                out[-1][3] = max(out[-1][3], queued)
            else:
                out.append([start, end, {request_id}, queued])
        merged[instance] = [(s, e, frozenset(ids), q) for s, e, ids, q in out]
    return merged


def step_gaps(timelines: Iterable[dict]) -> dict:
    """Control-plane time per step (module docstring): the gaps between consecutive steps of an
    instance that share a request, in ms (mean, quantiles, how many), and the forwards' mean time."""
    gaps, forwards = [], []
    for steps in instance_steps(timelines).values():
        forwards.extend(end - start for start, end, _, _ in steps)
        for (_, end, ids, _), (start, _, next_ids, _) in zip(steps, steps[1:], strict=False):
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
    that wait's mean (the simulator's ``breakdown.queueing_s``).

    Such a request may be queued at the scheduler, or placed on an instance whose step still runs
    (it joins the next one there): at light load the other instance's steps then start without it.
    ``deep_queue`` counts only the steps the scheduler composed while requests were queued, placed
    nowhere (the step records' ``queued``): where an instance with free slots should fill them (the
    simulator's ``mean_batch_deep_queue``)."""
    timelines = list(timelines)
    waits = []  # (arrival, first step start, request id)
    for timeline in timelines:
        steps = timeline.get("steps", [])
        if steps:
            first = min(steps, key=lambda s: float(s["started_at"]))
            start = float(first["started_at"])
            waits.append((start - float(first["start_ms"]) / 1000.0, start, timeline["id"]))
    sizes, deep = [], []
    for steps in instance_steps(timelines).values():
        for start, _, ids, queued in steps:
            if any(arrived <= start < began and rid not in ids for arrived, began, rid in waits):
                sizes.append(len(ids))
            if queued:
                deep.append(len(ids))
    waited = [began - arrived for arrived, began, _ in waits]
    return {"num_steps": len(sizes), "mean_batch": round(float(np.mean(sizes)), 3) if sizes else None,
            # from arrival to the first step's start, per request (the simulator's breakdown.queueing_s)
            "mean_first_step_wait_s": round(float(np.mean(waited)), 3) if waited else None,
            "deep_queue": {"num_steps": len(deep), "mean_batch": round(float(np.mean(deep)), 3) if deep else None}}
