"""A replicated Redis on loopback for tests: a primary, its replicas and three Sentinels, each a real
``redis-server`` process (the Sentinels are ``redis-server <conf> --sentinel``).

Every data node keeps an append-only file (``appendfsync always``); the Sentinels declare the primary
down after ``down_after_ms`` and promote a replica (quorum 2 of 3). The services reach it with the URL
``redis+sentinel://127.0.0.1:<p1>,...:<p3>/<master>/0`` (``shared.redis_target``), so their state
writes wait for a replica (``WAIT``) and they follow a failover. ``kill_primary`` SIGKILLs the
current primary; ``restart`` brings a killed node back as a replica of whoever is primary now.
Processes are stopped by their own pid, never by name.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.runtime import free_port

MASTER_NAME = "dls"


class RedisHAError(RuntimeError):
    """The replicated Redis did not start or fail over as it should."""


def _redis_binary() -> str:
    found = shutil.which("redis-server")
    if not found:
        raise RedisHAError("redis-server not found on PATH (apt-get install redis-server)")
    return found


def _client(port: int):
    import redis

    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=1.0, socket_connect_timeout=1.0)


def _ask(port: int, call, default=None):
    """``call(client)`` on the server on ``port``; ``default`` when it does not answer."""
    import redis

    client = _client(port)
    try:
        return call(client)
    except (redis.RedisError, OSError):
        return default
    finally:
        client.close()


@dataclass
class ReplicatedRedis:
    """The processes of one replicated Redis; ``start`` them, break them, ``stop`` them."""

    run_dir: Path
    num_replicas: int = 2
    num_sentinels: int = 3
    down_after_ms: int = 2000
    failover_timeout_ms: int = 4000
    ports: list[int] = field(default_factory=list)  # data nodes; node 0 starts as the primary
    sentinel_ports: list[int] = field(default_factory=list)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)  # name -> the running process
    num_killed: int = 0

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{MASTER_NAME}/0"

    # --- processes -------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{name}.log", "ab") as log:
            self.processes[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True)

    def start(self, timeout_s: float = 30.0) -> None:
        n = 1 + self.num_replicas
        self.ports = [free_port() for _ in range(n)]
        self.sentinel_ports = [free_port() for _ in range(self.num_sentinels)]
        self.start_node(0, replica_of=None)
        for i in range(1, n):
            self.start_node(i, replica_of=self.ports[0])
        self._wait(lambda: all(self.replication(i).get("master_link_status") == "up" for i in range(1, n)),
                   timeout_s, "the replicas to sync")
        for i in range(self.num_sentinels):
            self.start_sentinel(i)
        self._wait(lambda: all(self.sentinel_view(i) == self.ports[0] and self._sentinels_known(i)
                               for i in range(self.num_sentinels)), timeout_s, "the Sentinels to agree")

    def start_node(self, i: int, replica_of: int | None) -> None:
        data = self.run_dir / f"redis-{i}"
        data.mkdir(parents=True, exist_ok=True)
        argv = [_redis_binary(), "--port", str(self.ports[i]), "--bind", "127.0.0.1", "--dir", str(data),
                "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
        if replica_of is not None:
            argv += ["--replicaof", "127.0.0.1", str(replica_of)]
        self._spawn(f"redis-{i}", argv)
        self._wait(lambda: _ask(self.ports[i], lambda r: r.ping(), False), 30, f"redis-{i}")

    def start_sentinel(self, i: int) -> None:
        conf = self.run_dir / f"sentinel-{i}.conf"  # Sentinels rewrite their config: one file each
        conf.write_text("\n".join([
            f"port {self.sentinel_ports[i]}", "bind 127.0.0.1", f"dir {self.run_dir}",
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.ports[0]} 2",
            f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}",
            f"sentinel failover-timeout {MASTER_NAME} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {MASTER_NAME} 1", "",
        ]))
        self._spawn(f"sentinel-{i}", [_redis_binary(), str(conf), "--sentinel"])

    def stop(self) -> None:
        """Sentinels first (no failover on the way down), then the primary (which would otherwise wait for
        replicas already gone), then the replicas."""
        try:
            primary = f"redis-{self.primary()}"
        except RedisHAError:
            primary = ""
        names = sorted(self.processes, key=lambda n: (not n.startswith("sentinel"), n != primary, n))
        for name in names:
            process = self.processes[name]
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    # --- state -----------------------------------------------------------------------------------

    def replication(self, i: int) -> dict[str, str]:
        """``INFO replication`` of data node ``i`` as a dict (empty when it does not answer)."""
        return {k: str(v) for k, v in _ask(self.ports[i], lambda r: r.info("replication"), {}).items()}

    def sentinel_view(self, i: int) -> int | None:
        """The primary's port as Sentinel ``i`` sees it."""
        address = _ask(self.sentinel_ports[i], lambda r: r.sentinel_get_master_addr_by_name(MASTER_NAME))
        return int(address[1]) if address else None

    def _sentinels_known(self, i: int) -> bool:
        master = _ask(self.sentinel_ports[i], lambda r: r.sentinel_master(MASTER_NAME), {})
        return int(master.get("num-other-sentinels", 0)) >= self.num_sentinels - 1

    def primary(self) -> int:
        """The index of the data node the Sentinels name the primary (a majority of them)."""
        views = [self.sentinel_view(i) for i in range(self.num_sentinels)]
        for port in set(views):
            if port is not None and views.count(port) * 2 > self.num_sentinels and port in self.ports:
                return self.ports.index(port)
        raise RedisHAError(f"the Sentinels do not agree on a primary: {views}")

    def alive(self, i: int) -> bool:
        process = self.processes.get(f"redis-{i}")
        return process is not None and process.poll() is None

    # --- faults ----------------------------------------------------------------------------------

    def kill_primary(self) -> int:
        """SIGKILL the primary; its index."""
        i = self.primary()
        process = self.processes[f"redis-{i}"]
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        self.num_killed += 1
        return i

    def wait_failover(self, old: int, timeout_s: float = 30.0) -> int:
        """Until the Sentinels name a live primary other than ``old``, and it acts as one; its index."""
        def promoted() -> bool:
            try:
                new = self.primary()
            except RedisHAError:
                return False
            return new != old and self.replication(new).get("role") == "master"

        self._wait(promoted, timeout_s, "a replica to be promoted")
        return self.primary()

    def restart(self, i: int, timeout_s: float = 30.0) -> None:
        """Bring node ``i`` back as a replica of the current primary, synced."""
        primary = self.primary()
        self.start_node(i, replica_of=self.ports[primary])
        self._wait(lambda: self.replication(i).get("master_link_status") == "up", timeout_s,
                   f"redis-{i} to sync from the primary")

    @staticmethod
    def _wait(predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise RedisHAError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(0.1)
