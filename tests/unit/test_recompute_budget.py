"""``LatencyProfile.recompute_token_budget``: the recompute tokens one step should carry, from where a
recompute step's throughput stops growing (the scheduling core's step budget)."""

from __future__ import annotations

from shared.profiles import LatencyProfile


def _profile(recompute_ms) -> LatencyProfile:
    batches = (1, 2, 4, 8, 16, 32)
    return LatencyProfile.from_dict({
        "model": "m", "device": "d", "context_tokens": 300, "block_length": 32,
        "tp": {"1": {"recompute_ms": {str(b): recompute_ms(b) for b in batches},
                     "cache_ms": {str(b): 10.0 + b for b in batches}}}})


def test_the_budget_is_the_batch_where_a_recompute_step_stops_gaining_throughput_times_the_context():
    compute_bound_from_4 = _profile(lambda b: max(100.0, 25.0 * b))  # 10, 20, 40, 40, 40 ... per second
    assert compute_bound_from_4.recompute_saturation(1) == 4
    assert compute_bound_from_4.recompute_token_budget(1) == 4 * 300
    memory_bound = _profile(lambda b: 100.0 + b)  # every doubling nearly doubles throughput
    assert memory_bound.recompute_saturation(1) == 32  # the profile's largest batch
    already_bound = _profile(lambda b: 100.0 * b)
    assert already_bound.recompute_saturation(1) == 1
    # a looser growth threshold saturates no later
    gentle = _profile(lambda b: 100.0 * b ** 0.9)  # doubling adds 7%
    assert gentle.recompute_saturation(1, growth=0.05) == 32 and gentle.recompute_saturation(1, growth=0.1) == 1
