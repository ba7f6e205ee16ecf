"""The load run's figure (PNG): latency over the run against the SLO, SLO attainment over time, the
thresholds the scheduler chose, and the TTFT / E2E distributions."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot_report(report: dict, path: str | Path, window_s: float = 10.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.get("requests") or []
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0][0]
    for label, colour, keep in (("within SLO", "tab:green", lambda r: r["slo_met"]),
                                ("SLO missed", "tab:red", lambda r: not r["slo_met"] and r["status"] == 200)):
        xs = [r["arrival_s"] for r in rows if keep(r) and r["e2el_ms"] is not None]
        ys = [r["e2el_ms"] / 1000 for r in rows if keep(r) and r["e2el_ms"] is not None]
        ax.scatter(xs, ys, s=8, c=colour, label=label)
    failed = [r["arrival_s"] for r in rows if r["status"] != 200]
    if failed:
        ax.scatter(failed, [0] * len(failed), marker="x", c="black", s=14, label="failed")
    slos = sorted({r["slo_ms"] for r in rows if r["slo_ms"]})
    for slo in slos[:4]:
        ax.axhline(slo / 1000, ls="--", c="grey", lw=0.8)
    ax.set(xlabel="arrival (s)", ylabel="E2E latency (s)", title="latency (dashed: SLO)")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    if rows:
        arrivals = np.array([r["arrival_s"] for r in rows])
        met = np.array([bool(r["slo_met"]) for r in rows])
        edges = np.arange(0.0, arrivals.max() + window_s, window_s)
        centres, values = [], []
        for lo in edges:
            inside = (arrivals >= lo) & (arrivals < lo + window_s)
            if inside.any():
                centres.append(lo + window_s / 2)
                values.append(100 * met[inside].mean())
        ax.plot(centres, values, marker="o")
    ax.set(xlabel="arrival (s)", ylabel="SLO attainment (%)", ylim=(-5, 105),
           title=f"SLO attainment per {window_s:g} s of arrivals")

    ax = axes[1][0]
    used = report.get("thresholds_used") or {}
    ax.bar(list(used), list(used.values()), color="tab:blue")
    ax.set(xlabel="threshold", ylabel="steps", title=f"thresholds used (mean {report.get('mean_threshold') or 0:.2f})")

    ax = axes[1][1]
    for key, label in (("ttft_ms", "TTFT (first block)"), ("e2el_ms", "E2E")):
        values = np.sort([r[key] / 1000 for r in rows if r[key] is not None and r["status"] == 200])
        if values.size:
            ax.plot(values, np.arange(1, values.size + 1) / values.size, label=label)
    ax.set(xlabel="seconds", ylabel="fraction of requests", title="latency CDF")
    ax.legend(fontsize=8)

    def pct(v):
        return "n/a" if v is None else f"{100 * v:.1f}%"

    fig.suptitle(f"dls loadgen: {report['completed']}/{report['num_requests']} completed, "
                 f"SLO attainment {pct(report['slo_attainment'])}, accuracy {pct(report['accuracy'])}, "
                 f"{report['request_throughput']:.2f} req/s")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
