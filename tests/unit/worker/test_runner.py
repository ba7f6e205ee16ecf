"""The model runner's step shape: one attention call per layer for a mixed batch on every backend that
runs on a CPU, a fixed number of host-device transfers per step whatever the batch, and the CUDA-graph
path's static buffers and padding (run here without a graph, on the varlen kernels' stand-ins)."""

import random
import sys
import types

import pytest
import torch

from services.worker.attention import flex, sdpa, varlen
from services.worker.attention.select import AttentionBackend, kernel_self_test
from services.worker.decoding.sampling import SamplingParams
from services.worker.engine.engine import DLMEngine
from services.worker.reference import reference_generate
from shared.messages.base import CacheMode, StepKind

from . import varlen_emulation
from .conftest import random_specs, tiny_model
from .test_packed import MODELS

MODES = [CacheMode.NONE, CacheMode.PREFIX, CacheMode.DUAL]


def _mixed_specs(seed: int, count: int, modes=MODES):
    """Lengths, blocks and cache modes mixed in one batch."""
    return random_specs(seed, count, prompt_lengths=(2, 30), modes=modes)


class _Counter:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.fixture
def kernel_counter(monkeypatch):
    """Counts calls of the attention kernel of a backend (the real SDPA and flex_attention; the varlen
    kernels' CPU stand-ins)."""

    def install(backend: AttentionBackend, signature: str = "2.13") -> _Counter:
        if backend is AttentionBackend.SDPA:
            counter = _Counter(torch.nn.functional.scaled_dot_product_attention)
            monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", counter)
        elif backend is AttentionBackend.FLEX:
            counter = _Counter(flex.flex_attention_fn(False))
            monkeypatch.setattr(flex, "flex_attention_fn", lambda compiled: counter)
        elif backend is AttentionBackend.FLASH:
            counter = _Counter(varlen_emulation.flash_attn_varlen_func)
            fake = types.ModuleType("flash_attn")
            fake.flash_attn_varlen_func = counter
            monkeypatch.setitem(sys.modules, "flash_attn", fake)
        else:
            new = signature == "2.13"
            counter = _Counter(varlen_emulation.varlen_attn if new else varlen_emulation.varlen_attn_2_11)
            monkeypatch.setattr(varlen, "torch_varlen_attn", lambda: counter)
            features = frozenset({"seqused_k", "enable_gqa"}) if new else frozenset()
            monkeypatch.setattr(varlen, "varlen_features", lambda: features)
        return counter

    return install


BACKENDS = [
    (AttentionBackend.SDPA, "llada"), (AttentionBackend.SDPA, "dream"),
    (AttentionBackend.FLEX, "llada"), (AttentionBackend.FLEX, "dream"),
    (AttentionBackend.FLASH, "dream"), (AttentionBackend.TORCH_VARLEN, "dream"),
]


@pytest.mark.parametrize(("backend", "variant"), BACKENDS)
def test_a_mixed_batch_makes_one_attention_call_per_layer_and_decodes_the_reference_tokens(
        kernel_counter, backend, variant):
    model = tiny_model(**MODELS[variant])
    counter = kernel_counter(backend)
    engine = DLMEngine(model, stop_at_eos=False, kv_page_size=256 if backend is AttentionBackend.FLASH else 4)
    engine.attention = backend  # the varlen kernels run on CUDA only: here their stand-ins
    specs = _mixed_specs(seed=len(variant) + len(backend), count=9)
    states = [engine.new_request(f"r{i}", p, g, b, mode) for i, (p, g, b, _, mode) in enumerate(specs)]
    thresholds = {s.request_id: t for s, (*_, t, _) in zip(states, specs, strict=True)}
    layers, mixed, step = len(model.model.transformer.blocks), 0, 0
    while not all(s.finished for s in states):
        live = [(s, thresholds[s.request_id]) for i, s in enumerate(states) if i <= step and not s.finished]
        kinds = {engine.next_step_kind(s) for s, _ in live}
        counter.calls = 0
        engine.step(live)
        assert counter.calls == layers, f"step {step}: {counter.calls} attention calls for {len(live)} requests"
        mixed += kinds == {StepKind.RECOMPUTE, StepKind.CACHE}
        step += 1
    assert mixed >= 3  # recompute and cache steps (and no-cache requests) shared forwards
    for state, (prompt, gen, block, tau, mode) in zip(states, specs, strict=True):
        ref = reference_generate(model, prompt, gen, block, tau, stop_at_eos=False, cache=mode)
        assert state.canvas == ref.tokens and state.num_steps == ref.num_steps, (state.request_id, mode)


