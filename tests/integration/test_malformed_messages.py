"""Garbage on every subject of a running stack (real nats-server, redis-server and service processes):
no service crashes, and the stack still serves a completion afterwards."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from shared.subjects import Subjects
from tests.chaos.cluster import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

GARBAGE = [b"", b"\x00", b"not msgpack at all", b"\x81\xa7message\xa7Nothing", b"\xc1" * 64,
           b"\x85" + b"\xa1x" * 3, b"\xff" * 2048]


async def _publish_garbage(nats_url: str, instance_ids: list[str]) -> int:
    import nats

    s = Subjects()
    subjects = [*(s.step(iid) for iid in instance_ids), s.results, s.heartbeat, s.cancel, s.stats, s.plans, s.plans_ack,
                s.events("cmpl-garbage"), s.intake]
    nc = await nats.connect(nats_url)
    sent = 0
    try:
        for subject in subjects:
            for data in GARBAGE:
                await nc.publish(subject, data)
                sent += 1
        for data in GARBAGE:  # request/reply subjects: an answer or a timeout, never a crash
            for subject in (s.predict, s.reconfig_apply):
                try:
                    await nc.request(subject, data, timeout=1.0)
                except Exception:  # noqa: BLE001 (no reply to garbage is fine)
                    pass
                sent += 1
        await nc.flush()
    finally:
        await nc.close()
    return sent


def _complete(url: str) -> dict:
    body = json.dumps({"model": "dls-tiny", "prompt": "12+30=", "max_tokens": 16}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def test_garbage_on_every_subject_crashes_nothing(tmp_path):
    cluster = Cluster(tmp_path / "stack", workers=1, pace_scale=1.0, nats_nodes=1, reconfigurator=True)
    try:
        cluster.start()
        worker_pids = cluster.worker_pids()
        with urllib.request.urlopen(f"{cluster.url}/readyz", timeout=5) as reply:
            instance_ids = [w["instance_id"] for w in json.loads(reply.read())["workers"]]
        assert instance_ids
        sent = asyncio.run(_publish_garbage(cluster.nats_urls[0], instance_ids))
        assert sent > 50
        answer = _complete(cluster.url)
        assert answer["choices"][0]["text"].strip() == "42"
        for name in cluster.services:
            assert cluster.alive(name), f"{name} exited after garbage"
        assert cluster.worker_pids() == worker_pids  # no worker crashed and was restarted
    finally:
        cluster.stop()
