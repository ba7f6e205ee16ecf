"""Locust users for a DiLaServe gateway, for people who drive load with Locust (not a dependency of
DiLaServe: ``pip install locust`` first).

    locust -f loadgen/locustfile.py --host http://127.0.0.1:8000 --users 20 --spawn-rate 5 --headless -t 2m

Each user sends streamed task prompts (``shared.tasks``, so answers are checked) and reports, besides
Locust's own request statistics, three custom entries: ``TTFT`` (the first committed block), ``E2E``
(the whole answer) and ``SLO`` (a failure when the answer came later than its SLO or was wrong).
Settings from the environment: ``DLS_API_KEY`` (Bearer key), ``DLS_MODEL`` (default dls-tiny),
``DLS_SLO_MS`` (default: the gateway's SLO), ``DLS_MAX_TOKENS`` (16), ``DLS_CACHE`` (the gateway's
default), ``DLS_WAIT_S`` (pause between a user's requests, default 0.5; Locust is closed-loop; use
``dls loadgen`` for open-loop arrivals at a set rate).
"""

from __future__ import annotations

import json
import os
import time

from locust import HttpUser, task

from shared.tasks import Split, TaskGenerator, check_answer

API_KEY = os.environ.get("DLS_API_KEY")
MODEL = os.environ.get("DLS_MODEL", "dls-tiny")
SLO_MS = float(os.environ["DLS_SLO_MS"]) if os.environ.get("DLS_SLO_MS") else None
MAX_TOKENS = int(os.environ.get("DLS_MAX_TOKENS", "16"))
CACHE = os.environ.get("DLS_CACHE")
WAIT_S = float(os.environ.get("DLS_WAIT_S", "0.5"))


class DiLaServeUser(HttpUser):
    def wait_time(self) -> float:
        return WAIT_S

    def on_start(self) -> None:
        self.tasks_gen = TaskGenerator(seed=hash(id(self)) % 2**31)
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"

    def _report(self, name: str, seconds: float, exception: Exception | None = None) -> None:
        self.environment.events.request.fire(request_type="DLS", name=name, response_time=seconds * 1000.0,
                                             response_length=0, exception=exception, context={})

    @task
    def completion(self) -> None:
        problem = self.tasks_gen.problem(5, Split.HELD_OUT)
        body = {"model": MODEL, "prompt": problem.prompt, "max_tokens": MAX_TOKENS, "stream": True,
                "stream_options": {"include_usage": True}}
        if SLO_MS:
            body["slo_ms"] = SLO_MS
        if CACHE:
            body["cache"] = CACHE
        start = time.perf_counter()
        ttft = None
        text, usage = [], {}
        with self.client.post("/v1/completions", json=body, stream=True, catch_response=True,
                              name="/v1/completions") as reply:
            if reply.status_code != 200:
                reply.failure(f"HTTP {reply.status_code}: {reply.text[:200]}")
                return
            for raw in reply.iter_lines():
                line = raw.decode() if isinstance(raw, bytes) else raw
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    reply.failure(chunk["error"].get("message", "error"))
                    return
                piece = (chunk.get("choices") or [{}])[0].get("text") or ""
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(piece)
                usage = chunk.get("usage") or usage
            reply.success()
        e2e = time.perf_counter() - start
        if ttft is not None:
            self._report("TTFT", ttft)
        self._report("E2E", e2e)
        slo_ms = SLO_MS or usage.get("slo_ms")
        problem_ok = check_answer(problem, "".join(text))
        late = slo_ms is not None and e2e * 1000.0 > slo_ms
        failure = None if problem_ok and not late else AssertionError(
            ("late" if late else "") + (" and " if late and not problem_ok else "") + ("wrong" if not problem_ok else ""))
        self._report("SLO", e2e, failure)
