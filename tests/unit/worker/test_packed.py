"""The packed engine (no padding, KV cache read in place) against the padded reference, token for token."""

import sys
import types

import pytest
import torch

from services.worker.attention import varlen
from services.worker.attention.layout import KeyLayout, StepLayout
from services.worker.attention.select import AttentionBackend, backend_runs, resolve_backend
from services.worker.attention.step import StepAttention
from services.worker.engine.engine import DLMEngine
from services.worker.kv.pages import KVPages
from services.worker.kv.pool import KVPool
from services.worker.reference import reference_generate
from shared.messages.base import CacheMode, StepKind

from . import varlen_emulation
from .conftest import random_specs, tiny_model

MODES = [CacheMode.NONE, CacheMode.PREFIX, CacheMode.DUAL]
MODELS = {
    "llada": dict(seed=0),
    "dream": dict(seed=4, logits_shift=1, n_kv_heads=2, qkv_bias=True),  # shifted logits, GQA, biases
}


def _specs(seed: int, count: int):
    return random_specs(seed, count)


def _run_staggered(engine: DLMEngine, states, thresholds, join_every: int = 2):
    """Continuous batching: request i joins at step i * join_every; finished ones leave (and free their cache)."""
    step = 0
    while not all(s.finished for s in states):
        live = [(s, t) for i, (s, t) in enumerate(zip(states, thresholds, strict=True))
                if i * join_every <= step and not s.finished]
        if live:
            engine.step(live)
        step += 1


@pytest.mark.parametrize("variant", sorted(MODELS))
@pytest.mark.parametrize("mode", MODES)
def test_packed_engine_equals_the_padded_reference_in_every_cache_mode(mode, variant):
    model = tiny_model(**MODELS[variant])
    engine = DLMEngine(model, stop_at_eos=False, kv_page_size=4)  # small pages: extents of many pages
    specs = _specs(seed=len(variant) + len(mode), count=7)
    states = [engine.new_request(f"r{i}", p, g, b, mode) for i, (p, g, b, _) in enumerate(specs)]
    _run_staggered(engine, states, [t for *_, t in specs])
    for state, (prompt, gen, block, tau) in zip(states, specs, strict=True):
        ref = reference_generate(model, prompt, gen, block, tau, stop_at_eos=False, cache=mode)
        assert state.canvas == ref.tokens
        assert state.num_steps == ref.num_steps
    assert engine.kv_memory().used_bytes == 0  # every finished request gave its pages back


@pytest.mark.parametrize("mode", MODES)
def test_early_stop_at_eos_matches_the_reference_with_a_cache(mode):
    model = tiny_model(seed=3)
    with torch.no_grad():  # EOS a close favourite: some blocks complete one, some do not
        model.model.transformer.ff_out.weight[2] += 1.2
    engine = DLMEngine(model, stop_at_eos=True)
    specs = _specs(seed=9, count=6)
    states = [engine.new_request(f"r{i}", p, g, b, mode) for i, (p, g, b, _) in enumerate(specs)]
    _run_staggered(engine, states, [t for *_, t in specs], join_every=1)
    for state, (prompt, gen, block, tau) in zip(states, specs, strict=True):
        ref = reference_generate(model, prompt, gen, block, tau, stop_at_eos=True, cache=mode)
        assert state.canvas == ref.tokens and state.num_steps == ref.num_steps


@pytest.fixture(params=["2.13", "2.11"])
def emulated_kernels(monkeypatch, request):
    """flash-attn and PyTorch's varlen op replaced by CPU stand-ins that check their contracts; the
    varlen op with torch 2.13's signature (``seqused_k``, ``enable_gqa``) or 2.11's (neither)."""
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = varlen_emulation.flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    stand_in = varlen_emulation.varlen_attn if request.param == "2.13" else varlen_emulation.varlen_attn_2_11
    monkeypatch.setattr(varlen, "torch_varlen_attn", lambda: stand_in)
    features = frozenset({"seqused_k", "enable_gqa"}) if request.param == "2.13" else frozenset()
    monkeypatch.setattr(varlen, "varlen_features", lambda: features)
    return request.param


