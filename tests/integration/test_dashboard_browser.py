"""The dashboard and a request's timeline in real headless Chromium, served by the real gateway in
front of the real scheduler and two workers: the DOM after the pages' scripts ran shows the live
instances and the finished request's steps.

Chromium is Debian's ``chromium`` package; the fixture installs it with apt-get when it is missing
and the tests run as root, and skips (saying why) only when no binary can be had. Screenshots for
the docs are written only on request:

    DLS_UPDATE_SCREENSHOTS=1 python -m pytest -q tests/integration/test_dashboard_browser.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from html import unescape
from pathlib import Path

import httpx
import pytest

from shared.tasks import Split, TaskGenerator
from tests.integration.served import served_stack

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO / "docs" / "screenshots"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
BROWSER_TIMEOUT_S = 120


def _find_browser() -> str | None:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def chromium() -> str:
    found = _find_browser()
    if found is None and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        install = subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True)
        if install.returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True)
            subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True)
        found = _find_browser()
    if found is None:
        pytest.skip("no Chromium binary (tried: " + ", ".join(BROWSERS) + "); install Debian's `chromium` "
                    "(apt-get install chromium, as root) to run the browser test")
    return found


def _browser_argv(binary: str, *extra: str) -> list[str]:
    return [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--hide-scrollbars", "--virtual-time-budget=8000", "--window-size=1400,1000", *extra]


def dump_dom(binary: str, url: str) -> str:
    """The page's DOM after its scripts ran (Chromium's --dump-dom)."""
    done = subprocess.run(_browser_argv(binary, "--dump-dom", url), capture_output=True, text=True,
                          timeout=BROWSER_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def screenshot(binary: str, url: str, path: Path, height: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    argv = _browser_argv(binary, f"--screenshot={path}", url)
    argv[argv.index("--window-size=1400,1000")] = f"--window-size=1400,{height}"
    done = subprocess.run(argv, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)
    assert done.returncode == 0 and path.exists(), done.stderr[-2000:]


def _text(html: str) -> str:
    return unescape(re.sub(r"<[^>]+>", " ", html))


def test_dashboard_and_timeline_in_chromium(chromium, nats_server, redis_server, unique_prefix):
    problems = TaskGenerator(seed=5).problems(8, max_shots=3, split=Split.HELD_OUT)
    with served_stack(nats_server.url, redis_server.url, unique_prefix, num_workers=2) as url:
        with httpx.Client(base_url=url, timeout=120) as http:

            def send(problem) -> str:  # streamed, so the dashboard sees the steps' instances and thresholds
                reply = http.post("/v1/completions", json={"model": "dls-tiny", "prompt": problem.prompt,
                                                           "stream": True, "cache": "dual"})
                assert reply.status_code == 200
                return reply.headers["x-request-id"]

            with ThreadPoolExecutor(4) as pool:  # a few at once: both instances get work
                finished = list(pool.map(send, problems))
            cluster = http.get("/v1/cluster").json()
            instance_ids = [i["instance_id"] for i in cluster["instances"]]
            assert len(instance_ids) == 2 and cluster["slo"]["finished"] == len(problems)
            stored_all = [http.get(f"/v1/requests/{rid}").json() for rid in finished]
            stored = max(stored_all, key=lambda r: (len(r["instances"]), len(r["steps"])))  # a migrated one if any
            request_id = stored["id"]
            assert stored["status"] == "finished" and stored["steps"]

        dashboard = dump_dom(chromium, f"{url}/dashboard")
        assert 'data-loaded="1"' in dashboard, "the dashboard's script did not render its data"
        for instance_id in instance_ids:
            assert f'data-instance="{instance_id}"' in dashboard
        assert f'href="/requests/{request_id}"' in dashboard  # the latest requests link to their timelines
        assert "TP-1" in _text(dashboard)

        page = dump_dom(chromium, f"{url}/requests/{request_id}")
        assert 'data-loaded="1"' in page, "the timeline's script did not render its data"
        rows = re.findall(r'<tr data-step="(\d+)">(.*?)</tr>', page, flags=re.S)
        assert [int(k) for k, _ in rows] == [s["step_index"] for s in stored["steps"]]
        for (_, row), step in zip(rows, stored["steps"], strict=True):
            cells = _text(row)
            assert step["instance_id"] in cells and step["kind"] in cells and f"{step['threshold']:.2f}" in cells
        assert stored["output"].strip() and stored["output"].strip()[:1] in _text(page)

        if os.environ.get("DLS_UPDATE_SCREENSHOTS") == "1":
            screenshot(chromium, f"{url}/dashboard", SCREENSHOTS / "dashboard.png", 1100)
            screenshot(chromium, f"{url}/requests/{request_id}", SCREENSHOTS / "timeline.png", 1500)
