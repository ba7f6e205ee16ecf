"""The real gateway in front of the real scheduler and worker services (one process, separate NATS
connections, real nats-server and redis-server): a completion, a stream whose chunks are the
committed blocks in order ending with ``[DONE]``, and the request's per-step history."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.gateway.app import create_app
from services.gateway.bus import GatewayBus
from shared.settings import GatewaySettings
from shared.tasks import Split, TaskGenerator
from tests.integration.live import LiveCluster
from tests.unit.gateway.gateway_builders import data_chunks

pytestmark = pytest.mark.integration


def test_gateway_scheduler_and_worker_serve_completions_and_streams(nats_server, redis_server, unique_prefix):
    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix)
        await cluster.start(num_workers=1)
        settings = GatewaySettings(nats_url=nats_server.url, redis_url=redis_server.url, subject_prefix=unique_prefix,
                                   redis_key_prefix=unique_prefix, request_timeout_s=60)
        bus = GatewayBus(settings)
        await bus.start()
        assert await bus.wait_connected(10)
        transport = httpx.ASGITransport(app=create_app(settings, bus=bus))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as http:
                ready = await http.get("/readyz")
                for _ in range(100):
                    if ready.status_code == 200 and ready.json()["serving"]:  # a worker is up too
                        break
                    await asyncio.sleep(0.1)
                    ready = await http.get("/readyz")
                assert ready.status_code == 200 and ready.json()["serving"], ready.text

                plain = await http.post("/v1/completions", json={"model": "dls-tiny", "prompt": "12+30="})
                assert plain.status_code == 200, plain.text
                body = plain.json()
                assert body["choices"][0]["text"].strip() == "42" and body["usage"]["slo_met"] in (True, False)

                problem = TaskGenerator(seed=21).problems(1, max_shots=2, split=Split.HELD_OUT)[0]
                stream = await http.post("/v1/completions", json={
                    "model": "dls-tiny", "prompt": problem.prompt, "stream": True, "cache": "dual",
                    "stream_options": {"include_usage": True}})
                assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
                chunks = data_chunks(stream.text)
                assert chunks[-1] == "[DONE]"
                texts = [c["choices"][0]["text"] for c in chunks[:-1] if c["choices"] and c["choices"][0]["text"]]
                final = [c for c in chunks[:-1] if c["choices"] and c["choices"][0].get("finish_reason")][-1]
                final = {**final, "usage": chunks[-2]["usage"]}  # the usage chunk: the last before [DONE]
                assert chunks[-2]["choices"] == [] and "usage" not in chunks[-3]
                text = "".join(texts)
                assert texts and final["usage"]["steps"] >= len(texts)  # one chunk per completed block at most
                history = await http.get(f"/v1/requests/{final['id']}")
                assert history.status_code == 200
                record = history.json()
                assert record["status"] == "finished" and record["output"].strip() == text.strip()
                assert "_" not in record["canvas"]  # nothing left masked
                assert len(record["steps"]) == final["usage"]["steps"]
                assert [s["step_index"] for s in record["steps"]] == list(range(1, len(record["steps"]) + 1))
        finally:
            await bus.close()
            await cluster.close()

    asyncio.run(main())
