"""GPU checks (marker ``gpu``, excluded by default; ``scripts/gpu-check.sh`` runs them on a CUDA machine).

* the packed engine on CUDA equals the reference, token for token, in every cache mode (float64, SDPA);
* each varlen kernel there (flash-attn, PyTorch's varlen op) computes what SDPA computes, on packed
  fresh rows and on requests' caches read in place from the pool;
* engines on each varlen kernel commit exactly the tokens of the SDPA engine: the bundled model over
  32 prompts (fp16), and a Dream-style random model (shifted logits, GQA) with mixed lengths.

TP-2 over NCCL is ``test_tp.py::test_two_gpus_decode_like_one`` (two GPUs).
"""

from pathlib import Path

import pytest
import torch

from services.worker.attention import (
    AttentionBackend,
    CachedAttention,
    CacheWrite,
    FreshAttention,
    Segments,
    backend_runs,
)
from services.worker.engine import DLMEngine
from services.worker.kv_cache import PagedKVCache
from services.worker.loading import load_model
from services.worker.reference import reference_generate
from shared.tasks import Split, TaskGenerator

from .conftest import tiny_model
from .test_packed import MODELS, MODES, _run_staggered, _specs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODEL_DIR = Path(__file__).resolve().parents[3] / "models" / "dls-tiny"
KERNELS = [AttentionBackend.FLASH, AttentionBackend.TORCH_VARLEN]
CUDA = torch.device("cuda")


def _require(kernel: AttentionBackend, head_dim: int, dtype=torch.float16) -> None:
    if not backend_runs(kernel, CUDA, dtype, head_dim):
        pytest.skip(f"{kernel.value} does not run here")


@pytest.mark.parametrize("mode", MODES)
def test_packed_engine_on_cuda_equals_the_reference(mode):
    model = tiny_model(**MODELS["dream"]).to(CUDA)
    engine = DLMEngine(model, stop_at_eos=False, kv_page_size=4)
    assert engine.attention is AttentionBackend.SDPA  # float64: the kernels take fp16/bf16 only
    specs = _specs(seed=11, count=7)
    states = [engine.new_request(f"r{i}", p, g, b, mode) for i, (p, g, b, _) in enumerate(specs)]
    _run_staggered(engine, states, [t for *_, t in specs])
    for state, (prompt, gen, block, tau) in zip(states, specs, strict=True):
        assert state.canvas == reference_generate(model, prompt, gen, block, tau, stop_at_eos=False, cache=mode).tokens


def _pool_with_gaps(lengths: list[int], heads: int, head_dim: int) -> tuple[PagedKVCache, list]:
    """A pool of random keys/values holding ``lengths`` in pool order, with freed extents between them."""
    cache = PagedKVCache(2, heads, head_dim, torch.float16, CUDA, page_size=256)
    extents = []
    for i, n in enumerate(lengths):
        extents.append(cache.reserve(f"r{i}", n))
        cache.reserve(f"gap{i}", 300)
    for i in range(len(lengths)):
        cache.release(f"gap{i}")  # never to be read: their slots hold noise
    cache.pool.normal_()
    return cache, extents


@pytest.mark.parametrize("kernel", KERNELS)
def test_varlen_kernels_compute_what_sdpa_computes(kernel):
    _require(kernel, 64)
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 8, 2, 64
    fresh = Segments((5, 37, 300, 64))
    q = torch.randn(fresh.total, heads, head_dim, dtype=torch.float16, device=CUDA)
    k, v = (torch.randn(fresh.total, kv_heads, head_dim, dtype=torch.float16, device=CUDA) for _ in range(2))
    expected = FreshAttention(AttentionBackend.SDPA, fresh, CUDA)(0, q, k, v)
    got = FreshAttention(kernel, fresh, CUDA)(0, q, k, v)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)

    cache, extents = _pool_with_gaps([40, 333, 600, 90], kv_heads, head_dim)
    starts = [3, 250, 280, 58]  # each request's window: fresh.lengths[i] positions from starts[i]
    slots = torch.cat([cache.slots(e, s, s + n) for e, s, n in zip(extents, starts, fresh.lengths, strict=True)])
    write = CacheWrite(cache, slots.to(CUDA))
    expected = CachedAttention(AttentionBackend.SDPA, fresh, cache, extents, write)(1, q, k, v)
    got = CachedAttention(kernel, fresh, cache, extents, write)(1, q, k, v)  # writes the same window again
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", MODES)
def test_kernel_engine_commits_the_sdpa_engine_tokens_over_32_prompts(kernel, mode):
    loaded = load_model(MODEL_DIR, device="cuda", dtype=torch.float16)
    _require(kernel, loaded.model.config.head_dim)
    problems = TaskGenerator(seed=20).problems(32, max_shots=3, split=Split.HELD_OUT)
    canvases = {}
    for attention in (kernel, AttentionBackend.SDPA):
        engine = DLMEngine(loaded.model, loaded.tokenizer, loaded.gen_length, loaded.block_length,
                           attention=attention.value)
        states = [engine.new_request(f"q{i}", engine.encode(p.prompt), cache_mode=mode) for i, p in enumerate(problems)]
        engine.run_to_completion([(s, 0.9) for s in states])
        canvases[attention] = [(s.canvas, s.num_steps) for s in states]
    assert canvases[kernel] == canvases[AttentionBackend.SDPA]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", MODES)
def test_kernel_engine_commits_the_sdpa_engine_tokens_with_gqa_and_shifted_logits(kernel, mode):
    model = tiny_model(**MODELS["dream"], dtype=torch.float16).to(CUDA)
    _require(kernel, model.config.head_dim)
    specs = _specs(seed=12, count=7)
    canvases = {}
    for attention in (kernel, AttentionBackend.SDPA):
        engine = DLMEngine(model, stop_at_eos=False, attention=attention.value, kv_page_size=256)
        states = [engine.new_request(f"r{i}", p, g, b, mode) for i, (p, g, b, _) in enumerate(specs)]
        _run_staggered(engine, states, [t for *_, t in specs])
        canvases[attention] = [s.canvas for s in states]
    assert canvases[kernel] == canvases[AttentionBackend.SDPA]
