"""Builders for hand-made cluster views, requests and step results."""

from __future__ import annotations

from pathlib import Path

from services.scheduler.core import (
    BatchOutcome,
    CacheMode,
    ClusterView,
    Prediction,
    Request,
    StepOutcome,
)
from shared.profiles import LatencyProfile

REPO = Path(__file__).resolve().parents[3]
H100_PROFILE = REPO / "profiles" / "llada-8b-h100.json"


def toy_profile(max_batch: int = 8) -> LatencyProfile:
    """Round numbers: TP-1 recompute 100 ms + 10 ms per extra request, cache 10 ms + 1 ms; TP-2 is 0.6x,
    TP-4 0.4x."""
    tp = {}
    for degree, factor in ((1, 1.0), (2, 0.6), (4, 0.4)):
        tp[str(degree)] = {
            "recompute_ms": {str(b): factor * (100 + 10 * (b - 1)) for b in range(1, max_batch + 1)},
            "cache_ms": {str(b): factor * (10 + 1 * (b - 1)) for b in range(1, max_batch + 1)},
        }
    return LatencyProfile.from_dict(
        {"model": "toy", "device": "toy", "context_tokens": 512, "block_length": 32, "tp": tp}
    )


def make_view(profile: LatencyProfile, tps: list[int], **kwargs) -> ClusterView:
    view = ClusterView()
    for i, tp in enumerate(tps):
        view.add_instance(f"i{i}", tp, profile, node_id=f"n{i // 4}", **kwargs)
    return view


def make_request(rid: str, now: float = 0.0, **kwargs) -> Request:
    fields = {"prompt_len": 256, "gen_len": 256, "slo_s": 60.0, "block_len": 32, "cache_mode": CacheMode.DUAL}
    fields.update(kwargs)
    return Request(rid, now, **fields)


def uniform_prediction(steps: dict[float, tuple[int, int]], made_at_step: int = 0) -> Prediction:
    return Prediction(dict(steps), made_at_step)


def step_result(instance_id: str, *outcomes: StepOutcome) -> BatchOutcome:
    return BatchOutcome(instance_id, tuple(outcomes))


def outcome(rid: str, num: int = 1, block_done: bool = False, finished: bool = False, recompute: bool = False):
    return StepOutcome(rid, num, block_done, finished, recompute)
