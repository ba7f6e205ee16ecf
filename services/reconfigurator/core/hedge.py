"""The hedge of a division of GPUs between models: how much of the cluster's load each model is
planned to be able to take, beyond its own.

A division made for the loads of the last window alone leaves a model that is light now with the
few GPUs its load needs. When the mix flips (its load grows several-fold in seconds), its GPUs come
back only after a planning period and a switch (a cold load of an 8B model is 30-100 s), and the
backlog built meanwhile takes minutes to drain: on the ``multi-model`` preset at 1.2x a balanced
static split kept 98% inside their SLOs and the division that followed the load 89%.

So while the GPUs allow, every model with load is planned as if it had at least ``s`` of the
cluster's arrivals (``s`` x the total rate, in its own requests: its classes' rates scaled up, its
mix kept), with ``s`` the largest share up to ``max_share`` at which every model's plan still fits
at the lowest thresholds within its SLOs (``stage1._gpus_needed``: the most GPU-efficient option of
every class at the utilisation target; a load that may come costed without the margins a measured one
is planned with, the safety buffer and the utilisation target, since for the minutes a move takes load
control carries it at full utilisation). Where the models' own loads already fill the cluster, ``s``
is 0 and the division follows the load alone, as in overload it must: a hedge there would take GPUs
from a model that needs them now for one that may need them later.

A model without load (scaled to zero, or held at its minimum) is not hedged: it has no requests to
scale, and its first arrival starts an instance. One model alone: nothing to hedge against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from .spec import Cluster, ModelDemand
from .stage1 import Stage1Options, _gpus_needed, precompute_model

DEFAULT_MAX_SHARE = 1.0  # each model ready for up to all of the cluster's arrivals, as far as the GPUs allow


@dataclass(frozen=True)
class Hedge:
    """What ``hedge_demands`` decided: the share ``s`` and each model's rate scale (1: its own load)."""

    share: float
    scales: dict[str, float]

    def describe(self) -> str:
        scaled = ", ".join(f"{name} x{scale:.2f}" for name, scale in self.scales.items() if scale > 1.0)
        return f"hedge {self.share:.2f} of the arrivals" + (f" ({scaled})" if scaled else " (every model at its own load)")


def hedge_demands(demands: Sequence[ModelDemand], cluster: Cluster, options: Stage1Options,
                  max_share: float = DEFAULT_MAX_SHARE) -> tuple[list[ModelDemand], Hedge]:
    """``demands`` with each loaded model's rates scaled to at least ``s`` x the total rate (see the
    module's docstring), and the hedge chosen. The minimums of models without load (at their smallest
    degree) are outside what the hedge may plan for."""
    loaded = [d for d in demands if d.has_load]
    if max_share <= 0 or not loaded or len(demands) < 2:
        return list(demands), Hedge(0.0, {d.name: 1.0 for d in demands})
    rates = {d.name: d.workload.total_rate for d in loaded}
    total = sum(rates.values())
    needed = {d.name: _gpus_needed(precompute_model(d, cluster, options), options.max_utilization) for d in loaded}
    smallest = min(cluster.tp_degrees)
    budget = cluster.num_gpus - sum(d.min_instances * min(d.tp_degrees or (smallest,)) for d in demands if not d.has_load)

    # a load that may come is costed without the margins a measured one is planned with (its safety
    # buffer, the utilisation target): for the minutes a move takes, load control carries it at full
    # utilisation; ``margins`` turns its rate into the planned rate that costs the same GPUs
    margins = {d.name: options.max_utilization / (1.0 + d.workload.safety_buffer) for d in loaded}

    def scales_at(share: float) -> dict[str, float]:
        return {name: max(1.0, share * total * margins[name] / rate) if rate > 0 else 1.0
                for name, rate in rates.items()}

    def fits(share: float) -> bool:
        scales = scales_at(share)
        return sum(needed[name] * scales[name] for name in needed) <= budget

    if not fits(0.0):
        share = 0.0
    elif fits(max_share):
        share = max_share
    else:  # GPUs needed grow with the share: bisect for the largest that fits
        lo, hi = 0.0, max_share
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        share = lo
    scales = scales_at(share)
    out = [dataclasses.replace(d, workload=d.workload.with_rate_scale(scales[d.name])) if scales.get(d.name, 1.0) > 1.0
           else d for d in demands]
    return out, Hedge(share, {d.name: scales.get(d.name, 1.0) for d in demands})
