"""Control-plane overhead: the real scheduler, NATS and Redis with a FAKE engine of zero compute.

Processes: nats-server, redis-server, this process (the scheduler service plus a closed-loop driver
that keeps ``--requests`` requests in flight by publishing intake messages directly, as the gateway
would), and one worker process holding ``--instances`` worker services whose engine is
``services.worker.engine.fake.ZeroComputeEngine`` (no model: what is measured is everything around a
step). Each worker records, for every step, the time since it published its previous results:
the per-step overhead. A step that waited for a command pays the round trip (scheduler decode,
core decision, dispatch, two NATS hops; the worker's own Redis write is part of its step, not of
the overhead); a pipelined step (run from a command the worker held) pays none, and
``overhead_round_trip_ms`` reports the others apart. Measured in the same run, as the physical
floor: the bare NATS request/reply round trip between the two processes and one Redis pipeline
round trip. The worker processes stand in for accelerator hosts and run at a lower CPU priority
(``--worker-nice``, 10): in a deployment they do not share the scheduler's cores. Request lengths
are spread (``--gen-length-spread``) and measuring starts once the first wave has turned over, so
the requests of an instance are at different points of their blocks.

    python -m bench.control_plane --json runs/bench-control-plane.json

JSON: ``overhead_ms`` (p50, p99), ``overhead_round_trip_ms``, ``pipelined_share`` (of which
``repeated_share``: a held command's repeat, none having come in time), ``gpu_idle_share``
(the share of the instances' wall time with requests held and no step running), ``floor_ms``
(nats_rtt, redis_rtt: p50), ``steps_per_s`` (request steps per second, summed over instances),
``commands_per_s``, ``instances``, ``requests``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from bench.common import emit_json
from shared.runtime import event_loop_name, free_port, run

PROFILE = "profiles/llada-8b-h100.json"


# --- the worker process ---------------------------------------------------------------------------


async def run_workers(args) -> None:
    import nats

    from services.worker.engine.fake import ZeroComputeEngine
    from services.worker.service.service import WorkerService
    from shared.messages import codec
    from shared.messages.steps import StepCommand
    from shared.settings import WorkerSettings
    from shared.state import RedisStateStore

    class TimedWorker(WorkerService):
        """A worker that records the gap between its results and its next step: the arrival of the
        next command (or of a held command that came late), or, pipelined, the start of the step it
        held (no round trip)."""

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.last_sent: float | None = None
            self.last_sent_wall = 0.0
            self.gaps: list[float] = []  # every step
            self.round_trip_gaps: list[float] = []  # steps that waited for a command
            self.to_issue: list[float] = []  # results published -> scheduler issues the next command
            self.flight: list[float] = []  # command issued -> it reaches this worker's callback
            self.request_steps = 0
            self.commands = 0  # steps run (commanded or pipelined)
            self.pipelined = 0  # steps run from a held command in hand when the step before ended
            self.late = 0  # steps run from a held command that came after the step before ended
            self.repeated_before = 0  # held.num_repeated when measuring began
            self.measuring = False
            self.measure_start = 0.0  # perf_counter when measuring began
            self.idle_since: float | None = None  # results out, requests held, no step running since then
            self.idle_s = 0.0  # of the measured window: seconds with requests held and no step running

        async def _on_command(self, msg) -> None:
            arrived, arrived_wall = time.perf_counter(), time.time()
            command = codec.decode(StepCommand, msg.data)
            if not command.after_step_id and command.items:
                if self.measuring and self.last_sent is not None:
                    self.gaps.append(arrived - self.last_sent)
                    self.round_trip_gaps.append(arrived - self.last_sent)
                    self.to_issue.append(command.issued_at - self.last_sent_wall)  # the scheduler's wall clock
                    self.flight.append(arrived_wall - command.issued_at)
                self.last_sent = None
            await super()._on_command(msg)

        def _run_late(self, command, headers) -> None:
            """A held command that came after its step ended runs: the step waited for it."""
            arrived = time.perf_counter()
            super()._run_late(command, headers)
            if self.measuring and self.last_sent is not None:
                self.gaps.append(arrived - self.last_sent)
                self.round_trip_gaps.append(arrived - self.last_sent)
                self.late += 1
            self.last_sent = None

        def _step_starting(self, command, continued: bool) -> None:
            now = time.perf_counter()
            if continued and self.measuring and self.last_sent is not None:
                self.gaps.append(now - self.last_sent)
                self.pipelined += 1
            self.last_sent = None
            self.end_idle(now)
            if self.measuring:
                self.commands += 1

        def _step_published(self, results) -> None:
            self.last_sent, self.last_sent_wall = time.perf_counter(), time.time()
            if self.resident:  # it holds requests, and (until its next step starts) the accelerator idles
                self.idle_since = self.last_sent

        def end_idle(self, now: float) -> None:
            """The idle stretch since the last results, clipped to the measured window, is over."""
            if self.measuring and self.idle_since is not None:
                self.idle_s += max(now - max(self.idle_since, self.measure_start), 0.0)
            self.idle_since = None

        async def _run(self, command):
            if args.step_ms > 0:  # the accelerator's time: the step waits, the CPU is free
                await asyncio.sleep(args.step_ms / 1000.0)
            results = await super()._run(command)
            if self.measuring:
                self.request_steps += len(results.results)
            return results

    nc = await nats.connect(args.nats)
    store = RedisStateStore.from_url(args.redis, args.prefix)
    workers = []
    for i in range(args.first_instance, args.first_instance + args.instances):
        settings = WorkerSettings(nats_url=args.nats, redis_url=args.redis, subject_prefix=args.prefix,
                                  redis_key_prefix=args.prefix, max_batch=args.max_batch, profile=PROFILE)
        worker = TimedWorker(settings, ZeroComputeEngine(), nc, store, instance_id=f"zero{i}")
        await worker.start()
        workers.append(worker)

    async def echo(msg):
        await msg.respond(msg.data)

    if args.first_instance == 0:
        await nc.subscribe(f"{args.prefix}.bench.echo", cb=echo)
    control = asyncio.Event()
    phase = {"measure": False}

    async def on_control(msg):
        command = msg.data.decode()
        if command == "start":
            phase["start"] = time.perf_counter()
            for w in workers:
                w.measuring = True
                w.measure_start = phase["start"]
                w.gaps.clear()
                w.round_trip_gaps.clear()
                w.to_issue.clear()
                w.pipelined = w.late = w.commands = w.request_steps = 0
                w.repeated_before = w.held.num_repeated
                w.idle_s = 0.0
                w.flight.clear()
            await msg.respond(b"ok")
        elif command == "stop":
            stopped = time.perf_counter()
            elapsed = stopped - phase["start"]
            for w in workers:
                if w.idle_since is not None:  # idle at the window's end: count it up to there
                    w.end_idle(stopped)
                    w.idle_since = stopped
                w.measuring = False
            report = {
                "gaps_s": [g for w in workers for g in w.gaps],
                "round_trip_gaps_s": [g for w in workers for g in w.round_trip_gaps],
                "pipelined": sum(w.pipelined for w in workers),
                "late": sum(w.late for w in workers),
                "repeated": sum(w.held.num_repeated - w.repeated_before for w in workers),
                "to_issue_s": [g for w in workers for g in w.to_issue],
                "flight_s": [g for w in workers for g in w.flight],
                "request_steps": sum(w.request_steps for w in workers),
                "commands": sum(w.commands for w in workers),
                "idle_s": sum(w.idle_s for w in workers),
                "instances": len(workers),
                "elapsed_s": elapsed,
            }
            await msg.respond(json.dumps(report).encode())
        elif command == "quit":  # after the scheduler stopped: leave without it resyncing everything
            await msg.respond(b"ok")
            control.set()

    await nc.subscribe(f"{args.prefix}.bench.control", cb=on_control)
    await nc.flush()
    print("workers ready", flush=True)
    await control.wait()
    for w in workers:
        await w.stop()
    # steps still running finish (a stopped worker goes on to no held command) before the connection goes
    await asyncio.gather(*(t for w in workers for t in list(w._step_tasks)), return_exceptions=True)
    await nc.drain()
    await store.close()


# --- the scheduler process --------------------------------------------------------------------------


async def run_scheduler_and_load(args, nats_url: str, redis_url: str, prefix: str) -> dict:
    import nats
    from redis.asyncio import Redis

    from services.scheduler.service import SchedulerService
    from shared.jetstream import ensure_intake_stream, publish_request
    from shared.messages import codec
    from shared.messages.events import RequestEvent, RequestFailed, RequestFinished
    from shared.messages.intake import CompletionRequest
    from shared.settings import SchedulerSettings
    from shared.state import RedisStateStore
    from shared.subjects import Subjects

    subjects = Subjects(prefix)
    settings = SchedulerSettings(nats_url=nats_url, redis_url=redis_url, subject_prefix=prefix,
                                 redis_key_prefix=prefix, profile=PROFILE, predictor_timeout_s=0.05,
                                 stats_interval_s=5.0)
    sched_nc = await nats.connect(nats_url)
    store = RedisStateStore.from_url(redis_url, prefix)
    scheduler = SchedulerService(settings, sched_nc, sched_nc.jetstream(), store)
    await scheduler.start()

    client = await nats.connect(nats_url)
    js = client.jetstream()
    await ensure_intake_stream(js, subjects)
    in_flight = {"n": 0, "done": 0}
    refill = asyncio.Event()

    async def on_event(msg):
        event = codec.decode(RequestEvent, msg.data)
        if isinstance(event, RequestFinished | RequestFailed):
            in_flight["n"] -= 1
            in_flight["done"] += 1
            refill.set()

    await client.subscribe(subjects.events_all, cb=on_event)

    spread = random.Random(args.seed)

    def gen_length() -> int:
        """Lengths spread around --gen-length, so that the requests on an instance finish, and start
        their blocks, at different steps (the steady state of real traffic, not one lockstep wave)."""
        low, high = args.gen_length * (1 - args.gen_length_spread), args.gen_length * (1 + args.gen_length_spread)
        return max(1, round(spread.uniform(low, high)))

    async def submit():
        request = CompletionRequest(request_id=f"cp-{uuid.uuid4().hex}", prompt_token_ids=list(range(3, 35)),
                                    gen_length=gen_length(), block_length=32, slo_ms=600_000.0,
                                    arrival_time=time.time())
        in_flight["n"] += 1
        await publish_request(js, subjects, request)

    async def keep_full(stop: asyncio.Event):
        while not stop.is_set():
            while in_flight["n"] < args.requests:
                await submit()
            refill.clear()
            try:
                await asyncio.wait_for(refill.wait(), 0.5)
            except TimeoutError:
                pass

    await scheduler_ready(scheduler, args.instances)
    # the physical floor, between the same two processes, before the load starts (same run)
    redis = Redis.from_url(redis_url)

    async def nats_round_trip() -> float:
        t0 = time.perf_counter()
        await client.request(f"{prefix}.bench.echo", b"x" * 64, timeout=5)
        return time.perf_counter() - t0

    async def redis_round_trip(i: int) -> float:
        t0 = time.perf_counter()
        async with redis.pipeline(transaction=False) as pipe:
            pipe.set(f"{prefix}:bench:{i % 8}", b"x" * 64)
            pipe.get(f"{prefix}:bench:{(i + 1) % 8}")
            await pipe.execute()
        return time.perf_counter() - t0

    nats_rtt = [await nats_round_trip() for _ in range(300)]
    redis_rtt = [await redis_round_trip(i) for i in range(300)]
    stop = asyncio.Event()
    loader = asyncio.create_task(keep_full(stop))
    await asyncio.sleep(args.warmup)
    await control_all(client, f"{prefix}.bench.control", b"start", args.worker_procs)
    # the same two round trips again, paced, while the load runs: what a hop costs in these
    # conditions (processes woken from idle between steps, CPUs shared), next to the bare figure
    loaded_nats_rtt, loaded_redis_rtt = [], []
    probe_stop = asyncio.Event()

    async def probe():
        i = 0
        while not probe_stop.is_set():
            await asyncio.sleep(0.1)  # sparse: the probes must not warm the processes up themselves
            loaded_nats_rtt.append(await nats_round_trip())
            loaded_redis_rtt.append(await redis_round_trip(i))
            i += 1

    prober = asyncio.create_task(probe())
    await asyncio.sleep(args.duration)
    probe_stop.set()
    await prober
    await redis.aclose()
    replies = await control_all(client, f"{prefix}.bench.control", b"stop", args.worker_procs)
    parts = [json.loads(r) for r in replies]
    measured = {"gaps_s": [g for p in parts for g in p["gaps_s"]],
                "round_trip_gaps_s": [g for p in parts for g in p["round_trip_gaps_s"]],
                "pipelined": sum(p["pipelined"] for p in parts),
                "late": sum(p["late"] for p in parts),
                "repeated": sum(p["repeated"] for p in parts),
                "to_issue_s": [g for p in parts for g in p["to_issue_s"]],
                "flight_s": [g for p in parts for g in p["flight_s"]],
                "request_steps": sum(p["request_steps"] for p in parts),
                "commands": sum(p["commands"] for p in parts),
                "idle_s": sum(p["idle_s"] for p in parts),
                # instance-seconds measured: each process's window times its instances
                "instance_s": sum(p["elapsed_s"] * p["instances"] for p in parts),
                "elapsed_s": max(p["elapsed_s"] for p in parts)}
    stop.set()
    await loader

    await scheduler.stop()
    await control_all(client, f"{prefix}.bench.control", b"quit", args.worker_procs)
    await sched_nc.close()
    await client.close()
    await store.close()

    elapsed = measured["elapsed_s"]
    return {
        "instances": args.instances,
        "requests": args.requests,
        "worker_procs": args.worker_procs,
        "step_ms": args.step_ms,
        "gen_length": args.gen_length,
        "gen_length_spread": args.gen_length_spread,
        "warmup_s": args.warmup,
        "duration_s": round(elapsed, 2),
        "overhead_ms": _percentiles_ms(measured["gaps_s"]),
        # the steps that waited for a command from the scheduler (not pipelined): the round trip itself,
        # or a held command that came after the step it follows had ended
        "overhead_round_trip_ms": _percentiles_ms(measured["round_trip_gaps_s"]),
        "pipelined_share": measured["pipelined"] / max(measured["commands"], 1),
        # steps that waited for a held command, sent before the step they follow ended (no pass between)
        "late_held_share": measured["late"] / max(measured["commands"], 1),
        # of the pipelined steps, those run as a repeat of the command before (none had come in time)
        "repeated_share": measured["repeated"] / max(measured["commands"], 1),
        "worker_nice": args.worker_nice,
        # the accelerator's idle time while work is there: the share of each instance's measured wall
        # time in which it held requests but ran no step (results out, next step not started), summed
        "gpu_idle_share": measured["idle_s"] / max(measured["instance_s"], 1e-9),
        # where the overhead goes (wall clocks of the two processes, same machine): results published
        # -> the scheduler issues the next command (results hop, decode, scheduling pass, dispatch);
        # command issued -> it reaches the worker (outbox, command hop, the worker's loop)
        "breakdown_ms": {"results_to_command_issued_p50": _p50_ms(measured["to_issue_s"]),
                         "command_flight_p50": _p50_ms(measured["flight_s"])},
        "event_loop": event_loop_name(),
        "floor_ms": {"nats_rtt": float(np.percentile(nats_rtt, 50) * 1000), "redis_rtt": float(np.percentile(redis_rtt, 50) * 1000),
                     "nats_rtt_p99": float(np.percentile(nats_rtt, 99) * 1000),
                     "redis_rtt_p99": float(np.percentile(redis_rtt, 99) * 1000)},
        "floor_under_load_ms": {"nats_rtt": _p50_ms(loaded_nats_rtt), "redis_rtt": _p50_ms(loaded_redis_rtt),
                                "samples": len(loaded_nats_rtt)},
        "steps_per_s": measured["request_steps"] / elapsed,
        "commands_per_s": measured["commands"] / elapsed,
        "mean_batch": measured["request_steps"] / max(measured["commands"], 1),
        "requests_finished": in_flight["done"],
        "scheduler_counters": dict(scheduler.counters),
    }


def _percentiles_ms(values_s: list[float]) -> dict:
    ms = np.array(values_s) * 1000.0
    if not ms.size:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan"), "samples": 0}
    return {"p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99)), "mean": float(ms.mean()), "samples": int(ms.size)}


def _p50_ms(values: list[float]) -> float:
    return float(np.percentile(values, 50) * 1000) if values else float("nan")


async def control_all(client, subject: str, command: bytes, num_procs: int, timeout_s: float = 30.0) -> list[bytes]:
    """Send a control command to every worker process; their replies (one each)."""
    inbox = client.new_inbox()
    replies: list[bytes] = []
    got_all = asyncio.Event()

    async def on_reply(msg):
        replies.append(msg.data)
        if len(replies) == num_procs:
            got_all.set()

    sub = await client.subscribe(inbox, cb=on_reply)
    await client.publish(subject, command, reply=inbox)
    try:
        await asyncio.wait_for(got_all.wait(), timeout_s)
    finally:
        await sub.unsubscribe()
    return replies


async def scheduler_ready(scheduler, instances: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(scheduler.view.instances) < instances:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(scheduler.view.instances)} of {instances} instances joined")
        await asyncio.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", type=int, default=16)
    p.add_argument("--requests", type=int, default=256, help="requests kept in flight")
    p.add_argument("--max-batch", type=int, default=64, help="most requests per step on one instance")
    p.add_argument("--gen-length", type=int, default=256, help="steps per request (the fake commits one token a step)")
    p.add_argument("--worker-procs", type=int, default=2,
                   help="processes the instances are spread over (in production each instance is its own process; "
                        "one asyncio loop for all of them queues each command behind the others' steps)")
    p.add_argument("--worker-nice", type=int, default=10,
                   help="CPU priority the worker processes give up (nice, 0-19). They stand in for accelerator hosts, "
                        "whose CPUs the scheduler does not share in a deployment; on one machine they yield to the "
                        "control plane when both want a core (0: equal)")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="accelerator time per step: the step waits this long with the CPU free (0: none)")
    p.add_argument("--gen-length-spread", type=float, default=0.5,
                   help="each request's length is drawn uniformly within this fraction of --gen-length (0: all equal, "
                        "so the requests of an instance move in lockstep)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds before measuring (default: 1.5 request lifetimes at --step-ms, at least 3, so that "
                        "the first wave of requests has turned over)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request lengths")
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--json", default=None)
    p.add_argument("--workers-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nats", help=argparse.SUPPRESS)
    p.add_argument("--redis", help=argparse.SUPPRESS)
    p.add_argument("--prefix", help=argparse.SUPPRESS)
    p.add_argument("--first-instance", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0 <= args.gen_length_spread < 1:
        p.error("--gen-length-spread must be in [0, 1)")
    if not 0 <= args.worker_nice <= 19:
        p.error("--worker-nice must be in [0, 19]")
    if args.warmup is None:
        args.warmup = max(3.0, 1.5 * args.gen_length * args.step_ms / 1000.0)
    if args.workers_only:
        run(run_workers(args))
        return 0

    from services.stack import Stack, start_nats, start_redis

    prefix = f"cp{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp))
        nats_url, redis_url = f"nats://127.0.0.1:{free_port()}", f"redis://127.0.0.1:{free_port()}/0"
        try:
            start_nats(stack, nats_url)
            start_redis(stack, redis_url)
            env = dict(os.environ, OMP_NUM_THREADS="1")
            args.worker_procs = max(1, min(args.worker_procs, args.instances))
            workers = []
            for k in range(args.worker_procs):  # instances spread evenly over the processes
                first = k * args.instances // args.worker_procs
                count = (k + 1) * args.instances // args.worker_procs - first
                worker_argv = [sys.executable, "-m", "bench.control_plane", "--workers-only", "--instances",
                               str(count), "--first-instance", str(first), "--max-batch", str(args.max_batch),
                               "--step-ms", str(args.step_ms), "--nats", nats_url, "--redis", redis_url,
                               "--prefix", prefix]
                workers.append(subprocess.Popen(worker_argv, env=env, stdout=subprocess.PIPE, text=True,
                                                preexec_fn=functools.partial(os.nice, args.worker_nice)))
            for proc in workers:
                if "workers ready" not in (proc.stdout.readline() or ""):
                    raise RuntimeError("a worker process did not start")
            report = run(run_scheduler_and_load(args, nats_url, redis_url, prefix))
            for proc in workers:
                proc.wait(30)
        finally:
            for proc in locals().get("workers", []):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
            stack.stop()
    floor = report["floor_ms"]
    report["overhead_over_floor"] = report["overhead_ms"]["p50"] / (3 * floor["nats_rtt"] + floor["redis_rtt"])
    loaded = report["floor_under_load_ms"]
    report["overhead_over_floor_under_load"] = report["overhead_ms"]["p50"] / (3 * loaded["nats_rtt"] + loaded["redis_rtt"])
    emit_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
