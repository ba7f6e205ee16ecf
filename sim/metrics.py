"""Per-request records and the summaries a run reports."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class SimRequestRecord:
    """What the simulator recorded of one request (the live system's record is ``shared.state.RequestRecord``)."""

    request_id: str
    arrival_s: float
    slo_s: float
    slo_class: str
    finish_s: float | None = None
    rejected: bool = False
    correct: bool = False
    num_steps: int = 0
    num_migrations: int = 0
    num_preemptions: int = 0  # times it yielded its KV memory
    threshold_sum: float = 0.0  # sum over steps of the step's threshold
    first_step_s: float | None = None  # when its first step started
    migration_s: float = 0.0  # time its steps spent loading its state after a move

    @property
    def latency_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def met_slo(self) -> bool:
        return self.finish_s is not None and not self.rejected and self.finish_s - self.arrival_s <= self.slo_s + 1e-9


@dataclass
class Timeline:
    """Samples over virtual time: configuration, thresholds, load."""

    times: list[float] = field(default_factory=list)
    instances_by_tp: list[dict[int, int]] = field(default_factory=list)  # tp degree -> instances
    mean_threshold: list[float | None] = field(default_factory=list)  # over steps since the last sample
    arrivals_rps: list[float] = field(default_factory=list)
    gpus_by_model: list[dict[str, int]] = field(default_factory=list)  # several models: GPUs each holds

    def to_json(self) -> dict:
        out = {
            "time_s": [round(t, 3) for t in self.times],
            "instances_by_tp": [{str(k): v for k, v in sorted(d.items())} for d in self.instances_by_tp],
            "mean_threshold": [None if t is None else round(t, 4) for t in self.mean_threshold],
            "arrivals_rps": [round(r, 3) for r in self.arrivals_rps],
        }
        if self.gpus_by_model:
            out["gpus_by_model"] = self.gpus_by_model
        return out


def summarize(records: list[SimRequestRecord]) -> dict:
    """SLO attainment (rejected and unfinished count as misses), accuracy over finished requests,
    latency over finished requests."""
    n = len(records)
    classes = sorted({r.slo_class for r in records})
    finished = [r for r in records if r.finish_s is not None and not r.rejected]
    latencies = np.array([r.latency_s for r in finished]) if finished else np.zeros(0)
    steps = sum(r.num_steps for r in records)
    return {
        "num_requests": n,
        "num_finished": len(finished),
        "num_rejected": sum(r.rejected for r in records),
        "slo_attainment": sum(r.met_slo for r in records) / n if n else math.nan,
        "accuracy": sum(r.correct for r in finished) / len(finished) if finished else math.nan,
        "mean_latency_s": float(latencies.mean()) if len(latencies) else math.nan,
        "p50_latency_s": float(np.percentile(latencies, 50)) if len(latencies) else math.nan,
        "p99_latency_s": float(np.percentile(latencies, 99)) if len(latencies) else math.nan,
        "mean_steps": steps / n if n else math.nan,
        "mean_threshold": sum(r.threshold_sum for r in records) / steps if steps else math.nan,
        "num_migrations": sum(r.num_migrations for r in records),
        "num_preemptions": sum(r.num_preemptions for r in records),
        **({"slo_attainment_by_class": _by_class(records, classes)} if len(classes) > 1 else {}),
    }


def breakdown(records: list[SimRequestRecord], reconfiguration_instance_s: float) -> dict:
    """Where a run's time went beyond the steps themselves, per request (means over every request):
    waiting for the first step (``queueing_s``), state copies after moves (``migration_s``), and
    the instance-seconds plans kept out of service (starting up, draining), spread over the requests
    (``reconfiguration_s``); plus the mean threshold of the steps run."""
    n = len(records)
    steps = sum(r.num_steps for r in records)
    waits = [r.first_step_s - r.arrival_s for r in records if r.first_step_s is not None]
    return {
        "queueing_s": round(float(np.mean(waits)), 4) if waits else 0.0,
        "migration_s": round(sum(r.migration_s for r in records) / n, 4) if n else 0.0,
        "reconfiguration_s": round(reconfiguration_instance_s / n, 4) if n else 0.0,
        "reconfiguration_instance_s": round(reconfiguration_instance_s, 3),
        "mean_threshold": round(sum(r.threshold_sum for r in records) / steps, 4) if steps else None,
    }


def _by_class(records: list[SimRequestRecord], classes: list[str]) -> dict:
    # SLO class -> its attainment
    return {c: sum(r.met_slo for r in records if r.slo_class == c) / sum(r.slo_class == c for r in records) for c in classes}


def attainment_over_time(records: list[SimRequestRecord], bin_s: float) -> dict:
    """SLO attainment of the requests arriving in each bin."""
    if not records:
        return {"bin_s": bin_s, "slo_attainment": []}
    num_bins = int(max(r.arrival_s for r in records) // bin_s) + 1
    met, total = np.zeros(num_bins), np.zeros(num_bins)
    for r in records:
        i = int(r.arrival_s // bin_s)
        total[i] += 1
        met[i] += r.met_slo
    values = [round(float(m / t), 4) if t else None for m, t in zip(met, total, strict=True)]
    return {"bin_s": bin_s, "slo_attainment": values}
