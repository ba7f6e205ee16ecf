"""The Python side of ``scripts/gpu-stack-check.sh``: what the live stack must answer, the checks through
the official ``openai`` SDK, the worker's metrics, and the report.

    python -m bench.gpu_stack expect --json EXPECTED                     # the CPU engine's answers
    python -m bench.gpu_stack sdk --url URL --expected EXPECTED --json SDK
    python -m bench.gpu_stack scrape --metrics-base PORT --out FILE        # the node agent's /metrics
    python -m bench.gpu_stack report --dir OUT                             # OUT/report.json, OUT/report.md

``expect`` decodes held-out task prompts (sums, word lists, one long chain) with the bundled model on
the CPU at threshold 0.9 (``DLMEngine.generate``); ``sdk`` asks the live stack the same prompts as
completions, as chat and as a stream, each pinned to 0.9 (``min_threshold``), and compares the text:
a GPU stack must answer what the CPU engine answers. ``report`` gathers what the script left in its
folder: the machine, the stack's start, the SDK checks, each ``dls loadgen`` run (TTFT, ITL, tokens
per forward, SLO attainment; ``--timelines``: the forwards' time) and the workers' step times over
each run (the difference of ``dls_worker_step_seconds`` and ``dls_tokens_per_forward`` between the
scrapes before and after it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

from bench.common import emit_json

THRESHOLD = 0.9
PROBLEM_SEED = 4040
# (family, how many, max_tokens): short answers on a 64-token cap, one chain on the longest canvas
PROBLEMS = (("add", 2, 64), ("words", 2, 64), ("chain", 1, 128))
WORKER_HISTOGRAMS = ("dls_worker_step_seconds", "dls_tokens_per_forward")


# --- expect: the CPU engine's answers -------------------------------------------------------------


def expected_answers(model_dir: str) -> list[dict]:
    """Held-out prompts and what the bundled model on the CPU answers at 0.9."""
    from services.worker.engine.engine import DLMEngine
    from shared.tasks import Family, Split, TaskGenerator, check_answer

    engine = DLMEngine.from_pretrained(model_dir, device="cpu")
    tasks = TaskGenerator(seed=PROBLEM_SEED)
    out = []
    for family, count, max_tokens in PROBLEMS:
        for n in range(count):
            problem = tasks.problem(n % 3, Split.HELD_OUT, Family(family))
            answer = engine.generate(problem.prompt, threshold=THRESHOLD, max_tokens=max_tokens)
            out.append({"family": family, "prompt": problem.prompt, "max_tokens": max_tokens, "answer": answer.text,
                        "correct": check_answer(problem, answer.text), "steps": answer.num_steps})
    return out


# --- sdk: the live stack through the official SDK ------------------------------------------------


def sdk_checks(url: str, expected: list[dict], model: str, api_key: str) -> dict:
    """Completions, chat and one stream against the expected answers; each check's outcome and time."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=120)
    pinned = {"min_threshold": THRESHOLD}  # every step at 0.9, as the CPU answers were made
    checks = []
    for item in expected:
        prompt, cap = item["prompt"], item["max_tokens"]
        checks.append(_timed("completion", item, lambda p=prompt, c=cap: client.completions.create(
            model=model, prompt=p, max_tokens=c, extra_body=pinned).choices[0].text))
        checks.append(_timed("chat", item, lambda p=prompt, c=cap: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], max_completion_tokens=c,
            extra_body=pinned).choices[0].message.content))
    streamed = expected[-1]
    checks.append(_timed("stream", streamed, lambda: _streamed(client, model, streamed, pinned)))
    return {"threshold": THRESHOLD, "num_checks": len(checks), "num_failed": sum(not c["ok"] for c in checks),
            "first_request_s": checks[0]["latency_s"], "checks": checks}


