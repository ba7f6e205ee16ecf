"""GPU checks (marker ``gpu``, excluded by default; ``scripts/gpu-check.sh`` runs them on a CUDA machine).

* the packed engine on CUDA equals the reference, token for token, in every cache mode (float64, SDPA);
* each kernel there (flash-attn, PyTorch's varlen op, flex_attention) computes what SDPA computes, on
  packed fresh rows and on requests' caches read in place from the pool;
* engines on each kernel commit exactly the tokens of the SDPA engine: the bundled model over 32
  prompts (fp16), and a Dream-style random model (shifted logits, GQA) with mixed lengths;
* steps replayed from CUDA graphs commit the tokens of the same steps run eagerly, and a step makes no
  hidden host-device synchronisation (``torch.cuda.set_sync_debug_mode``) besides its one read-back.

TP-2 over NCCL is ``test_tp.py::test_two_gpus_decode_like_one`` (two GPUs).
"""

from pathlib import Path

import pytest
import torch

from services.worker.attention.layout import KeyLayout, StepLayout
from services.worker.attention.select import AttentionBackend, backend_runs
from services.worker.attention.step import StepAttention
from services.worker.engine.engine import DLMEngine
from services.worker.kv.pages import KVPages
from services.worker.kv.pool import KVPool
from services.worker.model.loading import load_model
from services.worker.reference import reference_generate
from shared.messages.base import CacheMode, StepKind
from shared.tasks import Split, TaskGenerator

from .conftest import tiny_model
from .test_packed import MODELS, MODES, _run_staggered, _specs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODEL_DIR = Path(__file__).resolve().parents[3] / "models" / "dls-tiny"
KERNELS = [AttentionBackend.FLASH, AttentionBackend.TORCH_VARLEN, AttentionBackend.FLEX]
GRAPH_KERNELS = [AttentionBackend.FLASH, AttentionBackend.TORCH_VARLEN]
CUDA = torch.device("cuda")


def _require(kernel: AttentionBackend, head_dim: int, dtype=torch.float16, gqa: bool = False) -> None:
    if not backend_runs(kernel, CUDA, dtype, head_dim, gqa):
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


def _pool_with_gaps(lengths: list[int], heads: int, head_dim: int, page_size: int) -> tuple[KVPool, list]:
    """A pool of random keys/values holding ``lengths`` in pool order, with freed extents between them."""
    cache = KVPool(2, heads, head_dim, torch.float16, CUDA, page_size=page_size)
    pages = KVPages(page_size, cache.bytes_per_token)
    extents = []
    for i, n in enumerate(lengths):
        extents.append(pages.reserve(f"r{i}", n))
        pages.reserve(f"gap{i}", 300)
    for i in range(len(lengths)):
        pages.forget(f"gap{i}")  # never to be read: their slots hold noise
    cache.apply(pages.take_changes())
    cache.pool.normal_()
    return cache, extents


def _attend(kernel, layout, cache, layer, q, k, v, slots=None):
    step = StepAttention(kernel, layout, cache)
    step.bind({name: torch.from_numpy(a).to(CUDA) for name, a in step.host_arrays().items()}, CUDA)
    if slots is not None:
        step.store = lambda layer, k, v: cache.write(layer, k, v, slots)
    return step(layer, q, k, v)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_compute_what_sdpa_computes(kernel):
    _require(kernel, 64, gqa=True)
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 8, 2, 64
    lengths = (5, 37, 300, 64)
    fresh = StepLayout(lengths, KeyLayout.FRESH)
    q = torch.randn(fresh.total, heads, head_dim, dtype=torch.float16, device=CUDA)
    k, v = (torch.randn(fresh.total, kv_heads, head_dim, dtype=torch.float16, device=CUDA) for _ in range(2))
    expected = _attend(AttentionBackend.SDPA, fresh, None, 0, q, k, v)
    torch.testing.assert_close(_attend(kernel, fresh, None, 0, q, k, v), expected, atol=2e-3, rtol=2e-3)

    page = 256 if kernel is AttentionBackend.FLASH else 16
    cache, extents = _pool_with_gaps([40, 333, 600, 90], kv_heads, head_dim, page)
    starts = [3, 250, 280, 58]  # each request's window: lengths[i] positions from starts[i]
    pooled = StepLayout(lengths, KeyLayout.POOL, tuple(e.first_slot(page) for e in extents),
                        tuple(e.num_tokens for e in extents))
    slots = torch.cat([cache.slots(e, s, s + n) for e, s, n in zip(extents, starts, lengths, strict=True)]).to(CUDA)
    expected = _attend(AttentionBackend.SDPA, pooled, cache, 1, q, k, v, slots)
    got = _attend(kernel, pooled, cache, 1, q, k, v, slots)  # writes the same window again
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", MODES)
def test_kernel_engine_commits_the_sdpa_engine_tokens_over_32_prompts(kernel, mode):
    loaded = load_model(MODEL_DIR, device="cuda", dtype=torch.float16)
    _require(kernel, loaded.model.config.head_dim)
    problems = TaskGenerator(seed=20).problems(32, max_shots=3, split=Split.HELD_OUT)
    canvases = {}
    for attention in (kernel, AttentionBackend.SDPA):
        engine = DLMEngine.from_loaded(loaded, attention=attention.value)
        states = [engine.new_request(f"q{i}", engine.encode(p.prompt), cache_mode=mode) for i, p in enumerate(problems)]
        engine.run_to_completion([(s, 0.9) for s in states])
        canvases[attention] = [(s.canvas, s.num_steps) for s in states]
    assert canvases[kernel] == canvases[AttentionBackend.SDPA]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", MODES)
