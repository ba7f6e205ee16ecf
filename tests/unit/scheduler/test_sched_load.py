"""Algorithm 2: load control, capacity, priorities."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.core import SchedulingLoop, make_policy
from services.scheduler.core.load import (
    BACKGROUND_PRIORITY,
    LoadController,
    LoadTable,
    SloWindow,
    cache_step_weight,
    cluster_token_steps_per_s,
    instance_token_steps_per_s,
)
from tests.unit.scheduler.sched_builders import make_request, make_view

K = 6


def reference_allowed(loads, lo, hi, protected, capacity):
    """Algorithm 2 exactly as the paper states it, one request and one threshold at a time."""
    base = [row[h] if p else row[low] for row, low, h, p in zip(loads, lo, hi, protected, strict=True)]
    committed, allowed = 0.0, []
    for i, row in enumerate(loads):
        chosen = hi[i]
        if not protected[i]:
            rest = sum(base[i + 1 :])
            chosen = lo[i]
            for tau in range(hi[i], lo[i] - 1, -1):
                if committed + row[tau] + rest <= capacity:
                    chosen = tau
                    break
        allowed.append(chosen)
        committed += row[chosen]
    return allowed


def build_table(loads, lo, hi, protected, priorities=None):
    """One request per row; tokens 1 and no cache steps, so its load row is ``loads[i]``."""
    table = LoadTable(K, initial_rows=2)
    for i, row in enumerate(loads):
        request = make_request(f"r{i}", prompt_len=0, gen_len=1, priority=(priorities or [0] * len(loads))[i])
        request.seq = i
        table.upsert(request, list(map(float, row)), [0.0] * K, lo[i], hi[i], protected[i])
    return table


request_mix = st.integers(1, 40).flatmap(
    lambda n: st.tuples(
        st.lists(st.lists(st.integers(0, 50), min_size=K, max_size=K).map(sorted), min_size=n, max_size=n),
        st.lists(st.tuples(st.integers(0, K - 1), st.integers(0, K - 1)).map(sorted), min_size=n, max_size=n),
        st.lists(st.booleans(), min_size=n, max_size=n),
        st.integers(0, 1500),
    )
)


@settings(max_examples=300, deadline=None)
@given(request_mix)
def test_worst_case_load_never_exceeds_capacity(mix):
    loads, ranges, _, capacity = mix
    lo, hi = [a for a, _ in ranges], [b for _, b in ranges]
    table = build_table(loads, lo, hi, [False] * len(loads))
    worst = LoadController().run(table, float(capacity), kappa=1.0)
    floor_load = sum(row[low] for row, low in zip(loads, lo, strict=True))
    # the lowest thresholds are the least any request can run at: beyond that nothing can help
    assert worst <= max(capacity, floor_load) + 1e-9
    if floor_load <= capacity:
        assert worst <= capacity + 1e-9


@settings(max_examples=300, deadline=None)
@given(request_mix)
def test_vectorised_controller_matches_the_paper_algorithm(mix):
    loads, ranges, protected, capacity = mix
    lo, hi = [a for a, _ in ranges], [b for _, b in ranges]
    # unsorted rows too: predictions need not be monotone in the threshold
    loads = [row[::-1] if i % 3 == 0 else row for i, row in enumerate(loads)]
    table = build_table(loads, lo, hi, protected)
    LoadController().run(table, float(capacity), kappa=1.0)
    rows = [table.rid_to_row[f"r{i}"] for i in range(len(loads))]
    assert table.allowed_hi[rows].tolist() == reference_allowed(loads, lo, hi, protected, capacity)


def test_earlier_requests_keep_wider_ranges_and_priorities_go_first():
    loads = [[1, 2, 3, 4, 5, 6]] * 3
    lo, hi = [0] * 3, [5] * 3
    table = build_table(loads, lo, hi, [False] * 3)
    LoadController().run(table, capacity=10.0, kappa=1.0)
    assert [int(table.allowed_hi[table.rid_to_row[f"r{i}"]]) for i in range(3)] == [5, 2, 0]
    # the last arrival has priority 1: it is visited first and gets the widest range
    table = build_table(loads, lo, hi, [False] * 3, priorities=[0, 0, 1])
    LoadController().run(table, capacity=10.0, kappa=1.0)
    assert [int(table.allowed_hi[table.rid_to_row[f"r{i}"]]) for i in range(3)] == [2, 0, 5]


def test_top_priority_class_keeps_its_full_range_even_when_overloaded():
    loads = [[10, 20, 30, 40, 50, 60]] * 3
    table = build_table(loads, [0] * 3, [5] * 3, [False, True, False], priorities=[0, 2, 0])
    LoadController().run(table, capacity=1.0, kappa=1.0)
    assert [int(table.allowed_hi[table.rid_to_row[f"r{i}"]]) for i in range(3)] == [0, 5, 0]


def test_quality_floor_bounds_the_narrowed_range():
    table = build_table([[1, 2, 3, 4, 5, 6]], lo=[3], hi=[5], protected=[False])
    LoadController().run(table, capacity=0.0, kappa=1.0)
    assert int(table.allowed_hi[0]) == 3


def test_load_uses_context_tokens_and_weights_cache_steps():
    table = LoadTable(K)
    request = make_request("r", prompt_len=100, gen_len=28)
    table.upsert(request, [2.0] * K, [10.0] * K, 0, K - 1, False)
    loads = table.loads(np.array([0]), kappa=0.1)
    assert np.allclose(loads, 128 * (2 + 0.1 * 10))


def test_removed_rows_leave_the_controller():
    table = build_table([[1] * K, [2] * K], [0, 0], [5, 5], [False, False])
    table.remove("r0")
    assert len(table) == 1 and LoadController().run(table, 100.0, 1.0) == 2.0


def test_capacity_formula(profile):
    view = make_view(profile, [1, 2])
    # toy profile: max batch 8, alpha_1(8) = 0.17 s, alpha_2(8) = 0.102 s, 512-token contexts
    expected = 8 * 512 / 0.17 + 8 * 512 / 0.102
    assert abs(cluster_token_steps_per_s(view) - expected) < 1e-6
    assert abs(instance_token_steps_per_s(view.instances["i0"]) - 8 * 512 / 0.17) < 1e-6
    assert abs(cache_step_weight(view) - 17 / 170) < 1e-9
    view.drain_instance("i1")
    assert abs(cluster_token_steps_per_s(view) - 8 * 512 / 0.17) < 1e-6


def test_slo_window_mean_and_min():
    table = LoadTable(K)
    for i, slo in enumerate((10.0, 30.0)):
        table.upsert(make_request(f"r{i}", slo_s=slo), [1.0] * K, [0.0] * K, 0, 5, False)
    assert table.slo_window(SloWindow.MEAN) == 20.0 and table.slo_window(SloWindow.MIN) == 10.0


def test_background_work_is_outside_the_accounting():
    """A shadow decode (background priority, an hour's SLO) neither stretches the SLO window nor
    counts in the load the clients' requests are planned against; it keeps its own range."""
    table = LoadTable(K)
    for i, slo in enumerate((10.0, 30.0)):
        table.upsert(make_request(f"r{i}", slo_s=slo), [1.0] * K, [0.0] * K, 0, 5, False)
    shadow = make_request("shadow", slo_s=3600.0, priority=BACKGROUND_PRIORITY)
    table.upsert(shadow, [1000.0] * K, [0.0] * K, 5, 5, False)
    assert table.slo_window(SloWindow.MEAN) == 20.0 and table.slo_window(SloWindow.MIN) == 10.0
    loads = [[1, 2, 3, 4, 5, 6]] * 3
    plain = build_table(loads, [0] * 3, [5] * 3, [False] * 3)
    with_shadow = build_table(loads + [[50] * K], [0] * 4, [5] * 3 + [4], [False] * 4,
                              priorities=[0, 0, 0, BACKGROUND_PRIORITY])
    for table in (plain, with_shadow):
        LoadController().run(table, capacity=10.0, kappa=1.0)
    allowed = [[int(t.allowed_hi[t.rid_to_row[f"r{i}"]]) for i in range(3)] for t in (plain, with_shadow)]
    assert allowed[0] == allowed[1] == [5, 2, 0]
    assert int(with_shadow.allowed_hi[with_shadow.rid_to_row["r3"]]) == 4


def test_a_shadow_decode_does_not_lift_load_control_in_overload(profile):
    """Overloaded arrivals are narrowed alike with or without a background request in the table (its
    hour-long SLO in the mean window made the capacity ten times larger, and every new arrival went at
    the highest threshold)."""
    def tops(with_shadow: bool) -> list[float]:
        loop = SchedulingLoop(make_policy("dilaserve"), make_view(profile, [1]))
        if with_shadow:
            loop.on_arrivals(0.0, [make_request("shadow", slo_s=3600.0, priority=BACKGROUND_PRIORITY)])
        decisions = loop.on_arrivals(0.0, [make_request(f"r{i}", slo_s=2.0) for i in range(7)])
        return [a.max_allowed_threshold for a in decisions.assignments if a.request_id != "shadow"]

    plain = tops(False)
    assert plain[-1] == 0.5 and tops(True) == plain


def test_overload_narrows_ranges_seen_in_assignments(profile):
    # one toy TP-1 instance, SLO 2 s: capacity 2 s * 8 * 512 / 0.17 s = 48.2k token-steps; with the
    # fallback estimates a request needs 512 * (8 + 0.1 * 91) = 8.8k at 0.95 and 5.9k at 0.5
    loop = SchedulingLoop(make_policy("dilaserve"), make_view(profile, [1]))
    decisions = loop.on_arrivals(0.0, [make_request(f"r{i}", slo_s=2.0) for i in range(7)])
    tops = [a.max_allowed_threshold for a in decisions.assignments]
    assert tops[0] == 0.95 and tops[-1] == 0.5
    assert tops == sorted(tops, reverse=True)
    assert all(a.threshold <= a.max_allowed_threshold for a in decisions.assignments)
    policy = loop.policy
    assert policy.worst_case_load <= policy.capacity


def test_without_load_control_every_request_keeps_its_full_range(profile):
    loop = SchedulingLoop(make_policy("dilaserve-no-loadctl"), make_view(profile, [1]))
    decisions = loop.on_arrivals(0.0, [make_request(f"r{i}", slo_s=2.0) for i in range(7)])
    assert {a.max_allowed_threshold for a in decisions.assignments} == {0.95}


def test_priority_class_gets_the_wider_range_in_the_policy(profile):
    loop = SchedulingLoop(make_policy("dilaserve"), make_view(profile, [1]))
    requests = [make_request(f"r{i}", slo_s=2.0) for i in range(6)] + [make_request("vip", slo_s=2.0, priority=1)]
    decisions = loop.on_arrivals(0.0, requests)
    tops = {a.request_id: a.max_allowed_threshold for a in decisions.assignments}
    assert tops["vip"] == 0.95 and tops["vip"] > tops["r5"]


def test_fixed_slo_window_sets_the_capacity(profile):
    loop = SchedulingLoop(make_policy("dilaserve", {"slo_window": 10.0}), make_view(profile, [1]))
    loop.on_arrival(0.0, make_request("r", slo_s=2.0))
    assert abs(loop.policy.capacity - 10.0 * 8 * 512 / 0.17) < 1e-6


def _lopsided_thresholds(slo_s: float, load_aware: bool) -> float:
    """Two TP-1 instances (max batch 8): seven requests on i0, then i1 joins and one more lands there;
    the threshold Algorithm 1 gives that last request."""
    from services.scheduler.core import SchedulingLoop, make_policy
    from tests.unit.scheduler.sched_builders import make_request, make_view, toy_profile

    # Algorithm 1's choice at arrival, on the fallback estimate (not the first step's top threshold)
    loop = SchedulingLoop(make_policy("dilaserve", {"load_aware_batch": load_aware, "unpredicted_at_max": False},
                                      rng=0), make_view(toy_profile(), [1]))
    loop.on_arrivals(0.0, [make_request(f"r{k}", slo_s=600.0) for k in range(7)])
    loop.view.add_instance("i1", 1, toy_profile(), node_id="n0")  # joins after them, empty
    decisions = loop.on_arrival(0.0, make_request("last", slo_s=slo_s))
    (assignment,) = [a for a in decisions.assignments if a.request_id == "last"]
    assert assignment.instance_id == "i1"
    return assignment.threshold


def test_load_aware_batch_costs_steps_at_the_batch_the_load_brings():
    """With load control, a request alone on an instance while the other holds seven is costed at the
    batch an even spread gives (4), not at 1: never a higher threshold, and a lower one where the
    difference decides."""
    pairs = [(_lopsided_thresholds(slo / 20, True), _lopsided_thresholds(slo / 20, False)) for slo in range(20, 80)]
    assert all(aware <= unaware for aware, unaware in pairs)
    assert any(aware < unaware for aware, unaware in pairs)