def _streamed(client, model: str, item: dict, pinned: dict) -> str:
    chunks = client.completions.create(model=model, prompt=item["prompt"], max_tokens=item["max_tokens"],
                                       stream=True, stream_options={"include_usage": True}, extra_body=pinned)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _timed(kind: str, item: dict, call) -> dict:
    started = time.perf_counter()
    try:
        got, error = call(), None
    except Exception as exc:  # noqa: BLE001 (the report says what failed, the run goes on)
        got, error = None, f"{type(exc).__name__}: {exc}"
    return {"kind": kind, "family": item["family"], "expected": item["answer"], "got": got, "error": error,
            "ok": got == item["answer"], "latency_s": round(time.perf_counter() - started, 4)}


# --- scrape and report ------------------------------------------------------------------------------


METRICS_PORTS = 16  # dls up's services, then the node agent's workers (agent port + 1 + slot)


def free_ports() -> tuple[int, int, int, int]:
    """(gateway, NATS, Redis, a metrics base with ``METRICS_PORTS`` free ports from it), all free now."""
    from shared.runtime import free_port, free_port_range

    taken = set()

    def fresh() -> int:
        while (port := free_port()) in taken:
            pass
        taken.add(port)
        return port

    gateway, nats, redis = fresh(), fresh(), fresh()
    return gateway, nats, redis, free_port_range(METRICS_PORTS, avoid=taken)


def node_agent_metrics_url(metrics_base: int) -> str:
    """Where ``dls up``'s node agent serves its /metrics (its workers' series included)."""
    from services.stack import SERVICES

    return f"http://127.0.0.1:{metrics_base + SERVICES.index('node_agent')}/metrics"


