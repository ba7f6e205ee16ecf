"""A served in-process stack for integration tests that talk HTTP: the real scheduler and workers
(``LiveCluster``) and the real gateway app behind uvicorn on a free port, all on one event loop in a
background thread, so a test can drive it from outside (httpx, ``dls loadgen``, a browser)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from services.gateway.app import create_app
from services.gateway.bus import GatewayBus
from shared.runtime import free_port
from shared.settings import GatewaySettings
from tests.integration.live import LiveCluster

START_TIMEOUT_S = 120.0


@contextmanager
def served_stack(nats_url: str, redis_url: str, prefix: str, num_workers: int = 2,
                 **worker_overrides) -> Iterator[str]:
    """Yields the gateway's base URL once ``/readyz`` answers 200; stops everything on exit."""
    port = free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop = asyncio.Event()
    failure: list[BaseException] = []

    async def main() -> None:
        cluster = LiveCluster(nats_url, redis_url, prefix)
        bus = None
        try:
            await cluster.start(num_workers=num_workers, **worker_overrides)
            settings = GatewaySettings(nats_url=nats_url, redis_url=redis_url, subject_prefix=prefix,
                                       redis_key_prefix=prefix, request_timeout_s=120)
            bus = GatewayBus(settings)
            await bus.start()
            server = uvicorn.Server(uvicorn.Config(create_app(settings, bus=bus), host="127.0.0.1", port=port,
                                                   log_level="warning", lifespan="on"))
            serving = asyncio.create_task(server.serve())
            started.set()
            await stop.wait()
            server.should_exit = True
            await serving
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            failure.append(exc)
            started.set()
        finally:
            if bus is not None:
                await bus.close()
            await cluster.close()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), name="served-stack", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        started.wait(START_TIMEOUT_S)
        if failure:
            raise RuntimeError(f"the stack did not start: {failure[0]!r}") from failure[0]
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=2) as reply:
                    if reply.status == 200 and json.loads(reply.read())["serving"]:  # a worker is up too
                        break
            except OSError:
                pass
            if failure or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway at {url} was not ready: {failure[:1]}")
            time.sleep(0.2)
        yield url
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
