"""The chaos scenarios' clients: streamed completions that survive the gateway going away.

A ``Tracked`` request is sent with ``stream: true``: the answer's headers (``X-Request-Id``) arrive with
its first progress event, so from then on the client knows the id. It reads the stream to ``[DONE]``;
if the stream breaks (gateway killed), it polls ``GET /v1/requests/{id}`` (on whichever gateway answers)
until the request is terminal. Before an id is known, a refused connection is retried on the next
gateway (nothing was accepted yet), a 503 after its ``Retry-After``; a 429 (a 503) is counted as
refused when ``retry_429`` (``retry_503``) is false and retried otherwise. Every 429/503 answer is
kept with its ``Retry-After`` (``refusals``).

``check_no_duplicates`` reads a finished request's step records: no canvas position committed by two
steps, step indices 1..num_steps each exactly once (a step run twice would show as a repeat).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

PROMPTS = ["12+30=", "7*6=", "100-58=", "21+21=", "9+33=", "50-8=", "6*7=", "40+2="]
TERMINAL = {"finished", "rejected", "cancelled"}


@dataclass
class Tracked:
    """One logical request of a scenario, and what became of it."""

    index: int
    request_id: str | None = None
    outcome: str = "pending"  # completed, refused (429), failed (an error answer), lost (never terminal)
    text: str = ""
    attempts: int = 0
    retry_after: list[str] = field(default_factory=list)  # Retry-After of every 429 it got
    stream_broke: bool = False  # the stream ended without [DONE] (gateway gone): answered by polling
    detail: str = ""
    status: str = ""  # the stored status once polled
    ids_seen: list[str] = field(default_factory=list)  # every request id the gateway gave it
    retry_429: bool = True  # send again after a 429's Retry-After (False: count it as refused)
    retry_503: bool = True  # send again after a 503's Retry-After (False: count it as refused)
    refusals: list[tuple[int, str, str]] = field(default_factory=list)  # (status, Retry-After, error code) of each 429/503
    sent_at: float = 0.0  # time.monotonic() of the first attempt
    done_at: float = 0.0  # time.monotonic() it became terminal (completed, refused, failed)


def body(index: int, max_tokens: int = 16) -> dict:
    return {"model": "dls-tiny", "prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": max_tokens,
            "stream": True, "slo_ms": 600_000}


async def run_request(base_url: str | list[str], tracked: Tracked, deadline: float,
                      got_id: asyncio.Event | None = None) -> Tracked:
    """Send ``tracked`` and follow it until terminal (or ``deadline``, a ``time.monotonic()``)."""
    urls = [base_url] if isinstance(base_url, str) else base_url
    tracked.sent_at = tracked.sent_at or time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=120.0)) as client:
        await _follow(client, urls, tracked, deadline, got_id)
    tracked.done_at = time.monotonic()
    return tracked


async def _follow(client: httpx.AsyncClient, urls: list[str], tracked: Tracked, deadline: float,
                  got_id: asyncio.Event | None) -> None:
    while tracked.request_id is None and time.monotonic() < deadline:
        tracked.attempts += 1
        url = urls[(tracked.attempts - 1) % len(urls)]  # a refused connection: the next gateway
        try:
            done = await _stream(client, url, tracked, got_id)
        except (httpx.TransportError, httpx.StreamError) as exc:
            if tracked.request_id is None:  # refused before anything was accepted: send again
                await asyncio.sleep(1.0)
                continue
            tracked.stream_broke, tracked.detail = True, f"{type(exc).__name__}: {exc}"
            break
        if done == "retry":
            continue
        if done in ("refused", "failed"):
            tracked.outcome = done
            return
        if done == "completed":
            tracked.outcome = "completed"
            return
        tracked.stream_broke = True  # the stream ended without [DONE]
        break
    if tracked.request_id is None:
        tracked.outcome = "lost" if tracked.attempts else "pending"
        tracked.detail = tracked.detail or "never got an id before the deadline"
        return
    await _poll(client, urls, tracked, deadline)


async def _stream(client: httpx.AsyncClient, url: str, tracked: Tracked, got_id: asyncio.Event | None) -> str:
    async with client.stream("POST", f"{url}/v1/completions", json=body(tracked.index)) as reply:
        if reply.status_code in (429, 503):
            retry = reply.headers.get("retry-after", "")
            tracked.refusals.append((reply.status_code, retry, _error_code(await reply.aread())))
            if reply.status_code == 429:
                tracked.retry_after.append(retry)
            if not (tracked.retry_429 if reply.status_code == 429 else tracked.retry_503):
                return "refused"
            await asyncio.sleep(float(retry or 1))
            return "retry"
        if reply.status_code != 200:
            tracked.detail = f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}"
            return "failed"
        tracked.request_id = reply.headers["x-request-id"]
        tracked.ids_seen.append(tracked.request_id)
        if got_id is not None:
            got_id.set()
        text = ""
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                tracked.text = text
                return "completed"
            chunk = json.loads(data)
            if "error" in chunk:
                tracked.detail = json.dumps(chunk["error"])[:300]
                return "failed"
            text += chunk["choices"][0].get("text") or ""
    return "broken"


def _error_code(body: bytes) -> str:
    """The ``error.code`` of an OpenAI-shaped error body ("" when it is not one)."""
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return ""


async def _poll(client: httpx.AsyncClient, urls: list[str], tracked: Tracked, deadline: float) -> None:
    i = 0
    while time.monotonic() < deadline:
        url = urls[i % len(urls)]
        i += 1
        try:
            reply = await client.get(f"{url}/v1/requests/{tracked.request_id}", timeout=10)
        except httpx.TransportError:
            await asyncio.sleep(1.0)
            continue
        if reply.status_code == 200:
            info = reply.json()
            tracked.status = info["status"]
            if info["status"] == "finished":
                tracked.outcome, tracked.text = "completed", info.get("output") or ""
                return
            if info["status"] in TERMINAL:
                tracked.outcome, tracked.detail = "failed", f"{info['status']}: {info.get('detail')}"
                return
        await asyncio.sleep(1.0)
    tracked.outcome = "lost"
    tracked.detail = tracked.detail or f"not terminal by the deadline (last status {tracked.status or '?'})"


async def check_no_duplicates(url: str, request_id: str) -> str:
    """"" when the stored request has no duplicated step or token; else what is wrong."""
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(30):
            try:
                reply = await client.get(f"{url}/v1/requests/{request_id}")
                break
            except httpx.TransportError:
                await asyncio.sleep(1.0)
        else:
            return "gateway unreachable"
    if reply.status_code != 200:
        return f"GET /v1/requests/{request_id}: HTTP {reply.status_code}"
    info = reply.json()
    steps = info.get("steps", [])
    indices = [s["step_index"] for s in steps]
    if sorted(indices) != list(range(1, info["num_steps"] + 1)):
        return f"step indices {sorted(indices)} for {info['num_steps']} steps"
    positions = [p for s in steps for p in s["committed_positions"]]
    if len(positions) != len(set(positions)):
        return "a canvas position was committed by more than one step"
    if any(not 0 <= p < info["gen_length"] for p in positions):
        return "a step committed a position outside the canvas"
    return ""
