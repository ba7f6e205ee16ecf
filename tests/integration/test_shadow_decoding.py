"""Shadow decoding on the live stack: with every lowered answer sampled (DLS_SCHEDULER_SHADOW_RATE=1, no
step budget), a burst that makes DiLaServe lower thresholds gets answers decoded again at the highest
threshold, at the lowest priority; the scheduler counts their steps apart and reports the agreement per
threshold, and no client sees them."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.runtime import free_port
from tests.integration.conftest import dls_up
from tests.integration.test_uncalibrated_stack import overload

pytestmark = pytest.mark.integration


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = ",".join(v for _, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{label}}}" if label else sample.name] = sample.value
    return values


def test_lowered_answers_are_decoded_again_at_the_highest_threshold(tmp_path):
    metrics = free_port()
    env = {"DLS_SCHEDULER_SHADOW_RATE": "1", "DLS_SCHEDULER_SHADOW_STEP_BUDGET": "1", "DLS_METRICS_PORT": str(metrics)}
    with dls_up(tmp_path / "stack", env=env) as stack:
        replies = overload(stack.url, "dls-tiny")
        served = [answer for status, answer in replies if status == 200]
        lowered = [a for a in served if min(a["usage"]["thresholds"]) < 0.9]
        assert lowered, "no answer was served below the highest threshold: nothing to watch"
        assert all(not a["id"].startswith("shadow-") for a in served)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the shadows wait for free slots: the burst is over now
            values = _metrics(metrics)  # the scheduler's /metrics: dls up's base port
            if sum(v for k, v in values.items() if k.startswith("dls_scheduler_shadow_decodings_total")) >= 1:
                break
            time.sleep(1.0)
        judged = {k: v for k, v in values.items() if k.startswith("dls_scheduler_shadow_decodings_total")}
        assert judged and sum(judged.values()) >= 1, values
        assert values["dls_scheduler_shadow_steps_total"] >= 1
        assert values["dls_scheduler_shadow_steps_total"] < values["dls_scheduler_request_steps_total"]
        agreement = [v for k, v in values.items() if k.startswith("dls_scheduler_shadow_agreement")]
        assert agreement and all(0.0 <= a <= 1.0 for a in agreement)