def test_kernel_engine_commits_the_sdpa_engine_tokens_with_gqa_and_shifted_logits(kernel, mode):
    model = tiny_model(**MODELS["dream"], dtype=torch.float16).to(CUDA)
    _require(kernel, model.config.head_dim, gqa=True)
    specs = _specs(seed=12, count=7)
    canvases = {}
    for attention in (kernel, AttentionBackend.SDPA):
        engine = DLMEngine(model, stop_at_eos=False, attention=attention.value, kv_page_size=256)
        states = [engine.new_request(f"r{i}", p, g, b, mode) for i, (p, g, b, _) in enumerate(specs)]
        _run_staggered(engine, states, [t for *_, t in specs])
        canvases[attention] = [s.canvas for s in states]
    assert canvases[kernel] == canvases[AttentionBackend.SDPA]


@pytest.mark.parametrize("kernel", GRAPH_KERNELS)
def test_steps_replayed_from_cuda_graphs_commit_the_eager_tokens(kernel):
    loaded = load_model(MODEL_DIR, device="cuda", dtype=torch.float16)
    _require(kernel, loaded.model.config.head_dim)
    problems = TaskGenerator(seed=21).problems(24, max_shots=3, split=Split.HELD_OUT)
    canvases, graph_steps = {}, 0
    for graphs in (True, False):
        engine = DLMEngine.from_loaded(loaded, attention=kernel.value, cuda_graphs=graphs)
        states = [engine.new_request(f"q{i}", engine.encode(p.prompt), cache_mode=CacheMode.DUAL)
                  for i, p in enumerate(problems)]
        _run_staggered(engine, states, [0.9] * len(states), join_every=1)
        canvases[graphs] = [(s.canvas, s.num_steps) for s in states]
        graph_steps = max(graph_steps, engine.runner.num_graph_steps)
    assert graph_steps > 0
    assert canvases[True] == canvases[False]


@pytest.mark.parametrize("kernel", GRAPH_KERNELS)
def test_a_replayed_step_counts_the_keys_it_stores(kernel):
    """The pool's ``bytes_written`` is counted in Python, which a replay does not run: the runner adds
    what the captured step stores, so a replayed step counts what its plan says it wrote."""
    loaded = load_model(MODEL_DIR, device="cuda", dtype=torch.float16)
    _require(kernel, loaded.model.config.head_dim)
    engine = DLMEngine.from_loaded(loaded, attention=kernel.value, cuda_graphs=True)
    problem = TaskGenerator(seed=23).problems(1, max_shots=3, split=Split.HELD_OUT)[0]
    state = engine.new_request("q", engine.encode(problem.prompt), cache_mode=CacheMode.DUAL)
    engine.step([(state, 1.0)])  # the block's first step: a recompute, run eagerly
    before = engine.runner.kv_pool.bytes_written
    engine.step([(state, 1.0)])  # one token a step: the block is not done, a cache step follows
    assert engine.runner.last_step_graph
    assert engine.runner.kv_pool.bytes_written - before == engine.last_step_traffic[StepKind.CACHE].written > 0


@pytest.mark.parametrize("kernel", GRAPH_KERNELS)
def test_a_cuda_step_makes_no_hidden_synchronisation(kernel, monkeypatch):
    loaded = load_model(MODEL_DIR, device="cuda", dtype=torch.float16)
    _require(kernel, loaded.model.config.head_dim)
    engine = DLMEngine.from_loaded(loaded, attention=kernel.value)
    problems = TaskGenerator(seed=22).problems(8, max_shots=3, split=Split.HELD_OUT)
    states = [engine.new_request(f"q{i}", engine.encode(p.prompt), cache_mode=CacheMode.DUAL)
              for i, p in enumerate(problems)]
    engine.step([(s, 1.0) for s in states])  # recompute steps (and the graphs captured), outside the check
    engine.step([(s, 1.0) for s in states])
    read_back = engine.runner._to_host

    def allowed_read_back(packet):  # the step's one read-back waits on purpose
        torch.cuda.set_sync_debug_mode(0)
        try:
            return read_back(packet)
        finally:
            torch.cuda.set_sync_debug_mode(2)

    monkeypatch.setattr(engine.runner, "_to_host", allowed_read_back)
    torch.cuda.set_sync_debug_mode(2)  # any other synchronising call raises
    try:
        engine.step([(s, 0.9) for s in states])  # cache steps
    finally:
        torch.cuda.set_sync_debug_mode(0)
