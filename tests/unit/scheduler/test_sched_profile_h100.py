"""The modelled LLaDA-8B / H100 profile: up to date with its generator, loadable, paper-shaped."""

from __future__ import annotations

import importlib.util

from shared.profiles import LatencyProfile
from tests.unit.scheduler.sched_builders import H100_PROFILE, REPO


def load_generator():
    spec = importlib.util.spec_from_file_location("model_h100", REPO / "profiles" / "model_h100.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_json_matches_its_generator():
    generator = load_generator()
    assert H100_PROFILE.read_text() == generator.render(generator.build_profile())


def test_profile_loads_with_all_degrees_and_batches(h100: LatencyProfile):
    assert h100.tp_degrees == (1, 2, 4, 8)
    assert not h100.measured and h100.context_tokens == 512 and h100.block_length == 32
    for tp in h100.tp_degrees:
        assert h100.max_batch(tp) == 32
        for batch in (1, 2, 4, 8, 16, 32):
            assert 0 < h100.beta(tp, batch) < h100.alpha(tp, batch)
            assert h100.full(tp, batch) == h100.alpha(tp, batch)  # no separate full_ms: recompute stands in


def test_tp_scaling_follows_the_paper(h100: LatencyProfile):
    base = h100.alpha(1, 1)
    assert abs(h100.alpha(2, 1) / base - 0.75) < 0.01
    assert abs(h100.alpha(4, 1) / base - 0.45) < 0.01
    assert h100.alpha(8, 1) < h100.alpha(4, 1)
    # per GPU, TP-1 has the most throughput: the trade-off the placer and reconfigurator use
    per_gpu = {tp: h100.token_steps_per_s(tp, 32) / tp for tp in h100.tp_degrees}
    assert per_gpu[1] > per_gpu[2] > per_gpu[4] > per_gpu[8]


def test_latency_grows_with_batch_and_interpolates(h100: LatencyProfile):
    for tp in h100.tp_degrees:
        values = [h100.alpha(tp, b) for b in (1, 2, 4, 8, 16, 32)]
        assert values == sorted(values)
    mid = h100.alpha(1, 3)
    assert h100.alpha(1, 2) < mid < h100.alpha(1, 4)


def test_optional_full_step_curve():
    data = {
        "model": "m",
        "device": "d",
        "tp": {"1": {"recompute_ms": {"1": 10}, "cache_ms": {"1": 2}, "full_ms": {"1": 9}}},
    }
    profile = LatencyProfile.from_dict(data)
    assert profile.full(1, 1) == 0.009 and profile.alpha(1, 1) == 0.01
