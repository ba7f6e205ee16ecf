"""Two ``dls up`` on one machine, attached to the same nats-server and redis-server (which neither
started): each takes subjects and keys of its own and free /metrics ports, so neither sees the other's
instances, requests or results, and both serve their own model."""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import pytest
import redis

from tests.integration.conftest import dls_up, post_json
from tests.integration.test_uncalibrated_stack import BUNDLED, _get

pytestmark = pytest.mark.integration


def _both_workers(url: str, timeout_s: float = 180.0) -> dict:
    """The stack's /v1/cluster once it lists two instances (or the last answer at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        cluster = _get(f"{url}/v1/cluster")
        if len(cluster["instances"]) >= 2 or time.monotonic() > deadline:
            return cluster
        time.sleep(0.5)


def test_two_stacks_on_one_nats_and_redis_stay_apart(tmp_path, nats_server, redis_server, monkeypatch):
    for name in ("DLS_SUBJECT_PREFIX", "DLS_REDIS_KEY_PREFIX", "DLS_METRICS_PORT"):
        monkeypatch.delenv(name, raising=False)
    other = tmp_path / "other"
    shutil.copytree(BUNDLED, other, ignore=shutil.ignore_patterns("replay", "MODEL_CARD.md"))
    shared = {"DLS_NATS_URL": nats_server.url, "DLS_REDIS_URL": redis_server.url}
    with contextlib.ExitStack() as stacks:
        first = stacks.enter_context(dls_up(tmp_path / "a", env=shared))
        second = stacks.enter_context(dls_up(tmp_path / "b", "--model", str(other), env=shared))
        for stack in (first, second):
            assert "may serve other stacks too" in stack.said, stack.said
        assert "/metrics: ports 9100-" in second.said  # the first stack holds the default range
        for stack, model in ((first, "dls-tiny"), (second, "other")):
            for _ in range(4):
                status, answer = post_json(f"{stack.url}/v1/completions",
                                           {"model": model, "prompt": "12+30=", "max_tokens": 16})
                assert status == 200 and answer["choices"][0]["text"].strip() == "42", answer
            cluster = _both_workers(stack.url)  # "serving" means one worker is up; the second may still load
            assert {i["model"] for i in cluster["instances"]} == {model}  # its own two workers alone
            assert len(cluster["instances"]) == 2, cluster
    store = redis.Redis.from_url(redis_server.url)
    for stack in (first, second):  # each stack's requests under its own prefix, dls<gateway port>
        assert store.keys(f"dls{stack.url.rsplit(':', 1)[1]}:*"), stack.url
    for run in ("a", "b"):
        scheduler = (tmp_path / run / "logs" / "scheduler.log").read_text()
        assert "not the step in flight" not in scheduler  # no results of the other stack's steps
        assert scheduler.count("joined") == 2, scheduler  # its own two instances, not the other's
    assert Path(tmp_path / "b" / "logs").exists()
