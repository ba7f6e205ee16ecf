"""The KV pool's byte budget: it caps the pool, the engine refuses what would overflow (typed, nothing
changed), compaction gathers scattered free pages, and ``trim`` gives the memory back."""

import pytest
import torch

from services.worker.engine.engine import DLMEngine
from services.worker.kv.pages import KVBudgetExceeded, KVPages
from services.worker.kv.pool import KVPool
from services.worker.reference import reference_generate
from shared.messages.base import CacheMode

from .conftest import tiny_model


def _tensor() -> KVPool:
    return KVPool(n_layers=1, n_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"), page_size=4)


def _pool(budget_pages: int = 0, capacity_tokens: int = 0) -> KVPages:
    cache = KVPages(page_size=4, bytes_per_token=_tensor().bytes_per_token, capacity_tokens=capacity_tokens)
    cache.set_budget(budget_pages * cache.page_bytes)
    return cache


def test_the_pool_grows_up_to_its_budget_and_refuses_beyond_it_without_changing_anything():
    cache = _pool(budget_pages=6)
    cache.reserve("a", 8)  # 2 pages
    cache.reserve("b", 13)  # 4 pages: the budget is full
    assert cache.num_pages == 6 and cache.held_pages == 6 and cache.budget_pages_left == 0
    assert not cache.fits([("c", 1)])
    with pytest.raises(KVBudgetExceeded) as refused:
        cache.reserve("c", 1)
    assert refused.value.request_ids == ["c"] and refused.value.available_pages == 0
    assert "c" not in cache and cache.held_pages == 6 and cache.num_pages == 6
    cache.forget("a")
    assert cache.fits([("c", 8)]) and not cache.fits([("c", 9)])
    cache.reserve("c", 8)
    tensor = _tensor()
    tensor.apply(cache.take_changes())
    assert tensor.capacity_bytes == 6 * cache.page_bytes  # never above the budget


def test_a_batch_that_would_overflow_is_refused_whole():
    cache = _pool(budget_pages=4)
    with pytest.raises(KVBudgetExceeded) as refused:
        cache.make_room([("a", 8), ("b", 8), ("c", 4)])  # 5 pages
    assert refused.value.needed_pages == 5 and refused.value.request_ids == ["a", "b", "c"]
    assert cache.held_pages == 0


def test_scattered_free_pages_are_compacted_and_the_data_moves_with_its_pages():
    cache, tensor = _pool(budget_pages=6), _tensor()
    a, b = cache.reserve("a", 8), cache.reserve("b", 8)
    cache.reserve("c", 8)
    tensor.apply(cache.take_changes())
    keys = torch.arange(16.0).view(8, 1, 2)
    tensor.write(0, keys, -keys, tensor.slots(b, 0, 8))
    cache.forget("a")
    cache.forget("c")  # free: pages 0-1 and 4-5, no run of 3
    copied, tensor_copied = cache.bytes_copied, tensor.bytes_copied
    d = cache.reserve("d", 12)
    tensor.apply(cache.take_changes())
    moved = cache.extent("b")
    assert moved.first_page == 0 and d.first_page == 2 and cache.num_pages == 6 and tensor.num_pages == 6
    stored_keys, stored_values = tensor.layer_slots(0)
    assert torch.equal(stored_keys[0:8], keys) and torch.equal(stored_values[0:8], -keys)
    assert cache.bytes_copied > copied and a.first_page == 0
    assert tensor.bytes_copied - tensor_copied == cache.bytes_copied - copied  # the table's plan, done


def test_trim_gives_the_memory_back_once_no_request_holds_pages():
    cache, tensor = _pool(capacity_tokens=8), _tensor()
    cache.reserve("a", 30)
    cache.reserve("b", 30)
    tensor.apply(cache.take_changes())
    assert not cache.trim() and cache.take_changes() == ()  # requests hold pages: nothing freed
    cache.forget("a")
    cache.forget("b")
    big = tensor.capacity_bytes
    assert cache.trim()
    tensor.apply(cache.take_changes())
    assert big - tensor.capacity_bytes == big - 2 * cache.page_bytes > 0  # back to the starting 8 positions
    assert cache.num_pages == tensor.num_pages == 2 and cache.held_bytes == 0
    assert cache.reserve("c", 4).first_page == 0


def test_the_engine_refuses_an_overflowing_step_and_names_what_fits():
    model = tiny_model(seed=1)
    engine = DLMEngine(model, stop_at_eos=False, kv_page_size=4)
    prompt = list(range(3, 15))  # 12 positions + a 16-position canvas: 7 pages each
    engine.set_kv_budget(15 * engine.kv_pages.page_bytes)  # two requests fit, not three
    states = [engine.new_request(f"r{i}", prompt, 16, 8, CacheMode.DUAL) for i in range(3)]
    batch = [(s, 0.9) for s in states]
    assert engine.kv_overflow(batch) == ["r2"]
    before = [list(s.canvas) for s in states]
    with pytest.raises(KVBudgetExceeded):
        engine.step(batch)
    assert [s.canvas for s in states] == before and all(s.num_steps == 0 for s in states)
    assert engine.kv_memory().used_bytes == 0
    engine.step(batch[:2])
    memory = engine.kv_memory()
    assert memory.used_bytes == 14 * engine.kv_pages.page_bytes and memory.num_requests == 2
    assert memory.capacity_tokens(max_batch=2) == 15 * 4 - 2 * 3
    assert engine.kv_overflow([(states[0], 0.9), (states[2], 0.9)]) == ["r2"]  # r0's cache step takes no page
    engine.drop("r0")  # finished, or moved away: its pages are free
    assert engine.kv_overflow([(states[1], 0.9), (states[2], 0.9)]) == []
    assert engine.kv_overflow(batch) == ["r2"]  # r0 would need its pages again first


def test_requests_under_a_budget_answer_as_without_one():
    model = tiny_model(seed=3)
    engine = DLMEngine(model, stop_at_eos=False, kv_page_size=4, kv_budget_bytes=0)
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 13)]
    per_request = max(-(-(len(p) + 16) // 4) for p in prompts)
    engine.set_kv_budget(2 * per_request * engine.kv_pages.page_bytes)  # at most two at once
    states = [engine.new_request(f"r{i}", p, 16, 8, CacheMode.DUAL) for i, p in enumerate(prompts)]
    waiting, running = list(states), []
    while waiting or running:
        while waiting and not engine.kv_overflow([(s, 0.7) for s in running + waiting[:1]]):
            running.append(waiting.pop(0))
        engine.step([(s, 0.7) for s in running])
        assert engine.kv_memory().pool_bytes <= engine.kv_memory().budget_bytes
        running = [s for s in running if not s.finished]
    for state, prompt in zip(states, prompts, strict=True):
        ref = reference_generate(model, prompt, 16, 8, 0.7, stop_at_eos=False, cache="dual")
        assert state.canvas == ref.tokens
    assert engine.kv_memory().used_bytes == 0
    assert engine.trim_kv() > 0 and engine.kv_memory().pool_bytes == 0


def test_a_compaction_between_steps_keeps_every_cache_exact():
    """a, b, c fill the budget; a and c finish, leaving two free runs too short for d: d's reservation
    moves b's pages down while b is mid-block. Both still answer as the reference does."""
    model = tiny_model(seed=5)
    engine = DLMEngine(model, stop_at_eos=False, kv_page_size=4)
    engine.set_kv_budget(12 * engine.kv_pages.page_bytes)
    prompt = list(range(3, 11))
    a = engine.new_request("a", prompt, 4, 4, CacheMode.DUAL)  # 3 pages
    b = engine.new_request("b", prompt, 16, 4, CacheMode.DUAL)  # 6 pages
    c = engine.new_request("c", prompt, 4, 4, CacheMode.DUAL)  # 3 pages
    running = [a, b, c]
    while not a.finished:
        engine.step([(s, 1.0) for s in running])
    assert c.finished and engine.kv_pages.extent("b").first_page == 3
    d = engine.new_request("d", list(range(4, 12)), 16, 4, CacheMode.DUAL)  # 6 pages: no free run that long
    copied = engine.runner.kv_pool.bytes_copied
    while not (b.finished and d.finished):
        engine.step([(s, 1.0) for s in (b, d) if not s.finished])
    assert engine.runner.kv_pool.bytes_copied > copied  # b's pages moved
    for state in (b, d):
        ref = reference_generate(model, state.prompt_ids, 16, 4, 1.0, stop_at_eos=False, cache="dual")
        assert state.canvas == ref.tokens
