"""Stage 2: keeps every instance the new plan can keep, never uses a GPU twice."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.reconfigurator.core.spec import Cluster, Instance, Node, uniform_cluster
from services.reconfigurator.core.stage2 import Stage2Infeasible, candidate_slots, solve_stage2


def tp4(node: str) -> Instance:
    return Instance(node, 4, (0, 1, 2, 3))


def tp1(node: str, gpu: int) -> Instance:
    return Instance(node, 1, (gpu,))


def assert_valid(plan, cluster: Cluster, instances_by_tp: dict[int, int]) -> None:
    target = plan.target_instances()
    used = [(inst.node, gpu) for inst in target for gpu in inst.gpu_ids]
    assert len(used) == len(set(used)), "a GPU is used twice"
    node_gpus = {n.name: set(n.gpu_ids) for n in cluster.nodes}
    assert all(gpu in node_gpus[node] for node, gpu in used), "a GPU that does not exist"
    assert Counter(i.tp for i in target) == Counter({d: n for d, n in instances_by_tp.items() if n})
    kept_and_stopped = [i for n in plan.nodes for i in (*n.keep, *n.stop)]
    assert sorted(kept_and_stopped) == sorted(cluster.placement)
    assert all(len(i.gpu_ids) == i.tp for i in target)


def test_same_shape_keeps_everything(cluster16):
    running = (tp4("node-0"), tp4("node-1"), *(tp1(n, g) for n in ("node-2", "node-3") for g in range(4)))
    cluster = cluster16.with_placement(running)
    plan = solve_stage2({1: 8, 4: 2}, cluster)
    assert plan.num_kept == 10 and plan.num_stopped == 0 and plan.num_started == 0


def test_shrinking_tp4_keeps_the_rest(cluster16):
    running = (tp4("node-0"), tp4("node-1"), *(tp1(n, g) for n in ("node-2", "node-3") for g in range(4)))
    cluster = cluster16.with_placement(running)
    plan = solve_stage2({1: 12, 4: 1}, cluster)
    assert_valid(plan, cluster, {1: 12, 4: 1})
    assert plan.num_kept == 9 and plan.num_stopped == 1 and plan.num_started == 4


def test_unaligned_running_instance_can_be_kept():
    cluster = Cluster((Node("n", (0, 1, 2, 3)),), (1, 2), placement=(Instance("n", 2, (1, 2)),))
    plan = solve_stage2({1: 2, 2: 1}, cluster)
    assert_valid(plan, cluster, {1: 2, 2: 1})
    assert plan.num_kept == 1
    assert sorted(i.gpu_ids for i in plan.nodes[0].start) == [(0,), (3,)]


def test_unplaceable_counts_raise(cluster16):
    with pytest.raises(Stage2Infeasible):
        solve_stage2({4: 5}, cluster16)
    with pytest.raises(Stage2Infeasible):
        solve_stage2({8: 1}, cluster16)


# --- random placements against a brute-force optimum --------------------------------------------


def brute_force_max_kept(cluster: Cluster, instances_by_tp: dict[int, int]) -> int:
    """Depth-first over candidate slots: the most running instances kept by any valid placement."""
    slots = candidate_slots(cluster)
    running = set(cluster.placement)
    best = -1

    def visit(i: int, used: frozenset, remaining: dict[int, int], kept: int) -> None:
        nonlocal best
        if all(n == 0 for n in remaining.values()):
            best = max(best, kept)
            return
        if i == len(slots) or kept + sum(remaining.values()) <= best:
            return
        slot = slots[i]
        gpus = {(slot.node, g) for g in slot.gpu_ids}
        if remaining.get(slot.tp, 0) > 0 and not gpus & used:
            visit(
                i + 1, used | gpus, {**remaining, slot.tp: remaining[slot.tp] - 1}, kept + (slot in running)
            )
        visit(i + 1, used, remaining, kept)

    visit(0, frozenset(), dict(instances_by_tp), 0)
    return best


@st.composite
def random_layout(draw, node_sizes: tuple[int, ...]) -> tuple[Instance, ...]:
    """Instances on random GPU sets (aligned or not) of random nodes, no GPU twice."""
    instances = []
    for index, size in enumerate(node_sizes):
        free = list(range(size))
        for _ in range(draw(st.integers(0, size))):
            degree = draw(st.sampled_from([d for d in (1, 2, 4) if d <= len(free)] or [0]))
            if degree == 0:
                break
            gpus = draw(st.permutations(free))[:degree]
            free = [g for g in free if g not in gpus]
            instances.append(Instance(f"node-{index}", degree, tuple(sorted(gpus))))
    return tuple(instances)


@st.composite
def scenario(draw):
    node_sizes = tuple(draw(st.lists(st.sampled_from([1, 2, 4]), min_size=1, max_size=3)))
    degrees = tuple(d for d in (1, 2, 4) if d <= max(node_sizes))
    cluster = Cluster(tuple(Node(f"node-{i}", tuple(range(s))) for i, s in enumerate(node_sizes)), degrees)
    running = draw(random_layout(node_sizes))
    # A target that is placeable: the counts of a random aligned layout.
    aligned = [s for s in candidate_slots(cluster)]
    chosen, used = [], set()
    for slot in draw(st.permutations(aligned)):
        gpus = {(slot.node, g) for g in slot.gpu_ids}
        if not gpus & used and draw(st.booleans()):
            chosen.append(slot)
            used |= gpus
    instances_by_tp = dict(Counter(s.tp for s in chosen))
    return cluster.with_placement(tuple(i for i in running if i.tp in degrees)), instances_by_tp


@settings(max_examples=40, deadline=None)
@given(scenario())
def test_random_placements_are_valid_and_keep_the_most(case):
    cluster, instances_by_tp = case
    plan = solve_stage2(instances_by_tp, cluster)
    assert_valid(plan, cluster, instances_by_tp)
    assert plan.num_kept == brute_force_max_kept(cluster, instances_by_tp)


def test_large_cluster_is_fast_and_valid():
    cluster = uniform_cluster(256, 4, (1, 2, 4))
    running = tuple(Instance(f"node-{n}", 4, (0, 1, 2, 3)) for n in range(0, 256, 2))
    cluster = cluster.with_placement(running)
    target = {1: 256, 2: 128, 4: 128}
    plan = solve_stage2(target, cluster)
    assert_valid(plan, cluster, target)
    assert plan.num_kept == 128
