"""Figures in the style of the paper's Figures 8-12 (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path


def plot_compare(result: dict, path: str | Path) -> None:
    """SLO attainment and accuracy against request rate (Fig. 9/10/12); for a reconfiguring preset,
    configuration, threshold and attainment over time (Fig. 8/11)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = result["policies"]
    # the highest-rate point's timelines (Fig. 8 style)
    timelines = {p: v["points"][-1] for p, v in policies.items() if "timeline" in v["points"][-1]}
    if timelines:
        fig = _plot_timelines(plt, timelines)
    else:
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        for label, entry in policies.items():
            pts = entry["points"]
            xs = [p["rps"] for p in pts]
            axes[0].plot(xs, [100 * p["slo_attainment"] for p in pts], marker="o", label=label)
            axes[1].plot(xs, [100 * p["accuracy"] for p in pts], marker="o", label=label)
            axes[2].plot(xs, [p["mean_threshold"] for p in pts], marker="o", label=label)
        for ax, title in zip(axes, ("SLO attainment (%)", "accuracy (%)", "mean threshold"), strict=True):
            ax.set_xlabel("request rate (req/s)")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{result['preset']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_timelines(plt, timelines: dict):
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    first = next(iter(timelines.values()))["timeline"]
    axes[0].plot(first["time_s"], first["arrivals_rps"], color="grey")
    axes[0].set_ylabel("arrivals (req/s)")
    for label, point in timelines.items():
        tl = point["timeline"]
        if label.startswith("dilaserve"):
            for tp in sorted({int(k) for d in tl["instances_by_tp"] for k in d}):
                axes[1].step(tl["time_s"], [d.get(str(tp), 0) for d in tl["instances_by_tp"]], where="post", label=f"TP-{tp}")
        thresholds = [t if t is not None else float("nan") for t in tl["mean_threshold"]]
        axes[2].plot(tl["time_s"], thresholds, label=label)
        att = point["attainment_over_time"]
        xs = [i * att["bin_s"] for i in range(len(att["slo_attainment"]))]
        ys = [100 * v if v is not None else float("nan") for v in att["slo_attainment"]]
        axes[3].plot(xs, ys, marker=".", label=label)
    axes[1].set_ylabel("DiLaServe instances")
    axes[1].legend(fontsize=8)
    axes[2].set_ylabel("mean threshold")
    axes[2].legend(fontsize=8)
    axes[3].set_ylabel("SLO attainment (%)")
    axes[3].set_xlabel("time (s)")
    axes[3].legend(fontsize=8)
    return fig