@pytest.mark.parametrize("backend", [AttentionBackend.FLASH, AttentionBackend.TORCH_VARLEN])
@pytest.mark.parametrize("variant", sorted(MODELS))
@pytest.mark.parametrize("mode", MODES)
def test_varlen_kernel_arguments_give_the_reference_tokens(emulated_kernels, backend, variant, mode):
    model = tiny_model(**MODELS[variant])
    if backend is AttentionBackend.TORCH_VARLEN and emulated_kernels == "2.11" and variant == "dream":
        assert not backend_runs(backend, torch.device("cuda"), torch.float16, 8, gqa=True)
        return  # torch 2.11's op takes as many key heads as query heads only: flex serves GQA models there
    page_size = 256 if backend is AttentionBackend.FLASH else 4
    engine = DLMEngine(model, stop_at_eos=False, kv_page_size=page_size)
    engine.attention = backend  # the kernels run on CUDA only: here their stand-ins
    specs = _specs(seed=len(variant) + 3 * len(mode), count=7)
    states = [engine.new_request(f"r{i}", p, g, b, mode) for i, (p, g, b, _) in enumerate(specs)]
    _run_staggered(engine, states, [t for *_, t in specs])  # pages freed and reused: pool order != batch order
    for state, (prompt, gen, block, tau) in zip(states, specs, strict=True):
        ref = reference_generate(model, prompt, gen, block, tau, stop_at_eos=False, cache=mode)
        assert state.canvas == ref.tokens and state.num_steps == ref.num_steps


def test_auto_attention_is_sdpa_on_a_cpu_and_kernels_are_refused_there():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, torch.bfloat16, 128) is AttentionBackend.SDPA
    for kernel in ("flash", "torch_varlen"):
        with pytest.raises(ValueError, match="cannot run here"):
            resolve_backend(kernel, cpu, torch.bfloat16, 128)


def test_cache_modes_give_their_own_tokens():
    # the reference's cache modes are approximations: they differ from each other, so the equality
    # above compares each mode with its own reference, not a mode with no cache
    model = tiny_model(seed=0)
    prompt = list(range(3, 23))
    tokens = {m: reference_generate(model, prompt, 24, 8, 0.99, stop_at_eos=False, cache=m).tokens for m in MODES}
    assert len({tuple(t) for t in tokens.values()}) > 1


def test_packed_forward_equals_the_padded_forward_for_mixed_lengths():
    model = tiny_model(seed=1, n_kv_heads=2, qkv_bias=True)
    sequences = [[5, 6, 7], list(range(3, 20)), [9, 4, 1, 1, 1, 8, 3]]
    width = max(map(len, sequences))
    ids = torch.tensor([[0] * (width - len(s)) + s for s in sequences])
    valid = torch.tensor([[False] * (width - len(s)) + [True] * len(s) for s in sequences])
    layout = StepLayout(tuple(map(len, sequences)), KeyLayout.FRESH)
    step_attention = StepAttention(AttentionBackend.SDPA, layout, None)
    step_attention.bind({k: torch.from_numpy(v) for k, v in step_attention.host_arrays().items()}, model.device)
    with torch.no_grad():
        padded = model(ids, attention_mask=valid).logits[valid]
        packed = model.forward_packed(
            torch.tensor([t for s in sequences for t in s]),
            torch.cat([torch.arange(len(s)) for s in sequences]),
            step_attention,
            torch.arange(layout.total),
        )
    torch.testing.assert_close(packed, padded, atol=1e-10, rtol=0)


def _cached_engine(model, page_size: int = 4) -> DLMEngine:
    return DLMEngine(model, stop_at_eos=False, kv_page_size=page_size)


def test_cache_steps_copy_nothing_and_write_only_their_window():
    model = tiny_model(seed=2)
    engine = _cached_engine(model)
    prompts = [[5, 6, 7], list(range(3, 24)), [9, 4, 8, 3, 3]]
    states = [engine.new_request(f"r{i}", p, 16, 8, CacheMode.DUAL) for i, p in enumerate(prompts)]
    per_token = engine.kv_pages.bytes_per_token
    engine.step([(s, 1.0) for s in states])  # threshold 1.0: one token per step, the block stays open
    refresh = engine.last_step_traffic[StepKind.RECOMPUTE]
    assert refresh.written == sum(len(p) + 16 for p in prompts) * per_token  # the whole cache rewritten
    engine.step([(s, 1.0) for s in states])
    assert set(engine.last_step_traffic) == {StepKind.CACHE}
    assert engine.last_step_traffic[StepKind.CACHE].copied == 0
    assert engine.last_step_traffic[StepKind.CACHE].written == 3 * 8 * per_token  # the three blocks only


def test_prefix_refresh_stores_only_what_its_cache_steps_read():
    model = tiny_model(seed=2)
    engine = _cached_engine(model)
    state = engine.new_request("r", list(range(3, 13)), 16, 8, CacheMode.PREFIX)
    per_token = engine.kv_pages.bytes_per_token
    engine.step([(state, 1.0)])
    assert engine.last_step_traffic[StepKind.RECOMPUTE].written == 10 * per_token  # the prompt: block 0's prefix
    engine.step([(state, 1.0)])
    assert engine.last_step_traffic[StepKind.CACHE].written == 16 * per_token  # block plus suffix
    assert engine.last_step_traffic[StepKind.CACHE].copied == 0


