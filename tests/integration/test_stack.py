"""``dls up`` end to end: it starts its own NATS and Redis (nothing listens on the configured URLs),
every service and two workers, serves a completion at the URL it prints, and Ctrl-C stops every
process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from shared.runtime import free_port
from tests.chaos.cluster import descendants
from tests.integration.conftest import post_json

pytestmark = pytest.mark.integration


def test_dls_up_serves_a_completion_and_stops_cleanly(tmp_path):
    port = free_port()
    env = dict(os.environ, DLS_NATS_URL=f"nats://127.0.0.1:{free_port()}",
               DLS_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    argv = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--workers", "2",
            "--run-dir", str(tmp_path / "stack")]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        url = None
        deadline = time.monotonic() + 240
        while url is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "is serving" in line:
                url = line.rsplit(" at ", 1)[1].strip()
        assert url == f"http://127.0.0.1:{port}", "".join(lines)
        started = descendants(process.pid)
        assert len(started) >= 8  # nats, redis, 5 services, 2 workers
        status, answer = post_json(f"{url}/v1/completions", {"model": "dls-tiny", "prompt": "12+30=", "max_tokens": 16})
        assert status == 200, answer
        assert answer["choices"][0]["text"].strip() == "42"
        assert answer["usage"]["steps"] >= 1
        status, error = post_json(f"{url}/v1/completions", {"model": "dls-tiny", "prompt": "1+1=", "max_tokens": 0})
        assert status == 400 and error["error"]["param"] == "max_tokens"
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    leftover = [pid for pid in started if os.path.exists(f"/proc/{pid}") and _is_running(pid)]
    assert process.returncode == 0 and not leftover, "".join(lines)


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_reconfiguration_plan_changes_the_instances_with_no_request_lost(tmp_path):
    """Three TP-1 workers serve a stream of requests while an operator plan turns two of them into
    one TP-2 instance: every request finishes with a correct-format answer, later ones on the TP-2."""
    import asyncio

    from loadgen.driver import poisson_plan, run_plan

    port = free_port()
    env = dict(os.environ, DLS_NATS_URL=f"nats://127.0.0.1:{free_port()}",
               DLS_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0", DLS_RECONFIGURATOR_ENABLED="false")
    argv = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--workers", "3",
            "--pace", "profiles/llada-8b-h100.json", "--run-dir", str(tmp_path / "stack")]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        lines = []
        while not any("is serving" in line for line in lines):
            line = process.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)

        async def load_and_reconfigure():
            plan = poisson_plan(3.0, 16.0, slo_ms=60_000.0, seed=3)
            load = asyncio.create_task(run_plan(url, plan, timeout_s=120))
            await asyncio.sleep(3.0)
            apply = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.cli", "reconfig", "apply", "--instances-by-tp", "1:1,2:1",
                "--wait", "150", env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            out, _ = await apply.communicate()
            late = await run_plan(url, poisson_plan(2.0, 3.0, slo_ms=60_000.0, seed=4), timeout_s=120)
            return await load, apply.returncode, out.decode(), late

        results, code, out, late = asyncio.run(load_and_reconfigure())
        assert code == 0 and "APPLIED" in out, out
        assert results and all(r.status == 200 for r in results), [(r.status, r.error) for r in results if r.status != 200]
        instances = {i for r in results + late for i in r.usage["instances"]}
        assert any("-tp2-" in i for i in instances), instances  # the new TP-2 served
        assert all(r.status == 200 for r in late)
        assert all("-tp2-" in i or "-tp1-g2-" in i for r in late for i in r.usage["instances"])  # old ones gone
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(120)
