"""Markdown tables from ``dls compare --json`` files: ``python -m sim.report FILE...``."""

from __future__ import annotations

import json
import sys


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _num(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(result: dict) -> str:
    setup = result["setup"]
    trace = setup.get("trace")
    source = (f", trace `{trace['path']}` ({trace['layout']}, {trace['num_requests']} requests; req/s = the replayed "
              "mean rate = trace native req/s x scale)" if trace else "")
    profile = setup.get("profile")
    timed = (f", profile `{profile['path']}` ({'measured' if profile['measured'] else 'modelled'}"
             + (f"; TP-{', TP-'.join(map(str, profile['derived_tp']))} derived" if profile["derived_tp"] else "")
             + ")" if profile else "")
    lines = [
        f"**{result['preset']}** (SLO {setup['slo_s']:.2f} s, nominal capacity {setup['nominal_capacity_rps']:.2f} req/s, "
        f"cache {setup.get('cache_mode', '?')}, predictions: {setup.get('prediction_source_used', '?')}{timed}{source})",
        "",
        "| policy | point | req/s |" + (" trace native req/s | scale |" if trace else "")
        + " SLO attainment % | accuracy % | mean latency s | p99 latency s | mean threshold |",
        "|---|---|---:|" + ("---:|---:|" if trace else "") + "---:|---:|---:|---:|---:|",
    ]
    for label, entry in result["policies"].items():
        for p in entry["points"]:
            scaled = f" {_num(p.get('trace_native_rps'))} | {_num(p.get('scale'))} |" if trace else ""
            lines.append(
                f"| {label} | {p['label']} | {p['rps']:.2f} |{scaled} {_pct(p['slo_attainment'])} | {_pct(p['accuracy'])} | "
                f"{_num(p['mean_latency_s'])} | {_num(p['p99_latency_s'])} | {_num(p['mean_threshold'])} |"
            )
    fidelity = result.get("fidelity")
    if fidelity:
        lines += [
            "",
            f"Fidelity (replay vs model in the loop, largest gap over the sweep): SLO attainment "
            f"{fidelity['slo_attainment_gap_pp']:.2f} pp, mean latency {fidelity['mean_latency_gap_pct']:.2f}% "
            f"(targets 3 pp / 5%: {'met' if fidelity['within_targets'] else 'not met'}).",
            "",
            "| policy | req/s | SLO % replay / model | mean latency s replay / model | accuracy % replay / model |",
            "|---|---:|---:|---:|---:|",
        ]
        for row in fidelity["points"]:
            r, m = row["replay"], row["model"]
            lines.append(
                f"| {row['policy']} | {row['rps']:.2f} | {_pct(r['slo_attainment'])} / {_pct(m['slo_attainment'])} | "
                f"{_num(r['mean_latency_s'])} / {_num(m['mean_latency_s'])} | {_pct(r['accuracy'])} / {_pct(m['accuracy'])} |"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    for path in argv:
        with open(path) as handle:
            print(table(json.load(handle)))
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
