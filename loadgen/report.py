"""The load run's report, in the vLLM benchmark's metric names plus DiLaServe's own.

vLLM (``benchmark_serving.py``): ``completed``, ``failed``, ``duration``, ``request_throughput``,
``request_goodput`` (= ``goodput``: completed requests per second that meet every constraint given
with ``--goodput ttft:MS tpot:MS e2el:MS``, as vLLM's ``--goodput`` defines it; without constraints,
the request's own SLO: E2E within ``slo_ms``), ``output_throughput``,
``total_input_tokens`` / ``total_output_tokens`` and, for ``ttft`` (time to first token: here the
first committed block, the first streamed chunk with text), ``tpot`` ((E2E - TTFT) / (output tokens
- 1)), ``itl`` (gaps between streamed chunks, one per committed block) and ``e2el`` (end-to-end
latency): ``mean_*_ms``, ``median_*_ms``, ``std_*_ms`` and ``p{90,95,99}_*_ms``. TTFT, TPOT and ITL
need streaming (``null`` without).

DiLaServe: ``endpoint`` (``completions`` or ``chat``), ``goodput_constraints_ms`` (the constraints,
null without), ``slo_goodput`` (requests within their own SLO per second), ``slo_attainment``
(requests that finished within their SLO over all requests sent; a failed request is a miss), per SLO
class; ``accuracy`` (correct answers over finished task prompts);
``mean_steps`` / ``median_steps`` (denoising steps per request), ``mean_tokens_per_step``,
``thresholds_used`` (step counts per threshold) and ``mean_threshold``, ``migrations``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from loadgen.driver import Result

PERCENTILES = (90, 95, 99)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # what vLLM's --goodput constrains


class GoodputError(ValueError):
    """A ``--goodput`` constraint that cannot be read; the message names it."""


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "e2el:2000"]`` -> ``{"ttft": 500.0, "e2el": 2000.0}`` (milliseconds, as vLLM's
    ``--goodput KEY:VALUE``)."""
    constraints: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_METRICS:
            raise GoodputError(f"--goodput {item!r}: expected KEY:MILLISECONDS with KEY one of "
                               f"{', '.join(GOODPUT_METRICS)}")
        try:
            constraints[key] = float(value)
        except ValueError:
            raise GoodputError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not constraints[key] > 0:
            raise GoodputError(f"--goodput {item!r}: the limit must be positive")
    return constraints


def request_tpot_s(r: Result) -> float:
    """vLLM's per-request TPOT: (E2E - TTFT) / (output tokens - 1); 0 for one output token."""
    tokens = int(r.usage.get("completion_tokens", 0))
    return (r.latency_s - r.ttft_s) / (tokens - 1) if tokens > 1 else 0.0


def meets(r: Result, constraints: dict[str, float]) -> bool:
    """A completed request within every constraint (ms); without constraints, within its own SLO."""
    if not constraints:
        return r.slo_met
    if not r.finished:
        return False
    values_s = {"ttft": r.ttft_s, "tpot": request_tpot_s(r), "e2el": r.latency_s}
    return all(math.isfinite(values_s[k]) and values_s[k] * 1000.0 <= limit for k, limit in constraints.items())


def _stats(name: str, values_s: Sequence[float]) -> dict:
    values = np.array([v for v in values_s if math.isfinite(v)], dtype=float) * 1000.0
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", *[f"p{p}_{name}_ms" for p in PERCENTILES]]
    if values.size == 0:
        return dict.fromkeys(keys)
    out = {keys[0]: float(values.mean()), keys[1]: float(np.median(values)), keys[2]: float(values.std())}
    out.update({f"p{p}_{name}_ms": float(np.percentile(values, p)) for p in PERCENTILES})
    return out


def _fraction(numerator: int, denominator: int) -> float | None:
    return numerator / denominator if denominator else None