def worker_histograms(text: str) -> dict[str, dict[str, float]]:
    """``{name: {"sum": s, "count": n}}`` of the worker histograms, summed over workers."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {name: {"sum": 0.0, "count": 0.0} for name in WORKER_HISTOGRAMS}
    for family in text_string_to_metric_families(text):
        if family.name not in out:
            continue
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                out[family.name]["sum"] += sample.value
            elif sample.name.endswith("_count"):
                out[family.name]["count"] += sample.value
    return out


def _delta(before: dict, after: dict, name: str) -> float | None:
    count = after[name]["count"] - before[name]["count"]
    return (after[name]["sum"] - before[name]["sum"]) / count if count else None


def _ms(value: float | None) -> float | None:
    return None if value is None else round(1000.0 * value, 3)


def load_row(load: dict, before: dict, after: dict) -> dict:
    """One ``dls loadgen`` run and the worker metrics over it."""
    plane = load.get("control_plane") or {}
    return {
        "rate_rps": load["config"]["rate"], "completed": load["completed"], "failed": load["failed"],
        "slo_attainment": load["slo_attainment"], "accuracy": load["accuracy"],
        "mean_ttft_ms": load.get("mean_ttft_ms"), "p99_ttft_ms": load.get("p99_ttft_ms"),
        "mean_itl_ms": load.get("mean_itl_ms"), "p99_itl_ms": load.get("p99_itl_ms"),
        "mean_e2el_ms": load.get("mean_e2el_ms"), "mean_tokens_per_step": load.get("mean_tokens_per_step"),
        "mean_threshold": load.get("mean_threshold"), "mean_forward_ms": plane.get("mean_forward_ms"),
        "control_plane_mean_ms": plane.get("mean_ms"),
        "worker_mean_step_ms": _ms(_delta(before, after, "dls_worker_step_seconds")),
        "worker_steps": after["dls_worker_step_seconds"]["count"] - before["dls_worker_step_seconds"]["count"],
        "worker_tokens_per_forward": _delta(before, after, "dls_tokens_per_forward"),
    }


def build_report(out_dir: Path) -> dict:
    """Everything the script left in ``out_dir``, in one object (missing pieces are ``None``)."""
    def read(name: str):
        path = out_dir / name
        return json.loads(path.read_text()) if path.exists() else None

    runs = []
    rates = sorted((p for p in out_dir.glob("load-*.json")), key=lambda p: int(p.stem.split("-")[1]))
    for index, path in enumerate(rates, start=1):
        before, after = (out_dir / f"metrics-{index - 1}.txt", out_dir / f"metrics-{index}.txt")
        if not (before.exists() and after.exists()):
            continue
        runs.append(load_row(json.loads(path.read_text()), worker_histograms(before.read_text()),
                             worker_histograms(after.read_text())))
    sdk = read("sdk.json")
    status = read("status.json") or {}
    ok = bool(sdk) and sdk["num_failed"] == 0 and bool(runs) and all(r["failed"] == 0 for r in runs)
    return {"ok": ok, "status": status, "machine": read("machine.json"), "sdk": sdk, "loads": runs}


def render_markdown(report: dict) -> str:
    machine, status, sdk = report["machine"] or {}, report["status"], report["sdk"]
    lines = ["# GPU stack check\n", f"Verdict: {'passed' if report['ok'] else 'FAILED'}.\n",
             f"- machine: {machine.get('gpu', '?')}, torch {machine.get('torch', '?')}, Python "
             f"{machine.get('python', '?')}, device `{status.get('device', '?')}`",
             f"- `dls up --device {status.get('device', '?')} --workers 1` ready in {status.get('ready_s', '?')} s "
             f"(the worker warms its engine up before it is READY)"]
    if sdk:
        lines.append(f"- the official `openai` SDK, at threshold {sdk['threshold']}: {sdk['num_checks'] - sdk['num_failed']}"
                     f" of {sdk['num_checks']} answers (completions, chat, a stream) equal the CPU engine's; the first "
                     f"request took {sdk['first_request_s']} s")
        lines += [f"  - FAILED {c['kind']} ({c['family']}): expected {c['expected']!r}, got {c['got']!r}"
                  + (f" ({c['error']})" if c["error"] else "") for c in sdk["checks"] if not c["ok"]]
    lines += ["", "| req/s | completed / failed | SLO % | accuracy % | TTFT mean / p99 ms | ITL mean / p99 ms "
              "| tokens per forward | forward ms (timelines) | worker step ms (metrics) | worker steps |",
              "|---:|---|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in report["loads"]:
        lines.append(f"| {r['rate_rps']:g} | {r['completed']} / {r['failed']} | {_pct(r['slo_attainment'])} | "
                     f"{_pct(r['accuracy'])} | {_num(r['mean_ttft_ms'])} / {_num(r['p99_ttft_ms'])} | "
                     f"{_num(r['mean_itl_ms'])} / {_num(r['p99_itl_ms'])} | {_num(r['mean_tokens_per_step'], 2)} | "
                     f"{_num(r['mean_forward_ms'], 2)} | {_num(r['worker_mean_step_ms'], 2)} | {r['worker_steps']:.0f} |")
    return "\n".join(lines) + "\n"


def _num(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_stack", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("expect", help="the CPU engine's answers to the check's prompts")
    p.add_argument("--model", default="models/dls-tiny")
    p.add_argument("--json", required=True)
    p = sub.add_parser("sdk", help="completions, chat and a stream through the openai SDK against EXPECTED")
    p.add_argument("--url", required=True)
    p.add_argument("--expected", required=True)
    p.add_argument("--model", default="dls-tiny")
    p.add_argument("--api-key", default="unused")
    p.add_argument("--json", required=True)
    p = sub.add_parser("scrape", help="the node agent's /metrics (its workers' series) into a file")
    p.add_argument("--metrics-base", type=int, required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("report", help="report.json and report.md from what the script left in DIR")
    p.add_argument("--dir", required=True)
    sub.add_parser("ports", help="free ports: gateway, NATS, Redis, and a base with room for every /metrics")
    args = parser.parse_args(argv)
    if args.command == "ports":
        print(*free_ports())
        return 0
    if args.command == "expect":
        emit_json({"answers": expected_answers(args.model)}, args.json)
        return 0
    if args.command == "sdk":
        result = sdk_checks(args.url, json.loads(Path(args.expected).read_text())["answers"], args.model, args.api_key)
        emit_json(result, args.json)
        return 1 if result["num_failed"] else 0
    if args.command == "scrape":
        with urllib.request.urlopen(node_agent_metrics_url(args.metrics_base), timeout=10) as reply:
            Path(args.out).write_text(reply.read().decode())
        return 0
    out_dir = Path(args.dir)
    report = build_report(out_dir)
    (out_dir / "report.md").write_text(render_markdown(report))
    emit_json(report, out_dir / "report.json")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
