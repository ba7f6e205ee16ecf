"""NATS fan-out at cluster size: one scheduler round of step commands to N instances, and the results back.

One publisher connection (the scheduler) sends a ``StepCommand`` of ``--batch`` items to each of
``--instances`` subjects (``step.<instance>``), spread over ``--connections`` subscriber connections
(the workers' processes); each subscriber answers with a ``StepResults`` of the same size on the
shared ``results`` subject. Reported: the time of a whole round (the last result in) at p50/p99,
and messages per second. nats-server is started on a free port.

    python -m bench.nats_fanout --instances 1024 --json runs/bench-nats-fanout.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import emit_json


async def run(args, nats_url: str) -> dict:
    import nats

    from shared.messages import codec
    from shared.messages.base import ConfidenceStats, StepKind
    from shared.messages.steps import RequestStepResult, StepCommand, StepItem, StepResults

    sched = await nats.connect(nats_url)
    workers = [await nats.connect(nats_url) for _ in range(args.connections)]
    got = {"n": 0}
    done = asyncio.Event()

    def result_of(i: int) -> bytes:
        conf = ConfidenceStats(min=0.5, q25=0.5, median=0.5, mean=0.5, q75=0.5)
        return codec.encode(StepResults(instance_id=f"i{i}", step_id=1, results=[RequestStepResult(
            request_id=f"r{i}-{k}", kind=StepKind.CACHE, block_index=0, committed_positions=[k],
            committed_token_ids=[5], block_done=False, finished=False, num_steps=1, num_masked=100,
            confidence=conf, threshold=0.9, state_version=2) for k in range(args.batch)], failures=[],
            started_at=0.0, duration_s=0.0, num_loaded=0))

    replies = [result_of(i) for i in range(args.instances)]

    async def on_results(msg):
        got["n"] += 1
        if got["n"] == args.instances:
            done.set()

    await sched.subscribe("fan.results", cb=on_results)
    for i in range(args.instances):
        nc = workers[i % args.connections]

        async def on_cmd(msg, nc=nc, data=replies[i]):
            await nc.publish("fan.results", data)

        await nc.subscribe(f"fan.step.i{i}", cb=on_cmd)
    for nc in workers:
        await nc.flush()
    commands = [codec.encode(StepCommand(instance_id=f"i{i}", step_id=1, items=[
        StepItem(request_id=f"r{i}-{k}", threshold=0.9, state_version=1, load_state=False)
        for k in range(args.batch)], drop_request_ids=[], issued_at=0.0)) for i in range(args.instances)]
    rounds = []
    for r in range(args.rounds + 3):
        got["n"] = 0
        done.clear()
        t0 = time.perf_counter()
        for i in range(args.instances):
            await sched.publish(f"fan.step.i{i}", commands[i])
        await asyncio.wait_for(done.wait(), 60)
        if r >= 3:  # warm-up rounds left out
            rounds.append(time.perf_counter() - t0)
    for nc in (sched, *workers):
        await nc.close()
    ms = np.array(rounds) * 1000
    return {"instances": args.instances, "batch": args.batch, "connections": args.connections,
            "round_ms": {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))},
            "messages_per_s": 2 * args.instances / float(np.percentile(ms, 50)) * 1000,
            "command_bytes": len(commands[0]), "result_bytes": len(replies[0])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", type=int, default=1024)
    p.add_argument("--batch", type=int, default=10, help="requests per command (10,000 running / 1,024 ~ 10)")
    p.add_argument("--connections", type=int, default=8, help="subscriber connections the instances share")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from services.stack import Stack, start_nats
    from shared.runtime import free_port

    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp))
        nats_url = f"nats://127.0.0.1:{free_port()}"
        try:
            start_nats(stack, nats_url)
            report = asyncio.run(run(args, nats_url))
        finally:
            stack.stop()
    emit_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