def build_report(results: Sequence[Result], duration_s: float, *, config: dict | None = None,
                 include_requests: bool = True, goodput: dict[str, float] | None = None,
                 endpoint: str = "completions") -> dict:
    """The report of one run; ``duration_s``: from the first send to the last answer; ``goodput``: vLLM's
    constraints in ms (``parse_goodput``)."""
    duration_s = max(duration_s, 1e-9)
    finished = [r for r in results if r.finished]
    met = [r for r in results if r.slo_met]
    good = [r for r in results if meets(r, goodput or {})]
    checked = [r for r in finished if r.checkable]
    input_tokens = sum(int(r.usage.get("prompt_tokens", 0)) for r in finished)
    output_tokens = sum(int(r.usage.get("completion_tokens", 0)) for r in finished)
    thresholds = [float(t) for r in finished for t in r.usage.get("thresholds", [])]
    steps = [int(r.usage.get("steps", 0)) for r in finished]
    tpot = [request_tpot_s(r) for r in finished
            if math.isfinite(r.ttft_s) and int(r.usage.get("completion_tokens", 0)) > 1]
    itl = [b - a for r in finished for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:], strict=False)]
    statuses = Counter(r.status for r in results if not r.finished)
    report = {
        "num_requests": len(results),
        "completed": len(finished),
        "failed": len(results) - len(finished),
        "failed_statuses": {str(k): v for k, v in sorted(statuses.items())},
        "errors": sorted({r.error for r in results if r.error})[:10],
        "duration": duration_s,
        "endpoint": endpoint,
        "request_throughput": len(finished) / duration_s,
        "request_goodput": len(good) / duration_s,
        "goodput": len(good) / duration_s,
        "goodput_constraints_ms": dict(goodput) if goodput else None,
        "slo_goodput": len(met) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "slo_attainment": _fraction(len(met), len(results)),
        "slo_attainment_by_class": _by_class(results),
        "accuracy": _fraction(sum(r.correct for r in checked), len(checked)),
        "num_checked": len(checked),
        **_stats("ttft", [r.ttft_s for r in finished]),
        **_stats("tpot", tpot),
        **_stats("itl", itl),
        **_stats("e2el", [r.latency_s for r in finished]),
        "mean_steps": float(np.mean(steps)) if steps else None,
        "median_steps": float(np.median(steps)) if steps else None,
        "mean_tokens_per_step": output_tokens / sum(steps) if sum(steps) else None,
        "mean_threshold": float(np.mean(thresholds)) if thresholds else None,
        "thresholds_used": {f"{t:g}": n for t, n in sorted(Counter(thresholds).items())},
        "migrations": sum(int(r.usage.get("migrations", 0)) for r in finished),
        "mean_server_latency_ms": (float(np.mean([r.usage["latency_ms"] for r in finished if "latency_ms" in r.usage]))
                                   if any("latency_ms" in r.usage for r in finished) else None),
    }
    if config is not None:
        report["config"] = config
    if include_requests:
        report["requests"] = [_row(r) for r in results]
    return report


def _by_class(results: Sequence[Result]) -> dict:
    classes: dict[str, list[Result]] = {}
    for r in results:
        classes.setdefault(r.planned.slo_class, []).append(r)
    return {name: {"requests": len(rs), "slo_attainment": sum(r.slo_met for r in rs) / len(rs)}
            for name, rs in sorted(classes.items())}


def _ms(seconds: float) -> float | None:
    return seconds * 1000.0 if math.isfinite(seconds) else None


def _row(r: Result) -> dict:
    return {
        "request_id": r.request_id, "arrival_s": r.planned.arrival_s, "sent_s": r.sent_s if math.isfinite(r.sent_s)
        else None, "status": r.status, "slo_class": r.planned.slo_class, "slo_ms": r.slo_ms,
        "e2el_ms": _ms(r.latency_s), "ttft_ms": _ms(r.ttft_s), "slo_met": r.slo_met,
        "tpot_ms": _ms(request_tpot_s(r)) if r.finished and math.isfinite(r.ttft_s) else None,
        "correct": r.correct if r.checkable and r.finished else None, "steps": r.usage.get("steps"),
        "thresholds": r.usage.get("thresholds"), "instances": r.usage.get("instances"), "error": r.error or None,
    }


def headline(report: dict) -> str:
    """One line for the terminal."""
    def pct(v):
        return "n/a" if v is None else f"{100 * v:.1f}%"

    def ms(v):
        return "n/a" if v is None else f"{v:.0f} ms"

    return (f"completed {report['completed']}/{report['num_requests']}  SLO {pct(report['slo_attainment'])}  "
            f"accuracy {pct(report['accuracy'])}  {report['request_throughput']:.2f} req/s  "
            f"goodput {report['request_goodput']:.2f} req/s  TTFT mean {ms(report['mean_ttft_ms'])}  "
            f"E2E median {ms(report['median_e2el_ms'])} p99 {ms(report['p99_e2el_ms'])}  "
            f"steps {report['mean_steps'] if report['mean_steps'] is None else round(report['mean_steps'], 2)}")


def sweep_table(reports: Sequence[dict]) -> str:
    """One line per rate of a sweep."""
    def cell(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    lines = [f"{'rate':>8} {'done':>6} {'req/s':>7} {'goodput':>8} {'SLO':>6} {'TTFT p50':>9} {'TPOT p50':>9} "
             f"{'E2E p99':>9}"]
    for r in reports:
        slo = None if r["slo_attainment"] is None else 100 * r["slo_attainment"]
        lines.append(f"{r['rate_rps']:>8g} {r['completed']:>6} {r['request_throughput']:>7.2f} {r['goodput']:>8.2f} "
                     f"{cell(slo, '5.1f'):>5}% {cell(r['median_ttft_ms'], '7.0f'):>7}ms "
                     f"{cell(r['median_tpot_ms'], '7.1f'):>7}ms {cell(r['p99_e2el_ms'], '7.0f'):>7}ms")
    return "\n".join(lines)
