"""Registry, determinism, rejections, request lifecycle, and the purity of the core."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from services.scheduler.core import (
    POLICIES,
    ClusterView,
    Decisions,
    RejectReason,
    RequestStatus,
    SchedulingLoop,
    make_config,
    make_policy,
    policy_names,
)
from services.scheduler.core.dilaserve import DiLaServeConfig, FixedConfig
from services.scheduler.core.request import TransitionError
from services.scheduler.fake_engine import FakeEngine
from tests.unit.scheduler.sched_builders import REPO, make_request, make_view, outcome, step_result

CORE = REPO / "services" / "scheduler" / "core"


def test_registry_names_and_config_classes():
    assert set(policy_names()) == {
        "dilaserve",
        "dilaserve-no-loadctl",
        "dilaserve-oneshot",
        "dilaserve-no-migration",
        "fixed",
        "infaas",
        "infaas++",
        "llumnix",
    }
    assert len({spec.config_cls for spec in POLICIES.values()}) == len(POLICIES)
    assert make_config("fixed").fixed_threshold == 0.9
    assert make_config("dilaserve-no-loadctl").load_control is False
    assert make_config("dilaserve-oneshot").prediction == "oneshot"
    assert make_config("dilaserve-no-migration").migration is False
    assert make_config("infaas++").migration is False and make_config("llumnix").migration is True


def test_make_policy_validates_names_and_configs():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")
    with pytest.raises(TypeError):
        make_policy("dilaserve", FixedConfig())
    with pytest.raises(ValueError):
        make_policy("dilaserve", {"not_a_field": 1})
    policy = make_policy("dilaserve", DiLaServeConfig(migration_margin=0.3), rng=np.random.default_rng(1))
    assert policy.config.migration_margin == 0.3 and policy.name == "dilaserve"


def simulate(profile, name: str, seed: int, config=None, num_events: int = 300, out: dict | None = None) -> list:
    """A small seeded run with the fake engine; returns every decision in order."""
    view = make_view(profile, [1, 1, 2, 4])
    loop = SchedulingLoop(make_policy(name, config, rng=seed), view)
    engine, rng = FakeEngine(np.random.default_rng(seed)), np.random.default_rng(seed + 1)
    log, now, num_arrivals = [], 0.0, 0
    for _ in range(num_events):
        now += float(rng.exponential(0.05))
        if rng.random() < 0.3 or not any(inst.batch for inst in view.instances.values()):
            request = make_request(f"r{num_arrivals}", now, slo_s=float(rng.uniform(2, 20)))
            num_arrivals += 1
            decisions = loop.on_arrival(now, request)
        else:
            busy = [iid for iid, inst in view.instances.items() if inst.batch]
            decisions = loop.on_step_result(now, engine.run_step(view, busy[int(rng.integers(len(busy)))]))
        log.append((decisions.assignments, decisions.rejections))
    if out is not None:
        out.update(view=view, policy=loop.policy)
    return log


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_same_seed_same_decisions(profile, name):
    assert simulate(profile, name, seed=3) == simulate(profile, name, seed=3)


def test_policy_state_tracks_live_requests_only(profile):
    out = {}
    log = simulate(profile, "dilaserve", seed=2, config={"reject_infeasible": True}, num_events=400, out=out)
    assert any(rejections for _, rejections in log) and any(assignments for assignments, _ in log)
    assert set(out["policy"].table.rid_to_row) == set(out["view"].requests)
    assert len(list(out["view"].arrival_log)) == 0


def test_random_tie_break_uses_the_injected_generator(profile):
    config = {"tie_break": "random"}
    first = simulate(profile, "dilaserve", seed=5, config=config)
    assert first == simulate(profile, "dilaserve", seed=5, config=config)


def test_early_rejection_is_off_by_default_and_explains_itself(profile):
    loop = SchedulingLoop(make_policy("dilaserve"), make_view(profile, [1]))
    decisions = loop.on_arrival(0.0, make_request("late", slo_s=0.05))
    assert decisions.rejections == [] and decisions.assignments[0].threshold == 0.5
    loop = SchedulingLoop(make_policy("dilaserve", {"reject_infeasible": True}), make_view(profile, [1]))
    decisions = loop.on_arrival(0.0, make_request("late", slo_s=0.05))
    (rejection,) = decisions.rejections
    assert rejection.reason == RejectReason.DEADLINE_INFEASIBLE
    assert "exceeds the remaining budget" in rejection.detail and "0.5" in rejection.detail
    assert "late" not in loop.view.requests and len(loop.view.removal_log) == 1
    assert loop.on_arrival(0.0, make_request("ok", slo_s=60.0)).assignments
    assert "late" not in loop.policy.table and "ok" in loop.policy.table  # the rejection was seen
    assert list(loop.view.removal_log) == [] and len(loop.view.removal_log) == 1


def test_unsatisfiable_quality_floor_is_rejected(profile):
    loop = SchedulingLoop(make_policy("dilaserve"), make_view(profile, [1]))
    (rejection,) = loop.on_arrival(0.0, make_request("r", min_threshold=0.99)).rejections
    assert rejection.reason == RejectReason.FLOOR_UNSATISFIABLE


def test_queue_order_is_priority_then_arrival(profile):
    loop = SchedulingLoop(make_policy("dilaserve"), make_view(profile, [1], max_batch=1))
    loop.on_arrival(0.0, make_request("first"))
    loop.on_arrivals(0.0, [make_request("low"), make_request("high", priority=1)])
    assert [r.request_id for r in loop.view.iter_queued()] == ["high", "low"]
    decisions = loop.on_step_result(1.0, step_result("i0", outcome("first", 256, True, finished=True)))
    assert [a.request_id for a in decisions.assignments] == ["high"]


def test_request_lifecycle_and_counters(profile):
    view = make_view(profile, [1])
    loop = SchedulingLoop(make_policy("fixed"), view)
    request = make_request("r", gen_len=64, block_len=32)
    loop.on_arrival(0.0, request)
    assert request.status == RequestStatus.RUNNING and request.next_step_is_recompute
    loop.on_step_result(0.1, step_result("i0", outcome("r", 4, recompute=True)))
    assert (request.num_steps_done, request.num_tokens_committed, request.num_block_steps) == (1, 4, 1)
    assert not request.next_step_is_recompute and request.max_remaining_recompute_steps == 1
    loop.on_step_result(0.2, step_result("i0", outcome("r", 28, block_done=True)))
    assert request.current_block == 1 and request.next_step_is_recompute
    loop.on_step_result(0.3, step_result("i0", outcome("r", 32, block_done=True, finished=True)))
    assert request.status == RequestStatus.FINISHED and request.finish_time == 0.3
    assert view.instances["i0"].batch == 0 and "r" not in view.requests
    with pytest.raises(TransitionError):
        request.move(RequestStatus.RUNNING)


def test_cancel_and_instance_removal(profile):
    view = make_view(profile, [1, 1])
    loop = SchedulingLoop(make_policy("dilaserve"), view)
    loop.on_arrivals(0.0, [make_request("a"), make_request("b")])
    view.cancel_request("a", 0.1)
    assert "a" not in view.requests and sum(inst.batch for inst in view.instances.values()) == 1
    host = view.requests["b"].instance_id
    loop.on_step_result(0.2, step_result(host, outcome("b", 1, recompute=True)))
    view.apply_step_result(0.3, step_result(view.requests["b"].instance_id, outcome("b", 1)))
    view.remove_instance(view.requests["b"].instance_id)
    assert view.requests["b"].status == RequestStatus.QUEUED
    (assignment,) = loop.tick(0.4).assignments
    assert assignment.instance_id in view.instances


def test_failed_instance_sends_running_requests_back_to_the_queue(profile):
    view = make_view(profile, [1, 1])
    loop = SchedulingLoop(make_policy("fixed"), view)
    loop.on_arrivals(0.0, [make_request("a"), make_request("b")])
    host = view.requests["a"].instance_id
    assert view.requests["a"].status == RequestStatus.RUNNING
    with pytest.raises(ValueError):
        view.remove_instance(host)  # a step is running there: only a failure may drop it
    on_host = [rid for rid in ("a", "b") if view.requests[rid].instance_id == host]
    assert sorted(view.fail_instance(host)) == sorted(on_host)
    assert host not in view.instances
    assert all(view.requests[rid].status == RequestStatus.QUEUED for rid in on_host)
    assert all(view.requests[rid].num_steps_done == 0 for rid in on_host)  # the lost step is not counted
    decisions = loop.tick(0.1)
    assert {a.request_id for a in decisions.assignments} >= set(on_host)
    assert all(a.instance_id != host for a in decisions.assignments)


def test_requeued_request_is_assigned_again_without_a_step(profile):
    view = make_view(profile, [1])
    loop = SchedulingLoop(make_policy("fixed"), view)
    loop.on_arrival(0.0, make_request("r"))
    view.requeue_request("r")
    assert view.requests["r"].status == RequestStatus.READY and view.requests["r"].num_steps_done == 0
    (assignment,) = loop.tick(0.1).assignments
    assert assignment.request_id == "r" and view.requests["r"].status == RequestStatus.RUNNING


def test_view_rejects_duplicates(profile):
    view = ClusterView()
    view.add_instance("x", 1, profile)
    with pytest.raises(ValueError):
        view.add_instance("x", 1, profile)
    view.add_request(make_request("r"))
    with pytest.raises(ValueError):
        view.add_request(make_request("r"))


FORBIDDEN_MODULES = {"nats", "redis", "asyncio", "time", "datetime", "socket", "random", "threading"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_core_has_no_io_and_reads_no_wall_clock():
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 10
    for path in files:
        bad = imported_modules(path) & FORBIDDEN_MODULES
        assert not bad, f"{path.name} imports {bad}"
        text = path.read_text()
        for call in ("time.time(", "perf_counter(", "monotonic(", "datetime.now(", "sleep("):
            assert call not in text, f"{path.name} calls {call}"


def test_queue_walk_stays_ordered_through_cancellations():
    view = ClusterView()
    rng = np.random.default_rng(0)
    for i in range(200):
        view.add_request(make_request(f"r{i}", priority=int(rng.integers(0, 3))))
    for i in range(0, 200, 3):
        view.cancel_request(f"r{i}", 0.0)
    view.apply(0.0, Decisions())  # trims dead heap entries
    walked = [(-r.priority, r.seq) for r in view.iter_queued()]
    assert walked == sorted(walked) and len(walked) == view.num_queued == 200 - 67
