import numpy as np

from services.scheduler.core import CacheMode
from shared.tasks import Family, TaskGenerator
from sim.engines import ReplayEngine
from sim.workload import RequestSpec
from tests.unit.sim.sim_builders import make_trace


def _spec(rid: str, family: Family) -> RequestSpec:
    return RequestSpec(rid, 0.0, TaskGenerator(seed=1).problem(5, family=family), 16, 8, 1.0)


def _engine() -> ReplayEngine:
    return ReplayEngine(make_trace(), np.random.default_rng(0))


def test_words_request_runs_two_blocks_with_one_recompute_each():
    engine = _engine()
    engine.admit(_spec("w", Family.WORDS), CacheMode.DUAL)
    outcomes = []
    while not outcomes or not outcomes[-1].finished:
        outcomes += engine.step("i0", [("w", 0.7)])
    assert [o.num_committed for o in outcomes] == [2] * 8
    assert [o.recompute for o in outcomes] == [True, False, False, False] * 2
    assert [o.block_done for o in outcomes].count(True) == 2


def test_add_request_ends_after_its_first_block():
    engine = _engine()
    engine.admit(_spec("a", Family.ADD), CacheMode.DUAL)
    outcomes = [engine.step("i0", [("a", 0.5)])[0] for _ in range(2)]
    assert outcomes[-1].finished and sum(o.num_committed for o in outcomes) == 8


def test_step_on_another_instance_is_a_recompute():
    engine = _engine()
    engine.admit(_spec("w", Family.WORDS), CacheMode.DUAL)
    engine.step("i0", [("w", 0.9)])
    assert engine.step("i0", [("w", 0.9)])[0].recompute is False
    assert engine.step("i1", [("w", 0.9)])[0].recompute is True  # the cache stayed on i0


def test_no_cache_mode_recomputes_every_step():
    engine = _engine()
    engine.admit(_spec("w", Family.WORDS), CacheMode.NONE)
    assert all(engine.step("i0", [("w", 0.9)])[0].recompute for _ in range(5))


def test_correctness_follows_the_thresholds_used():
    engine = _engine()
    results = []
    for i in range(200):
        engine.admit(_spec(f"r{i}", Family.ADD), CacheMode.DUAL)
        while not engine.step("i0", [(f"r{i}", 0.5)])[0].finished:
            pass
        results.append(engine.correct(f"r{i}"))
        engine.release(f"r{i}")
    assert 0.35 < np.mean(results) < 0.65  # accuracy 0.5 at threshold 0.5


def test_a_trace_shipped_with_the_model_is_loaded_instead_of_recorded(tmp_path):
    """``calibrate`` reads ``<model>/replay/<name>.json.gz`` before its cache directory and never
    records when it is there (the name carries the weights' digest, so other weights never read it)."""
    import gzip
    import json

    from sim.engines import SHIPPED_TRACE_DIR, calibrate, model_key

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"fake": "weights for the digest only"}')
    shipped = make_trace()
    name = f"trace-v5-{model_key(model)}-192-12345-mix-16x8-add+words.json"
    (model / SHIPPED_TRACE_DIR).mkdir()
    (model / SHIPPED_TRACE_DIR / f"{name}.gz").write_bytes(gzip.compress(json.dumps(shipped.to_json()).encode()))
    loaded = calibrate(model, trace_dir=tmp_path / "cache", gen_len=16, block_len=8)
    assert loaded.to_json() == shipped.to_json()
    assert not (tmp_path / "cache").exists()  # nothing recorded, nothing cached
