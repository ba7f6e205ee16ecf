"""The node agent as a process against a real nats-server, with a FAKE worker command: a small script
(written into tmp_path) that stands in for ``python -m services.worker``. It publishes READY heartbeats
with the instance id, TP degree and GPUs the agent gave it, and on SIGTERM publishes DRAINING, then
STOPPING, and exits. Knobs (environment): FAKE_WORKER_PID_DIR (it records ``<instance id>.<pid>``
there), FAKE_WORKER_FAIL_TP (exit at once with code 3 when its TP degree is this one),
FAKE_WORKER_IGNORE_SIGTERM (never exit on SIGTERM: the agent has to kill it), FAKE_WORKER_STUCK_GPU
(the first worker on this GPU reports, from its third heartbeat on, a step that has been computing
ever since: its heartbeats go on, its step never returns), FAKE_WORKER_MUTE_SECOND_GPU (the second
process on this GPU never sends a heartbeat: a restart that hangs before it is READY),
FAKE_WORKER_DEVICES_DIR (before its first heartbeat it writes ``<instance id>.json`` there: the
``CUDA_VISIBLE_DEVICES`` it was given and the machine's GPUs its engine would put its ranks on,
``services.worker.parallel.placement.rank_gpus`` for the device its settings name), FAKE_WORKER_LOADS
(``model=seconds,...``: a worker of that model sends STARTING heartbeats that long before READY, a model's
load), FAKE_WORKER_FAIL_MODEL_GPU (``model:gpu``: a worker of that model whose first GPU is that one exits with
code 3 half a second after it started, a load that fails). It serves (says in its heartbeats) the model its
``DLS_WORKER_MODEL_DIR`` names, as a real worker does, and records that variable and ``DLS_CALIBRATION_DIR`` in
``<pid dir>/<instance id>.<pid>``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import nats
import pytest

from shared.messages import decode, encode
from shared.messages.control import (
    InstanceSlot,
    NodePlan,
    PlanAck,
    PlanAckStatus,
    ReconfigPlan,
    WorkerHeartbeat,
    WorkerStatus,
)
from shared.runtime import free_port
from shared.subjects import Subjects

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60.0  # generous upper bound on a shared CPU; conditions are polled, not timed

FAKE_WORKER = '''
"""A fake worker for the node agent's tests (stands in for python -m services.worker)."""
import asyncio, json, os, signal, sys, time

import nats

from shared.messages import encode
from shared.messages.control import WorkerHeartbeat, WorkerStatus
from shared.subjects import Subjects

INSTANCE_ID = os.environ["DLS_WORKER_INSTANCE_ID"]
TP = int(os.environ["DLS_WORKER_TP"])
GPU_IDS = json.loads(os.environ["DLS_WORKER_GPU_IDS"])
NODE = os.environ["DLS_WORKER_NODE"]
INTERVAL_S = float(os.environ.get("DLS_WORKER_HEARTBEAT_INTERVAL_S", "0.2"))
MODEL = os.path.basename(os.environ["DLS_WORKER_MODEL_DIR"])  # a model's name: its directory's basename