def test_the_varlen_op_without_seqused_k_reads_each_request_through_gap_sequences(kernel_counter):
    model = tiny_model(**MODELS["llada"])
    counter = kernel_counter(AttentionBackend.TORCH_VARLEN, "2.11")
    engine = DLMEngine(model, stop_at_eos=False, kv_page_size=4)
    engine.attention = AttentionBackend.TORCH_VARLEN
    specs = _mixed_specs(seed=3, count=6)
    states = [engine.new_request(f"r{i}", p, g, b, mode) for i, (p, g, b, _, mode) in enumerate(specs)]
    engine.run_to_completion([(s, t) for s, (*_, t, _) in zip(states, specs, strict=True)])
    assert counter.calls > 0
    for state, (prompt, gen, block, tau, mode) in zip(states, specs, strict=True):
        assert state.canvas == reference_generate(model, prompt, gen, block, tau, stop_at_eos=False, cache=mode).tokens


@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_host_device_transfers_per_step_do_not_grow_with_the_batch(batch_size):
    model = tiny_model(**MODELS["dream"])
    engine = DLMEngine(model, stop_at_eos=True, kv_page_size=4)
    specs = _mixed_specs(seed=batch_size, count=batch_size)
    states = []
    for i, (p, g, b, _, mode) in enumerate(specs):  # greedy, sampled and logprob-asking requests together
        sampling = SamplingParams(temperature=0.8, top_k=5, seed=i) if i % 3 == 1 else None
        states.append(engine.new_request(f"r{i}", p, g, b, mode, sampling=sampling, num_top_logprobs=2 * (i % 3 == 2)))
    before, steps = engine.runner.transfers, 0
    active = [(s, t) for s, (*_, t, _) in zip(states, specs, strict=True)]
    while active:
        engine.step(active)
        assert engine.runner.last_step_transfers == 2  # the step's inputs in, its results out
        steps += 1
        active = [(s, t) for s, t in active if not s.finished]
    assert engine.runner.transfers - before == 2 * steps
    assert all(s.confidences for s in states)


@pytest.mark.parametrize(("backend", "signature", "variant"), [
    (AttentionBackend.TORCH_VARLEN, "2.13", "llada"), (AttentionBackend.TORCH_VARLEN, "2.11", "llada"),
    (AttentionBackend.TORCH_VARLEN, "2.13", "dream"), (AttentionBackend.FLASH, "2.13", "llada"),
    (AttentionBackend.FLASH, "2.13", "dream")])
def test_bucketed_static_steps_decode_the_reference_tokens(kernel_counter, backend, signature, variant):
    """The CUDA-graph path without the graph: dual-cache steps padded to a bucket (padding requests
    first, writing into a scratch extent), inputs copied into static buffers, logits sliced back; for a
    Dream-rule model too (its windows start at the block)."""
    model = tiny_model(**MODELS[variant])
    if variant == "dream":
        model.config.decoding_rule = "dream"
    kernel_counter(backend, signature)
    engine = DLMEngine(model, stop_at_eos=False, kv_page_size=256 if backend is AttentionBackend.FLASH else 4)
    engine.attention = backend
    engine.runner.graphs_enabled = True  # on a CPU the captured step runs its static buffers eagerly
    rng = random.Random(7)
    specs = [([rng.randrange(3, 24) for _ in range(rng.randint(2, 30))], 8 * rng.randint(1, 3), 8,
              rng.choice([0.3, 0.6, 0.9])) for _ in range(7)]
    states = [engine.new_request(f"r{i}", p, g, b, CacheMode.DUAL) for i, (p, g, b, _) in enumerate(specs)]
    step = 0
    while not all(s.finished for s in states):
        live = [(s, t) for i, (s, (*_, t)) in enumerate(zip(states, specs, strict=True)) if i <= step and not s.finished]
        engine.step(live)
        step += 1
    assert engine.runner.num_graph_steps > 3  # batches of 1..7 requests, padded to 1, 2, 4 and 8
    assert {key[0] for key in engine.runner.graphs.captured} >= {2, 4, 8}
    for state, (prompt, gen, block, tau) in zip(states, specs, strict=True):
        ref = reference_generate(model, prompt, gen, block, tau, stop_at_eos=False, cache="dual", rule=engine.rule)
        assert state.canvas == ref.tokens