def test_no_cache_requests_write_nothing():
    engine = _cached_engine(tiny_model())
    state = engine.new_request("r", [3, 4, 5], 8, 8, CacheMode.NONE)
    engine.step([(state, 0.5)])
    assert engine.last_step_traffic[StepKind.RECOMPUTE].written == 0
    assert not engine.has_cache("r") and engine.kv_memory().used_bytes == 0


def test_dropped_caches_free_their_pages_for_the_next_requests():
    engine = _cached_engine(tiny_model())
    first = [engine.new_request(f"a{i}", list(range(3, 3 + 6 * (i + 1))), 16, 8, CacheMode.DUAL) for i in range(3)]
    engine.step([(s, 1.0) for s in first])
    pages, per_page = engine.kv_pages.num_pages, engine.kv_pages.page_bytes
    assert engine.kv_memory().used_bytes == sum(-(-(6 * (i + 1) + 16) // 4) for i in range(3)) * per_page
    for s in first:
        engine.drop(s.request_id)  # migrated away, evicted, or finished
        assert not engine.has_cache(s.request_id)
    assert engine.kv_memory().used_bytes == 0
    second = [engine.new_request(f"b{i}", list(range(3, 15)), 16, 8, CacheMode.DUAL) for i in range(3)]
    engine.step([(s, 1.0) for s in second])
    assert engine.kv_pages.num_pages == engine.runner.kv_pool.num_pages == pages  # reused: the pool did not grow
    assert engine.last_step_traffic[StepKind.RECOMPUTE].copied == 0
    assert all(engine.next_step_kind(s) is StepKind.CACHE for s in second)


def test_a_growing_pool_keeps_the_caches_it_holds_and_counts_the_copy():
    model = tiny_model(seed=6)
    engine = _cached_engine(model)
    a = engine.new_request("a", list(range(3, 20)), 16, 8, CacheMode.DUAL)
    engine.step([(a, 1.0)])
    copied = engine.runner.kv_pool.bytes_copied
    b = engine.new_request("b", list(range(3, 23)), 24, 8, CacheMode.DUAL)  # does not fit: the pool grows
    engine.step([(a, 1.0), (b, 1.0)])
    assert engine.runner.kv_pool.bytes_copied > copied
    assert engine.last_step_traffic[StepKind.RECOMPUTE].copied == engine.runner.kv_pool.bytes_copied - copied
    _run_staggered(engine, [a, b], [0.6, 0.6], join_every=0)
    ref = reference_generate(model, a.prompt_ids, 16, 8, lambda step: 1.0 if step <= 1 else 0.6,
                             stop_at_eos=False, cache="dual")
    assert a.canvas == ref.tokens


def test_pool_first_fit_reuses_and_merges_free_runs():
    cache = KVPages(page_size=4, bytes_per_token=16, capacity_tokens=40)
    assert cache.num_pages == 10
    a, b, c = cache.reserve("a", 8), cache.reserve("b", 9), cache.reserve("c", 4)
    assert (a.first_page, b.first_page, c.first_page) == (0, 2, 5) and b.num_pages == 3
    cache.forget("a")
    cache.forget("b")  # merged with a's run: five free pages in a row
    assert cache.reserve("d", 20).first_page == 0
    assert cache.num_pages == 10 and cache.bytes_copied == 0
    assert cache.reserve("d", 20).first_page == 0  # the same size again: the same extent, rewritten in place


def test_pool_writes_land_in_the_request_slots():
    cache = KVPool(n_layers=2, n_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"), page_size=4)
    pages = KVPages(page_size=4, bytes_per_token=cache.bytes_per_token)
    pages.reserve("x", 3)
    extent = pages.reserve("y", 6)
    cache.apply(pages.take_changes())
    keys = torch.arange(12.0).view(6, 1, 2)
    cache.write(1, keys, -keys, cache.slots(extent, 0, 6))
    stored_keys, stored_values = cache.layer_slots(1)
    first = extent.first_slot(4)
    assert torch.equal(stored_keys[first : first + 6], keys) and torch.equal(stored_values[first : first + 6], -keys)
    assert cache.bytes_written == 2 * 12 * 4


@pytest.mark.slow  # torch.compile takes most of a minute on a small CPU
def test_compiled_mlps_keep_the_reference_tokens():
    model = tiny_model(seed=0)
    model.compile_mlp()
    try:
        engine = DLMEngine(model, stop_at_eos=False, kv_page_size=4)
        specs = _specs(seed=5, count=5)
        states = [engine.new_request(f"r{i}", p, g, b, CacheMode.DUAL) for i, (p, g, b, _) in enumerate(specs)]
        _run_staggered(engine, states, [t for *_, t in specs])
    finally:
        model.compile_mlp(False)
    for state, (prompt, gen, block, tau) in zip(states, specs, strict=True):
        assert state.canvas == reference_generate(model, prompt, gen, block, tau, stop_at_eos=False, cache="dual").tokens
