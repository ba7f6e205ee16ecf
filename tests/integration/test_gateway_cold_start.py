"""Scale from zero through the real gateway (HTTP, ``GatewayBus``), scheduler and workers, against real
nats-server and redis-server. The gateway serves two models; the workers run a FAKE zero-compute engine
under each model's name. With no worker at all a request is a 503 at once; with a worker of the first
model READY, a request for the second (scaled to zero) is admitted and queued at the scheduler, and is
answered once a worker of its model joins (the test starts it, standing in for the reconfigurator and
the node agent), its wait reported in ``X-DLS-Cold-Start-Ms``."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest
import uvicorn

from services.gateway.app import COLD_START_HEADER, create_app
from services.gateway.bus import GatewayBus
from services.worker.engine.fake import ZeroComputeEngine
from shared.runtime import free_port
from shared.settings import GatewaySettings
from tests.integration.live import LiveCluster

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "models" / "dls-tiny"
TWIN = "tiny-twin"


def engine_of(model: str) -> ZeroComputeEngine:
    """FAKE: a zero-compute engine whose heartbeats name ``model``."""
    engine = ZeroComputeEngine(tokens_per_step=8)
    engine.name = model
    return engine


async def _run(nats_url: str, redis_url: str, prefix: str, twin_dir: Path) -> None:
    cluster = LiveCluster(nats_url, redis_url, prefix, policy="fixed")
    await cluster.start(num_workers=0)
    settings = GatewaySettings(**cluster.common, model_dirs=f"{BUNDLED},{twin_dir}", request_timeout_s=120,
                               cold_start_timeout_s=120)
    bus = GatewayBus(settings)
    await bus.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings, bus=bus), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    serving = asyncio.create_task(server.serve())
    body = {"model": TWIN, "prompt": "@b=", "max_tokens": 16}
    try:
        await cluster.wait_for(lambda: bus.ready_workers() is not None, timeout_s=60, what="the gateway's grace")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            refused = await http.post("/v1/completions", json=body)  # no worker at all: 503 at once
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_instance", refused.text
            assert TWIN in refused.json()["error"]["message"] and refused.headers["Retry-After"]

            await cluster.add_worker(engine=engine_of(BUNDLED.name))
            await cluster.wait_for(lambda: bool(bus.ready_workers()), what="the first model's worker at the gateway")
            waiting = asyncio.create_task(http.post("/v1/completions", json=body))
            await cluster.wait_for(lambda: bool(cluster.scheduler.view.requests), what="the request queued")
            await asyncio.sleep(0.5)
            assert not waiting.done()  # admitted, and waiting for an instance of its model

            await cluster.add_worker(engine=engine_of(TWIN))
            answer = await waiting
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == TWIN and answer.json()["usage"]["completion_tokens"] > 0
            assert int(answer.headers[COLD_START_HEADER]) >= 500  # it waited at least the pause above
            record = (await http.get(f"/v1/requests/{answer.headers['X-Request-Id']}")).json()
            assert record["status"] == "finished"

            again = await http.post("/v1/completions", json=body)  # served now: no cold start
            assert again.status_code == 200 and COLD_START_HEADER not in again.headers
            metrics = (await http.get("/metrics")).text
            assert f'dls_gateway_cold_start_seconds_count{{model_name="{TWIN}",outcome="served"}} 1.0' in metrics
    finally:
        server.should_exit = True
        await serving
        await bus.close()
        await cluster.close()


def test_a_request_for_a_model_at_zero_is_answered_once_its_first_worker_joins(nats_server, redis_server,
                                                                              unique_prefix, tmp_path):
    twin_dir = tmp_path / TWIN
    shutil.copytree(BUNDLED, twin_dir, ignore=shutil.ignore_patterns("replay", "MODEL_CARD.md"))
    asyncio.run(_run(nats_server.url, redis_server.url, unique_prefix, twin_dir))
