"""Every engine has the whole engine interface (``services/worker/engine/protocol.py``), so the worker
service never probes for a member; the fake's KV memory is none, said with zeros."""

from services.worker.engine.engine import DLMEngine
from services.worker.engine.fake import ZeroComputeEngine
from services.worker.engine.protocol import Engine
from services.worker.parallel.tp_engine import TensorParallelEngine
from shared.messages.base import CacheMode, StepKind

from .conftest import tiny_model

METHODS = {name for name, value in vars(Engine).items() if callable(value) and not name.startswith("_")}
MEMBERS = sorted(set(Engine.__annotations__) | METHODS)


def test_every_engine_has_every_member_of_the_protocol():
    assert len(MEMBERS) > 20
    for engine in (DLMEngine(tiny_model()), ZeroComputeEngine()):
        assert isinstance(engine, Engine)
        assert [m for m in MEMBERS if not hasattr(engine, m)] == []
    assert issubclass(TensorParallelEngine, DLMEngine)  # rank 0 plans: the same engine, another runner


def test_the_fake_holds_no_kv_memory_and_answers_like_the_engine():
    engine = ZeroComputeEngine(tokens_per_step=4)
    state = engine.new_request("r", [3, 4], 8, 4, CacheMode.DUAL, max_tokens=6)
    assert engine.next_step_kind(state) is StepKind.RECOMPUTE
    first = engine.step([(state, 0.9)])[0]
    assert first.block_done and engine.next_step_kind(state) is StepKind.RECOMPUTE  # the next block starts
    assert engine.kv_overflow([(state, 0.9)]) == [] and engine.trim_kv() == 0
    memory = engine.kv_memory()
    assert (memory.budget_bytes, memory.pool_bytes, memory.used_bytes, memory.capacity_tokens(8)) == (0, 0, 0, 0)
    engine.step([(state, 0.9)])
    assert state.finished and engine.answer(state).token_ids == state.canvas[:6]
    assert engine.warm_up() == 0
    engine.close()
