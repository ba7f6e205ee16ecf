"""Stage 1 then Stage 2: every Stage 1 shape is placeable, on uneven nodes too."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.reconfigurator.core.planner import plan_reconfiguration
from services.reconfigurator.core.spec import Cluster, Instance, Node
from tests.unit.reconfigurator.reconfig_builders import make_workload


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rps=st.floats(0.0, 200.0),
    node_sizes=st.lists(st.sampled_from([1, 2, 3, 4, 6, 8]), min_size=1, max_size=6),
)
def test_stage1_shapes_are_placeable(profile, rps, node_sizes):
    degrees = tuple(d for d in (1, 2, 4) if d <= max(node_sizes))
    nodes = tuple(Node(f"node-{i}", tuple(range(10 * i, 10 * i + size))) for i, size in enumerate(node_sizes))
    running = tuple(Instance(n.name, 1, (g,)) for n in nodes for g in n.gpu_ids[::2])
    cluster = Cluster(nodes, degrees, running)
    outcome = plan_reconfiguration(make_workload(rps), cluster, profile, "plan-7")
    target = outcome.plan.placement.target_instances()
    used = [(i.node, g) for i in target for g in i.gpu_ids]
    assert len(used) == len(set(used)) and len(used) <= cluster.num_gpus
    wanted = {d: n for d, n in outcome.plan.capacity.instances_by_tp.items() if n}
    assert Counter(i.tp for i in target) == Counter(wanted)
    kept_and_stopped = [i for n in outcome.plan.placement.nodes for i in (*n.keep, *n.stop)]
    assert sorted(kept_and_stopped) == sorted(running)
    assert set(outcome.solve_s) == {"stage1", "stage2", "current"}
    assert outcome.current is not None


def test_rolling_waves_change_one_node_at_a_time_starts_only_first():
    from services.reconfigurator.core.plan import NodePlan, PlacementPlan

    tp1 = [Instance("a", 1, (g,)) for g in range(4)]
    plan = PlacementPlan(nodes=(
        NodePlan("a", stop=tuple(tp1), start=(Instance("a", 4, (0, 1, 2, 3)),)),
        NodePlan("b", keep=(Instance("b", 2, (0, 1)),)),  # no change: in no wave
        NodePlan("c", start=(Instance("c", 1, (3,)),)),  # only adds capacity: first
        NodePlan("d", stop=(Instance("d", 2, (0, 1)),)),
    ))
    assert [[n.node for n in wave] for wave in plan.waves()] == [["c"], ["a"], ["d"]]
    assert PlacementPlan(nodes=(NodePlan("b", keep=(Instance("b", 1, (0,)),)),)).waves() == ()