def test_the_pools_byte_counter_agrees_with_the_steps_plan():
    """What the pool counts as stored equals what the engine's plan says each step stored, step after
    step, for recompute and cache steps alike (a replayed CUDA graph adds its share:
    ``test_gpu_engine.py::test_a_replayed_step_counts_the_keys_it_stores``)."""
    engine = DLMEngine(tiny_model(**MODELS["llada"]), stop_at_eos=False, kv_page_size=4)
    states = [engine.new_request(f"r{i}", p, g, b, mode) for i, (p, g, b, _, mode)
              in enumerate(_mixed_specs(seed=5, count=6, modes=[CacheMode.PREFIX, CacheMode.DUAL]))]
    while not all(s.finished for s in states):
        before = engine.runner.kv_pool.bytes_written
        engine.step([(s, 0.6) for s in states if not s.finished])
        planned = sum(traffic.written for traffic in engine.last_step_traffic.values())
        assert engine.runner.kv_pool.bytes_written - before == planned


def test_graphs_are_off_on_a_cpu_even_when_asked_for():
    engine = DLMEngine(tiny_model(), stop_at_eos=False)
    assert not engine.runner.graphs_enabled
    assert DLMEngine(tiny_model(), cuda_graphs=True).runner.graphs_enabled is False  # no CUDA here


@pytest.mark.parametrize(("backend", "signature"), [(AttentionBackend.TORCH_VARLEN, "2.13"),
                                                    (AttentionBackend.TORCH_VARLEN, "2.11"),
                                                    (AttentionBackend.FLASH, "2.13")])
def test_a_kernel_is_used_only_where_it_computes_what_sdpa_computes(kernel_counter, monkeypatch, backend, signature):
    cpu, f32 = torch.device("cpu"), torch.float32
    kernel_self_test.cache_clear()
    kernel_counter(backend, signature)
    assert kernel_self_test(backend, cpu, f32, 16, gqa=False)
    if signature == "2.13":
        assert kernel_self_test(backend, cpu, f32, 16, gqa=True)

    def refuses(*args, **kwargs):  # e.g. a torch that routes the op to a backend without seqused_k
        raise RuntimeError("seqused_k/block_table is not yet supported with the cuDNN backend.")

    kernel_self_test.cache_clear()
    if backend is AttentionBackend.FLASH:
        sys.modules["flash_attn"].flash_attn_varlen_func = refuses
    else:
        monkeypatch.setattr(varlen, "torch_varlen_attn", lambda: refuses)
    assert not kernel_self_test(backend, cpu, f32, 16)

    kernel_self_test.cache_clear()
    wrong = varlen_emulation.varlen_attn if backend is AttentionBackend.TORCH_VARLEN else \
        varlen_emulation.flash_attn_varlen_func
    if backend is AttentionBackend.FLASH:
        sys.modules["flash_attn"].flash_attn_varlen_func = lambda *a, **k: wrong(*a, **k) * 1.5
    else:
        monkeypatch.setattr(varlen, "torch_varlen_attn", lambda: lambda *a, **k: wrong(*a, **k) * 1.5)
    assert not kernel_self_test(backend, cpu, f32, 16)
    kernel_self_test.cache_clear()