async def main():
    with open(os.path.join(os.environ["FAKE_WORKER_PID_DIR"], f"{INSTANCE_ID}.{os.getpid()}"), "w") as out:
        json.dump({name: os.environ.get(name) for name in ("DLS_WORKER_MODEL_DIR", "DLS_CALIBRATION_DIR")}, out)
    print(f"fake worker {INSTANCE_ID} tp {TP} gpus {GPU_IDS} pid {os.getpid()}", flush=True)
    if os.environ.get("FAKE_WORKER_FAIL_TP") == str(TP):
        print("failing on purpose", flush=True)
        sys.exit(3)
    if os.environ.get("FAKE_WORKER_FAIL_MODEL_GPU") == f"{MODEL}:{GPU_IDS[0]}":
        await asyncio.sleep(0.5)
        print("failing to load on purpose", flush=True)
        sys.exit(3)
    load_s = float(dict(entry.split("=") for entry in os.environ.get("FAKE_WORKER_LOADS", "").split(",")
                        if entry).get(MODEL, 0))
    started_at = time.time()
    if os.environ.get("FAKE_WORKER_DEVICES_DIR"):
        from services.worker.parallel.placement import rank_gpus
        from shared.settings import WorkerSettings

        settings = WorkerSettings()
        placed = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "device": settings.device,
                  "rank_gpus": rank_gpus(settings.device, settings.tp)}
        with open(os.path.join(os.environ["FAKE_WORKER_DEVICES_DIR"], f"{INSTANCE_ID}.json"), "w") as out:
            json.dump(placed, out)
    if os.environ.get("FAKE_WORKER_MUTE_SECOND_GPU") == str(GPU_IDS[0]):
        pid_dir = os.environ["FAKE_WORKER_PID_DIR"]
        n = len([f for f in os.listdir(pid_dir) if f.startswith(f"proc-g{GPU_IDS[0]}-")])
        open(os.path.join(pid_dir, f"proc-g{GPU_IDS[0]}-{n}"), "w").close()
        if n == 1:
            print("silent on purpose", flush=True)
            await asyncio.sleep(3600)
    nc = await nats.connect(os.environ["DLS_NATS_URL"])
    subject = Subjects(os.environ["DLS_SUBJECT_PREFIX"]).heartbeat
    stop = asyncio.Event()
    if os.environ.get("FAKE_WORKER_IGNORE_SIGTERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    stuck_marker = os.path.join(os.environ["FAKE_WORKER_PID_DIR"], "stuck")
    stuck = os.environ.get("FAKE_WORKER_STUCK_GPU") == str(GPU_IDS[0]) and not os.path.exists(stuck_marker)
    seq, stuck_since = 0, None

    async def beat(status):
        nonlocal seq
        seq += 1
        running = time.monotonic() - stuck_since if stuck_since is not None else 0.0
        await nc.publish(subject, encode(WorkerHeartbeat(
            instance_id=INSTANCE_ID, node=NODE, tp=TP, gpu_ids=GPU_IDS, max_batch=4, model=MODEL, status=status,
            ttl_s=3 * INTERVAL_S, sent_at=time.time(), started_at=started_at, seq=seq, step_running_s=running)))

    loaded_at = time.monotonic() + load_s
    while time.monotonic() < loaded_at and not stop.is_set():
        await beat(WorkerStatus.STARTING)
        await asyncio.sleep(INTERVAL_S)
    while not stop.is_set():
        if stuck and seq == 2:
            open(stuck_marker, "w").close()
            stuck_since = time.monotonic()
        await beat(WorkerStatus.READY)
        try:
            await asyncio.wait_for(stop.wait(), INTERVAL_S)
        except TimeoutError:
            pass
    await beat(WorkerStatus.DRAINING)
    await beat(WorkerStatus.STOPPING)
    await nc.flush()
    await nc.close()
    print("fake worker drained and stopped", flush=True)


asyncio.run(main())
'''


class Cluster:
    """What the test sees on NATS: heartbeats per instance and plan acks, plus the fake workers' pids."""

    def __init__(self, pid_dir: Path) -> None:
        self.pid_dir = pid_dir
        self.statuses: dict[str, list[WorkerStatus]] = defaultdict(list)  # instance id -> statuses in order
        self.beats: dict[str, WorkerHeartbeat] = {}  # instance id -> last heartbeat
        self.acks: list[PlanAck] = []
        self.log: list[tuple[str, WorkerStatus]] = []  # every heartbeat heard, in order: (instance id, status)

    async def on_heartbeat(self, msg) -> None:
        beat = decode(WorkerHeartbeat, msg.data)
        self.log.append((beat.instance_id, beat.status))
        if not self.statuses[beat.instance_id] or self.statuses[beat.instance_id][-1] != beat.status:
            self.statuses[beat.instance_id].append(beat.status)
        self.beats[beat.instance_id] = beat

    async def on_ack(self, msg) -> None:
        self.acks.append(decode(PlanAck, msg.data))

    def ready_ids(self) -> list[str]:
        return sorted(i for i, beat in self.beats.items() if beat.status == WorkerStatus.READY)

    def pids(self, instance_id: str | None = None) -> list[int]:
        return sorted(int(p.name.rsplit(".", 1)[1]) for p in self.pid_dir.iterdir() if "." in p.name
                      if instance_id is None or p.name.rsplit(".", 1)[0] == instance_id)

    def env(self, instance_id: str, pid: int) -> dict[str, str | None]:
        """The model variables the agent gave that process of ``instance_id``."""
        return json.loads((self.pid_dir / f"{instance_id}.{pid}").read_text())

    def ack_for(self, plan_id: str) -> PlanAck | None:
        return next((a for a in self.acks if a.plan_id == plan_id), None)

    def first(self, instance_id: str, status: WorkerStatus | None = None) -> int:
        """Position in ``log`` of ``instance_id``'s first heartbeat (of ``status``, if given)."""
        return next(i for i, (iid, st) in enumerate(self.log) if iid == instance_id and status in (None, st))


async def until(condition, what: str, agent: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert agent.poll() is None, f"the agent exited while waiting for {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}; agent log:\n{log.read_text()[-3000:]}"
        await asyncio.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start_agent(tmp_path: Path, nats_url: str, prefix: str, gpu_ids: list[int], initial: list[int],
                **extra_env: str) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    (tmp_path / "pids").mkdir()
    env = {
        **os.environ, "PYTHONPATH": str(REPO), "DLS_NATS_URL": nats_url, "DLS_SUBJECT_PREFIX": prefix,
        "DLS_NODE_AGENT_NODE": "n1", "DLS_NODE_AGENT_GPU_IDS": json.dumps(gpu_ids),
        "DLS_NODE_AGENT_INITIAL_INSTANCES": json.dumps(initial),
        "DLS_NODE_AGENT_WORKER_COMMAND": f"python {script}", "DLS_NODE_AGENT_LOG_DIR": str(tmp_path / "logs"),
        "DLS_NODE_AGENT_START_TIMEOUT_S": "30", "DLS_NODE_AGENT_STOP_TIMEOUT_S": "20",
        "DLS_NODE_AGENT_RESTART_BACKOFF_S": "0.1", "DLS_WORKER_HEARTBEAT_INTERVAL_S": "0.2",
        "FAKE_WORKER_PID_DIR": str(tmp_path / "pids"), **extra_env,
    }
    log = tmp_path / "agent.log"
    agent = subprocess.Popen([sys.executable, "-m", "services.node_agent"], cwd=REPO, env=env,
                             stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return agent, log


def stop_agent(agent: subprocess.Popen, log: Path) -> int:
    agent.send_signal(signal.SIGTERM)
    try:
        return agent.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()
        pytest.fail(f"the agent did not exit on SIGTERM:\n{log.read_text()[-3000:]}")


def run_agent(agent: subprocess.Popen, log: Path, main) -> None:
    """Run ``main(agent, log)`` against the started agent, then stop it (SIGTERM; it must exit 0)."""
    try:
        asyncio.run(main(agent, log))
        assert stop_agent(agent, log) == 0, log.read_text()[-3000:]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def plan(plan_id: str, node: str, stop=(), start=(), keep=()) -> bytes:
    """A plan for ``node``; each slot is ``(tp, gpus)`` or ``(tp, gpus, model)``."""
    def slots(entries):
        return [InstanceSlot(tp=tp, gpu_ids=list(gpus), model=model[0] if model else "")
                for tp, gpus, *model in entries]

    return encode(ReconfigPlan(plan_id=plan_id, created_at=time.time(), instances_by_tp={1: 1},
                               nodes=[NodePlan(node=node, keep=slots(keep), stop=slots(stop), start=slots(start))]))


async def watch(nats_url: str, prefix: str, cluster: Cluster):
    nc = await nats.connect(nats_url)
    subjects = Subjects(prefix)
    await nc.subscribe(subjects.heartbeat, cb=cluster.on_heartbeat)
    await nc.subscribe(subjects.plans_ack, cb=cluster.on_ack)
    await nc.flush()
    return nc, subjects


def test_boot_plan_restart_and_shutdown(nats_server, unique_prefix, tmp_path):
    cluster = Cluster(tmp_path / "pids")

    async def main(agent, log):
        nc, subjects = await watch(nats_server.url, unique_prefix, cluster)
        await until(lambda: len(cluster.ready_ids()) == 2, "the two initial workers", agent, log)
        by_gpu = {tuple(cluster.beats[i].gpu_ids): i for i in cluster.ready_ids()}
        assert set(by_gpu) == {(0,), (1,)}
        assert by_gpu[(0,)].startswith("n1-tp1-g0-") and by_gpu[(1,)].startswith("n1-tp1-g1-")
        assert all(cluster.beats[i].tp == 1 and "." not in i for i in by_gpu.values())

        # A plan for another node is ignored; one for n1 is applied; one arriving meanwhile is rejected.
        await nc.publish(subjects.plans, plan("p-other", "n2", start=[(1, [0])]))
        await nc.publish(subjects.plans, plan("p-1", "n1", stop=[(1, [1])], start=[(2, [2, 3])], keep=[(1, [0])]))
        await nc.publish(subjects.plans, plan("p-2", "n1", start=[(1, [1])]))
        await until(lambda: cluster.ack_for("p-1") is not None, "the ack of p-1", agent, log)
        applied, rejected = cluster.ack_for("p-1"), cluster.ack_for("p-2")
        assert applied.status == PlanAckStatus.APPLIED and applied.node == "n1", applied.detail
        assert applied.stopped_instance_ids == [by_gpu[(1,)]]
        [tp2_id] = applied.started_instance_ids
        assert tp2_id.startswith("n1-tp2-g2-") and tp2_id in cluster.ready_ids()
        assert cluster.beats[tp2_id].gpu_ids == [2, 3] and cluster.beats[tp2_id].tp == 2
        assert rejected is not None and rejected.status == PlanAckStatus.REJECTED and "p-1" in rejected.detail
        assert cluster.ack_for("p-other") is None
        stopped_id = by_gpu[(1,)]
        assert cluster.statuses[stopped_id][-2:] == [WorkerStatus.DRAINING, WorkerStatus.STOPPING]  # drained
        await until(lambda: not alive(cluster.pids(stopped_id)[0]), "the stopped worker's exit", agent, log)

        # A worker that dies unasked is restarted on the same GPUs, under the same id.
        kept_id = by_gpu[(0,)]
        [first_pid] = cluster.pids(kept_id)
        first_start = cluster.beats[kept_id].started_at
        os.kill(first_pid, signal.SIGKILL)
        await until(lambda: len(cluster.pids(kept_id)) == 2 and cluster.beats[kept_id].started_at != first_start
                    and cluster.beats[kept_id].status == WorkerStatus.READY, "the restart", agent, log)
        assert cluster.beats[kept_id].gpu_ids == [0]
        await nc.close()

    agent, log = start_agent(tmp_path, nats_server.url, unique_prefix, [0, 1, 2, 3], [1, 1])
    run_agent(agent, log, main)
    pids = cluster.pids()
    assert len(pids) == 4  # two boot workers, the TP-2 one, the restart
    assert not [pid for pid in pids if alive(pid)], "workers outlived the agent"
    logs = {p.stem for p in (tmp_path / "logs").iterdir()}
    assert logs == {p.name.rsplit(".", 1)[0] for p in (tmp_path / "pids").iterdir()}
    assert "drained and stopped" in (tmp_path / "logs" / f"{sorted(logs)[0]}.log").read_text()


def test_each_worker_is_pinned_to_its_slots_gpus_and_its_engine_places_its_ranks_there(
        nats_server, unique_prefix, tmp_path, monkeypatch):
    """GPUs [0, 1, 2, 3], instances [1, 1, 2]: three workers pinned to {0}, {1} and {2, 3}, each seeing its
    GPUs as cuda:0.. and placing its ranks on exactly those GPUs of the machine (no GPU needed)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the agent sees every GPU
    cluster = Cluster(tmp_path / "pids")
    devices = tmp_path / "devices"
    devices.mkdir()

    async def main(agent, log):
        nc, _ = await watch(nats_server.url, unique_prefix, cluster)
        await until(lambda: len(cluster.ready_ids()) == 3, "the three workers", agent, log)
        await nc.close()

    agent, log = start_agent(tmp_path, nats_server.url, unique_prefix, [0, 1, 2, 3], [1, 1, 2],
                             DLS_WORKER_DEVICE="cuda", FAKE_WORKER_DEVICES_DIR=str(devices))
    run_agent(agent, log, main)
    by_gpus = {tuple(cluster.beats[i].gpu_ids): json.loads((devices / f"{i}.json").read_text())
               for i in cluster.ready_ids()}
    assert by_gpus == {
        (0,): {"visible": "0", "device": "cuda", "rank_gpus": ["0"]},
        (1,): {"visible": "1", "device": "cuda", "rank_gpus": ["1"]},
        (2, 3): {"visible": "2,3", "device": "cuda", "rank_gpus": ["2", "3"]},
    }


def test_failed_starts_are_reported_and_stubborn_workers_killed(nats_server, unique_prefix, tmp_path):
    cluster = Cluster(tmp_path / "pids")

    async def main(agent, log):
        nc, subjects = await watch(nats_server.url, unique_prefix, cluster)
        await until(lambda: len(cluster.ready_ids()) == 1, "the initial worker", agent, log)
        [boot_id] = cluster.ready_ids()
        await nc.publish(subjects.plans, plan("p-1", "n1", stop=[(1, [2])], start=[(1, [1]), (2, [2, 3]), (1, [7])]))
        await until(lambda: cluster.ack_for("p-1") is not None, "the ack of p-1", agent, log)
        ack = cluster.ack_for("p-1")
        assert ack.status == PlanAckStatus.PARTIAL and ack.stopped_instance_ids == []
        [started] = ack.started_instance_ids
        assert started.startswith("n1-tp1-g1-") and started in cluster.beats
        assert "stop TP-1 on GPUs [2]: no worker holds exactly these GPUs" in ack.detail
        assert "start TP-2 on GPUs [2, 3]" in ack.detail and "exited with code 3" in ack.detail
        assert "GPUs [7] are not managed" in ack.detail

        # Nothing to do for n1 is applied at once; a plan that only fails is FAILED.
        await nc.publish(subjects.plans, plan("p-2", "n1", keep=[(1, [0])]))
        await until(lambda: cluster.ack_for("p-2") is not None, "the ack of p-2", agent, log)
        assert cluster.ack_for("p-2").status == PlanAckStatus.APPLIED
        await nc.publish(subjects.plans, plan("p-3", "n1", start=[(1, [0])]))
        await until(lambda: cluster.ack_for("p-3") is not None, "the ack of p-3", agent, log)
        assert cluster.ack_for("p-3").status == PlanAckStatus.FAILED and "in use" in cluster.ack_for("p-3").detail
        assert boot_id in cluster.ready_ids()
        await nc.close()

    agent, log = start_agent(tmp_path, nats_server.url, unique_prefix, [0, 1, 2, 3], [1],
                             FAKE_WORKER_FAIL_TP="2", FAKE_WORKER_IGNORE_SIGTERM="1",
                             DLS_NODE_AGENT_STOP_TIMEOUT_S="0.5")
    run_agent(agent, log, main)
    assert "killing it" in log.read_text()  # they ignored SIGTERM
    assert not [pid for pid in cluster.pids() if alive(pid)], "workers outlived the agent"


def test_bad_settings_fail_at_start_with_a_clear_message(tmp_path):
    env = {**os.environ, "DLS_NODE_AGENT_GPU_IDS": "[0, 1]", "DLS_NODE_AGENT_INITIAL_INSTANCES": "[2, 1]",
           "DLS_NODE_AGENT_LOG_DIR": str(tmp_path / "logs")}
    result = subprocess.run([sys.executable, "-m", "services.node_agent"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=WAIT_S)
    assert result.returncode == 2
    assert "do not fit on GPUs [0, 1]" in result.stderr


def test_hung_workers_are_killed_and_replaced(nats_server, unique_prefix, tmp_path):
    """A stopped process (SIGSTOP: no heartbeats) and a live one whose step never returns (its heartbeats
    say so) are both killed by the agent and restarted on their GPUs, the latter's restart (silent: never
    READY) once more after the start timeout; the healthy one is left alone."""
    cluster = Cluster(tmp_path / "pids")

    async def main(agent, log):
        nc, _ = await watch(nats_server.url, unique_prefix, cluster)
        await until(lambda: len(cluster.ready_ids()) == 3, "the three initial workers", agent, log)
        by_gpu = {cluster.beats[i].gpu_ids[0]: i for i in cluster.ready_ids()}
        [stuck_pid], [stopped_pid], [healthy_pid] = (cluster.pids(by_gpu[g]) for g in (0, 1, 2))
        os.kill(stopped_pid, signal.SIGSTOP)

        def replaced(gpu: int, old_pid: int) -> bool:
            instance_id = by_gpu[gpu]
            return (not alive(old_pid) and len(cluster.pids(instance_id)) == 2
                    and cluster.beats[instance_id].status == WorkerStatus.READY
                    and cluster.beats[instance_id].step_running_s == 0.0)

        await until(lambda: replaced(1, stopped_pid) and len(cluster.pids(by_gpu[0])) == 3
                    and cluster.beats[by_gpu[0]].status == WorkerStatus.READY
                    and cluster.beats[by_gpu[0]].step_running_s == 0.0, "both hung workers replaced", agent, log)
        assert not alive(stuck_pid) and not alive(cluster.pids(by_gpu[0])[1])
        assert alive(healthy_pid) and cluster.pids(by_gpu[2]) == [healthy_pid]
        await nc.close()

    agent, log = start_agent(tmp_path, nats_server.url, unique_prefix, [0, 1, 2], [1, 1, 1],
                             DLS_NODE_AGENT_HANG_TIMEOUT_S="1.5", FAKE_WORKER_STUCK_GPU="0",
                             FAKE_WORKER_MUTE_SECOND_GPU="0", DLS_NODE_AGENT_START_TIMEOUT_S="3")
    run_agent(agent, log, main)
    text = log.read_text()
    assert "is hung (a step computing for" in text and "is hung (no heartbeat for" in text, text[-3000:]
    assert "is hung (not READY " in text, text[-3000:]


def test_each_worker_serves_its_slots_model_across_plans_and_restarts(nats_server, unique_prefix, tmp_path):
    """Two served models, alpha and beta: the boot workers take them in turn; a plan's start slot naming
    beta spawns a worker given beta's directory (and not alpha's calibration) that heartbeats beta, and
    beta again after a crash; a slot naming no model serves the first; a slot naming a model the agent
    does not serve, or stopping another model's instance, fails with a detail naming the model."""
    alpha, beta = tmp_path / "models" / "alpha", tmp_path / "models" / "beta"
    alpha_calibration = str(tmp_path / "alpha-calibration")
    cluster = Cluster(tmp_path / "pids")

    def models_by_gpu() -> dict[int, str]:
        return {cluster.beats[i].gpu_ids[0]: cluster.beats[i].model for i in cluster.ready_ids()}

    async def main(agent, log):
        nc, subjects = await watch(nats_server.url, unique_prefix, cluster)
        await until(lambda: len(cluster.ready_ids()) == 2, "the two initial workers", agent, log)
        assert models_by_gpu() == {0: "alpha", 1: "beta"}

        await nc.publish(subjects.plans, plan("p-1", "n1", start=[(1, [2], "beta"), (1, [3], "gamma")]))
        await until(lambda: cluster.ack_for("p-1") is not None, "the ack of p-1", agent, log)
        ack = cluster.ack_for("p-1")
        assert ack.status == PlanAckStatus.PARTIAL, ack.detail
        assert "start TP-1 on GPUs [3] of model 'gamma': model 'gamma' is not served by this agent" in ack.detail
        assert "(it serves alpha, beta)" in ack.detail
        [beta_id] = ack.started_instance_ids
        assert cluster.beats[beta_id].model == "beta" and cluster.beats[beta_id].gpu_ids == [2]
        [beta_pid] = cluster.pids(beta_id)
        assert cluster.env(beta_id, beta_pid) == {"DLS_WORKER_MODEL_DIR": str(beta), "DLS_CALIBRATION_DIR": ""}
        assert agent.poll() is None  # an unknown model fails its slot, not the agent

        # a crash: restarted on its GPUs, serving beta still
        first_start = cluster.beats[beta_id].started_at
        os.kill(beta_pid, signal.SIGKILL)
        await until(lambda: len(cluster.pids(beta_id)) == 2 and cluster.beats[beta_id].started_at != first_start
                    and cluster.beats[beta_id].status == WorkerStatus.READY, "the restart", agent, log)
        restarted_pid = max(cluster.pids(beta_id))
        assert cluster.beats[beta_id].model == "beta"
        assert cluster.env(beta_id, restarted_pid)["DLS_WORKER_MODEL_DIR"] == str(beta)

        # stopping GPU 0 as beta's instance: it serves alpha, so it stays; a slot naming no model is alpha's
        await nc.publish(subjects.plans, plan("p-2", "n1", stop=[(1, [0], "beta")], start=[(1, [3])]))
        await until(lambda: cluster.ack_for("p-2") is not None, "the ack of p-2", agent, log)
        ack = cluster.ack_for("p-2")
        assert ack.status == PlanAckStatus.PARTIAL and ack.stopped_instance_ids == [], ack.detail
        assert "stop TP-1 on GPUs [0] of model 'beta': the worker there" in ack.detail and "serves 'alpha'" in ack.detail
        [alpha_id] = ack.started_instance_ids
        assert cluster.beats[alpha_id].model == "alpha"
        [alpha_pid] = cluster.pids(alpha_id)
        assert cluster.env(alpha_id, alpha_pid) == {"DLS_WORKER_MODEL_DIR": str(alpha),
                                                    "DLS_CALIBRATION_DIR": alpha_calibration}
        assert models_by_gpu() == {0: "alpha", 1: "beta", 2: "beta", 3: "alpha"}
        await nc.close()

    agent, log = start_agent(tmp_path, nats_server.url, unique_prefix, [0, 1, 2, 3], [1, 1],
                             DLS_NODE_AGENT_MODEL_DIRS=f"{alpha},{beta}", DLS_CALIBRATION_DIR=alpha_calibration)
    run_agent(agent, log, main)
    text = log.read_text()
    assert "(beta, TP-1 on GPUs [2])" in text and "(alpha, TP-1 on GPUs [0])" in text  # its log names each model
    assert "not the model it was started for" not in text  # each heartbeat named the model its worker was given


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_a_slot_changing_model_is_made_before_break_and_a_failed_switch_keeps_the_old_one(
        nats_server, unique_prefix, tmp_path):
    """CPU workers (DLS_NODE_AGENT_OVERLAP_SWITCH auto: on). A plan moving GPU 0 from alpha to beta spawns
    beta's worker at once: alpha's heartbeats go on, READY, through beta's load, and alpha is drained only
    once beta is READY; the switch is observed in dls_node_agent_switch_seconds{model="beta"}. The same on
    GPU 1 with a beta worker that fails to load: alpha there serves on, never drained, and the ack says so."""
    models = tmp_path / "models"
    metrics_port = free_port()
    cluster = Cluster(tmp_path / "pids")

    async def main(agent, log):
        nc, subjects = await watch(nats_server.url, unique_prefix, cluster)
        await until(lambda: len(cluster.ready_ids()) == 2, "the two alpha workers", agent, log)
        alpha = {cluster.beats[i].gpu_ids[0]: i for i in cluster.ready_ids()}  # GPU -> alpha's instance there

        await nc.publish(subjects.plans, plan("p-1", "n1", stop=[(1, [0], "alpha")], start=[(1, [0], "beta")]))
        await until(lambda: cluster.ack_for("p-1") is not None, "the ack of p-1", agent, log)
        ack = cluster.ack_for("p-1")
        assert ack.status == PlanAckStatus.APPLIED and ack.stopped_instance_ids == [alpha[0]], ack.detail
        [beta_id] = ack.started_instance_ids
        assert cluster.beats[beta_id].model == "beta" and cluster.beats[beta_id].gpu_ids == [0]
        beta_spawned, beta_ready = cluster.first(beta_id), cluster.first(beta_id, WorkerStatus.READY)
        alpha_drained = cluster.first(alpha[0], WorkerStatus.DRAINING)
        assert beta_spawned < beta_ready < alpha_drained, cluster.log
        alpha_serving = [i for i, (iid, status) in enumerate(cluster.log)
                         if iid == alpha[0] and status == WorkerStatus.READY and beta_spawned < i < beta_ready]
        assert len(alpha_serving) >= 2, cluster.log  # it served on, beside beta loading
        assert cluster.statuses[alpha[0]][-2:] == [WorkerStatus.DRAINING, WorkerStatus.STOPPING]

        await nc.publish(subjects.plans, plan("p-2", "n1", stop=[(1, [1], "alpha")], start=[(1, [1], "beta")]))
        await until(lambda: cluster.ack_for("p-2") is not None, "the ack of p-2", agent, log)
        ack = cluster.ack_for("p-2")
        assert ack.status == PlanAckStatus.FAILED, ack.detail
        assert ack.started_instance_ids == [] and ack.stopped_instance_ids == []
        assert "start TP-1 on GPUs [1] of model 'beta'" in ack.detail and "exited with code 3" in ack.detail
        assert f"{alpha[1]} (alpha, TP-1 on GPUs [1]) kept serving (not stopped)" in ack.detail
        heard = len(cluster.log)
        await until(lambda: (alpha[1], WorkerStatus.READY) in cluster.log[heard:], "alpha serving on", agent, log)
        assert cluster.statuses[alpha[1]] == [WorkerStatus.READY] and alive(cluster.pids(alpha[1])[0])

        text = await asyncio.to_thread(scrape, metrics_port)
        assert 'dls_node_agent_switch_seconds_count{model="beta"} 1.0' in text
        assert 'dls_node_agent_model_workers{model="alpha"} 1.0' in text
        assert 'dls_node_agent_model_workers{model="beta"} 1.0' in text
        await nc.close()

    agent, log = start_agent(tmp_path, nats_server.url, unique_prefix, [0, 1], [1, 1],
                             DLS_NODE_AGENT_MODEL_DIRS=f"{models / 'alpha'},{models / 'beta'}",
                             DLS_NODE_AGENT_INITIAL_MODELS='["alpha", "alpha"]', DLS_METRICS_PORT=str(metrics_port),
                             FAKE_WORKER_LOADS="beta=2", FAKE_WORKER_FAIL_MODEL_GPU="beta:1")
    run_agent(agent, log, main)
    assert "made before break: READY" in log.read_text()


def test_with_the_switch_off_the_old_model_stops_first(nats_server, unique_prefix, tmp_path):
    """DLS_NODE_AGENT_OVERLAP_SWITCH=off: the same move of GPU 0 from alpha to beta drains and stops alpha
    before beta's worker is spawned (its GPUs serve nothing through beta's load)."""
    models = tmp_path / "models"
    cluster = Cluster(tmp_path / "pids")

    async def main(agent, log):
        nc, subjects = await watch(nats_server.url, unique_prefix, cluster)
        await until(lambda: len(cluster.ready_ids()) == 1, "the alpha worker", agent, log)
        [alpha_id] = cluster.ready_ids()
        await nc.publish(subjects.plans, plan("p-1", "n1", stop=[(1, [0], "alpha")], start=[(1, [0], "beta")]))
        await until(lambda: cluster.ack_for("p-1") is not None, "the ack of p-1", agent, log)
        ack = cluster.ack_for("p-1")
        assert ack.status == PlanAckStatus.APPLIED and ack.stopped_instance_ids == [alpha_id], ack.detail
        [beta_id] = ack.started_instance_ids
        assert cluster.first(alpha_id, WorkerStatus.STOPPING) < cluster.first(beta_id), cluster.log
        await nc.close()

    agent, log = start_agent(tmp_path, nats_server.url, unique_prefix, [0], [1],
                             DLS_NODE_AGENT_MODEL_DIRS=f"{models / 'alpha'},{models / 'beta'}",
                             DLS_NODE_AGENT_OVERLAP_SWITCH="off", FAKE_WORKER_LOADS="beta=0.5")
    run_agent(agent, log, main)
    text = log.read_text()
    assert "a slot changing model is stopped first" in text and "made before break: READY" not in text
