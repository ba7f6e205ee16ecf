"""Engine speed on a random-weight LLaDA-architecture model: tokens/s by batch, and KV bytes moved.

    python -m bench.engine --device cuda --arch llada-8b --json runs/bench-engine-speed.json
    python -m bench.engine_speed --device cpu --arch llada-small        # the same module, directly
    ... --profile profiles/llada-8b-h200-measured.json                    # also write a step-latency profile

Implementations decode the same random prompts (gen ``--gen-length``, blocks of ``--block-length``,
every request the same prompt length, EOS ignored so every canvas is decoded):

* ``engine``: ``DLMEngine``, dual cache, threshold ``--threshold``, attention ``auto`` (flash-attn's
  varlen kernel where it is installed on CUDA, else PyTorch's varlen op, else flex_attention; SDPA on
  a CPU), dual-cache steps replayed from CUDA graphs on CUDA;
* ``engine_eager`` (CUDA only): the same without CUDA graphs;
* ``no_cache_loop``: LLaDA's plain loop, the baseline Fast-dLLM compares with: a full forward over
  the padded batch every step, one token committed per request per step (the most confident masked
  position of the current block).

Weights that commit several tokens per step (``--tokens-per-step``, default 3 for ``llada-8b``, as
LLaDA commits about 3.25 on GSM8K at 0.9): random weights are rarely confident, so the LM head is
scaled by the factor (``lm_head_scale``, found by bisection over one-block decodes before anything is
timed) at which a block decodes in about that many tokens per step; ``--lm-head-scale`` sets it.

The floor (``--floor``, default on CUDA): the same model's dense cache step of the same shape (B
requests x ``--block-length`` tokens: RMSNorm, q/k/v with RoPE, the block's keys and values written
into the last slots of a contiguous ``[B, H_kv, prompt + gen, D]`` cache per layer, one SDPA call
over it, the MLP, the LM head over the block and softmax/max), captured in one CUDA graph and
replayed (eager on a CPU): what the hardware needs for the step. ``floor_ms_by_batch`` beside
``engine_cache_step_ms_by_batch`` (the engine's dual-cache step at the same batch and context, median
of ``--profile-repeats``) and ``engine_over_floor``.

Figures:

* ``tokens_per_s_by_batch`` {impl: {batch: committed tokens per second}}. The engine runs the first
  ``--blocks`` blocks of the canvas (each block: one recompute step, then cache steps; every block
  costs the same with the dual cache, whose steps read the whole canvas); the no-cache loop runs
  ``--loop-steps`` steps, which all cost the same. Both after one warm-up round.
* with ``--compile``, ``engine_compiled``: ``engine`` with every block's RMSNorm + SwiGLU run through
  one ``torch.compile``d graph (compiled during the warm-up, not timed).
* ``tokens_per_step_by_batch``: committed tokens per request per step (``lm_head_scale`` above).
* ``kv_bytes_copied_per_cache_step`` / ``kv_bytes_written_per_cache_step``: per cache-step forward
  (the batch's cache steps run as one forward), at batch 8 (else the largest batch measured), from
  the engine's own counters; ``kv_bytes_by_batch`` has every batch, and ``gathered_before``: what the
  engine's earlier gather of every request's context into a padded buffer copied for the same
  steps (computed: context positions times bytes per position).
* ``engine_bookkeeping_ms_per_step_by_batch``: the engine's own host work per step (planning each
  request's step, building the step's host arrays, applying the commits to each canvas), timed as
  ``engine.step`` less the model runner's forward in the same run: the part of a step that a faster
  device does not shorten.
* ``--profile PATH``: the engine's step latencies (recompute, cache and no-cache steps, by batch, at
  prompt plus generation tokens of context; ``services/worker/profiling.py``) written as a measured
  latency profile (``profiles/README.md``), which the scheduler and the simulator can load.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import emit_json
from services.worker.engine.engine import DLMEngine
from services.worker.model.dlm import DLMConfig, DLMForMaskedDiffusion, apply_rope
from services.worker.profiling import measure as measure_step_latency
from shared.messages.base import CacheMode, StepKind


@dataclass(frozen=True)
class Arch:
    config: dict
    dtype: torch.dtype
    prompt_length: int


LLADA_8B = dict(vocab_size=126464, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, mlp_hidden_size=12288,
                rope_theta=500000.0, max_sequence_length=4096, mask_token_id=126336, eos_token_id=126081,
                pad_token_id=126081)
ARCHS = {
    # LLaDA-8B's shape (the public checkpoint's config), bf16
    "llada-8b": Arch(LLADA_8B, torch.bfloat16, 256),
    # the same blocks, small enough for a 2-core CPU (vocabulary cut so the LM head does not dominate)
    "llada-small": Arch(dict(LLADA_8B, vocab_size=4096, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4,
                             mlp_hidden_size=768, mask_token_id=4095, eos_token_id=4094, pad_token_id=4094),
                        torch.float32, 64),
    "llada-tiny": Arch(dict(LLADA_8B, vocab_size=256, d_model=64, n_layers=2, n_heads=2, n_kv_heads=2,
                            mlp_hidden_size=128, mask_token_id=255, eos_token_id=254, pad_token_id=254),
                       torch.float32, 16),
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def random_model(arch: Arch, device: str, seed: int) -> DLMForMaskedDiffusion:
    """Random weights (the model's own init), built on ``device`` directly."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = DLMForMaskedDiffusion(DLMConfig(**arch.config))
    return model.to(arch.dtype).eval()


def random_prompts(config: DLMConfig, batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    ordinary = min(config.mask_token_id, config.eos_token_id, config.pad_token_id)  # ids below the special ones
    return torch.randint(0, ordinary, (batch, length), generator=g).tolist()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --- the engine ---------------------------------------------------------------------------------


@dataclass
class EngineRun:
    tokens: int = 0
    steps: int = 0  # request-steps
    seconds: float = 0.0
    cache_forwards: int = 0
    copied: int = 0
    written: int = 0
    gathered_before: int = 0
    forwards: int = 0  # engine steps (one forward each)
    bookkeeping_seconds: float = 0.0  # in the engine's step, outside the model runner's forward


class _RunnerClock:
    """Times the model runner's forward (arrays to the device, the forward, the commit rule, the
    read-back) inside ``engine.step``; the rest of the step is the engine's host bookkeeping."""

    def __init__(self, engine: DLMEngine):
        self.runner, self.seconds = engine.runner, 0.0

    def __enter__(self):
        forward = self.runner.forward

        def timed(batch):
            began = time.perf_counter()
            try:
                return forward(batch)
            finally:
                self.seconds += time.perf_counter() - began

        self.runner.forward = timed
        return self

    def __exit__(self, *exc):
        del self.runner.forward  # the class's method again


def run_engine(engine: DLMEngine, prompts, args, tag: str) -> EngineRun:
    """Decode the first ``args.blocks`` blocks of every request (dual cache) and count what moved."""
    states = [engine.new_request(f"{tag}{i}", p, args.gen_length, args.block_length, CacheMode.DUAL, ignore_eos=True)
              for i, p in enumerate(prompts)]
    per_token = engine.kv_memory().bytes_per_token
    run = EngineRun()
    active = [(s, args.threshold) for s in states]
    _sync(args.device)
    began = time.perf_counter()
    with _RunnerClock(engine) as clock:
        while active:
            context = sum(_context_length(s, engine) for s, _ in active
                          if engine.next_step_kind(s) is StepKind.CACHE)
            stepped, in_runner = time.perf_counter(), clock.seconds
            results = engine.step(active)
            run.bookkeeping_seconds += time.perf_counter() - stepped - (clock.seconds - in_runner)
            run.forwards += 1
            run.tokens += sum(len(r.committed_positions) for r in results)
            run.steps += len(results)
            traffic = engine.last_step_traffic.get(StepKind.CACHE)
            if traffic is not None:
                run.cache_forwards += 1
                run.copied += traffic.copied
                run.written += traffic.written
                run.gathered_before += context * per_token
            active = [(s, t) for s, t in active if not s.finished and s.current_block(engine.mask_id) < args.blocks]
    _sync(args.device)
    run.seconds = time.perf_counter() - began
    for s in states:
        engine.drop(s.request_id)
    return run


def _context_length(state, engine: DLMEngine) -> int:
    """Positions outside a dual-cache step's window: what the old gather copied for it."""
    start, end = state.block_bounds(state.current_block(engine.mask_id))
    return len(state.prompt_ids) + state.gen_length - (end - start + engine.shift)


# --- LLaDA's plain loop -------------------------------------------------------------------------


@torch.no_grad()
def run_no_cache_loop(model: DLMForMaskedDiffusion, prompts, args) -> tuple[int, float]:
    """(tokens committed, seconds) over ``args.loop_steps`` steps of the plain loop."""
    config = model.config
    prompt_len = len(prompts[0])
    x = torch.tensor([p + [config.mask_token_id] * args.gen_length for p in prompts], device=model.device)
    rows = torch.arange(len(prompts), device=model.device)
    _sync(args.device)
    began = time.perf_counter()
    for step in range(args.loop_steps):
        start = prompt_len + (step // args.block_length) * args.block_length  # one token per step per block slot
        end = start + args.block_length
        logits = model(x).logits[:, start:end].float()
        logits[..., config.mask_token_id] = float("-inf")
        confidence, tokens = torch.softmax(logits, dim=-1).max(dim=-1)
        confidence[x[:, start:end] != config.mask_token_id] = float("-inf")  # committed positions stay
        best = confidence.argmax(dim=-1)
        x[rows, start + best] = tokens[rows, best]
    _sync(args.device)
    return args.loop_steps * len(prompts), time.perf_counter() - began


# --- the benchmark ------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict:
    arch = ARCHS[args.arch]
    if args.threads:
        torch.set_num_threads(args.threads)
    model = random_model(arch, args.device, args.seed)
    prompt_length = args.prompt_length or arch.prompt_length
    def engine(attention: str = "auto", cuda_graphs: bool | None = None) -> DLMEngine:
        return DLMEngine(model, stop_at_eos=False, default_gen_length=args.gen_length,
                         default_block_length=args.block_length, attention=attention, cuda_graphs=cuda_graphs)

    engines = {"engine": engine()}
    if args.device.startswith("cuda"):
        engines["engine_eager"] = engine(cuda_graphs=False)
    if args.sdpa:
        engines["engine_sdpa"] = engine("sdpa", cuda_graphs=False)
    if args.compile:  # the engine again, its blocks' MLPs compiled (model.compile_mlp, on only for this run)
        engines["engine_compiled"] = engine()
    scale = args.lm_head_scale
    if scale is None and args.tokens_per_step:
        scale = calibrate_lm_head(engines["engine"], random_prompts(model.config, 1, prompt_length, args.seed + 99)[0],
                                  args)
    if scale and scale != 1.0:
        with torch.no_grad():
            model.model.transformer.ff_out.weight.mul_(scale)
    log(f"{args.arch}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {arch.dtype}, "
        f"{args.device}, prompt {prompt_length}, gen {args.gen_length}, block {args.block_length}; "
        + ", ".join(f"{name}: {e.attention.value}" for name, e in engines.items()))
    tokens_per_s: dict[str, dict[str, float]] = {name: {} for name in [*engines, "no_cache_loop"]}  # impl -> batch -> tok/s
    tokens_per_step: dict[str, dict[str, float]] = {name: {} for name in engines}  # impl -> batch -> tokens/step
    kv_by_batch: dict[str, dict[str, int]] = {}  # batch -> figure -> bytes per cache step
    bookkeeping: dict[str, float] = {}  # batch -> the engine's host ms per step, outside the runner
    for batch in args.batches:
        prompts = random_prompts(model.config, batch, prompt_length, args.seed + batch)
        for name, engine in engines.items():
            model.compile_mlp(name == "engine_compiled")
            run_engine(engine, prompts, _warm_up(args), f"w{name}{batch}-")  # compiles, the first time
            run = run_engine(engine, prompts, args, f"{name}{batch}-")
            model.compile_mlp(False)
            tokens_per_s[name][str(batch)] = round(run.tokens / run.seconds, 2)
            tokens_per_step[name][str(batch)] = round(run.tokens / run.steps, 3)
            if name == "engine":
                bookkeeping[str(batch)] = round(1000 * run.bookkeeping_seconds / run.forwards, 3)
            if name == "engine" and run.cache_forwards:
                kv_by_batch[str(batch)] = {
                    "copied": run.copied // run.cache_forwards, "written": run.written // run.cache_forwards,
                    "gathered_before": run.gathered_before // run.cache_forwards,
                }
            log(f"batch {batch} {name}: {tokens_per_s[name][str(batch)]} tok/s ({run.tokens} tokens, "
                f"{run.seconds:.2f}s, {1000 * run.bookkeeping_seconds / run.forwards:.3f} ms per step outside "
                f"the runner), kv per cache step {kv_by_batch.get(str(batch))}")
        run_no_cache_loop(model, prompts, _warm_up(args))
        tokens, seconds = run_no_cache_loop(model, prompts, args)
        tokens_per_s["no_cache_loop"][str(batch)] = round(tokens / seconds, 2)
        log(f"batch {batch} no_cache_loop: {tokens_per_s['no_cache_loop'][str(batch)]} tok/s")
    kv_batch = "8" if "8" in kv_by_batch else max(kv_by_batch, key=int, default=None)
    kv = kv_by_batch.get(kv_batch, {})
    steps = write_profile(engines["engine"], args, prompt_length) if args.profile else {}
    floor = {}
    if args.floor:
        floor = measure_floor_and_engine(model, engines["engine"], args, prompt_length, steps)
    return {
        "arch": args.arch,
        "device": args.device,
        "device_name": _device_name(args.device),
        "dtype": str(arch.dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in model.parameters()),
        "prompt_length": prompt_length,
        "gen_length": args.gen_length,
        "block_length": args.block_length,
        "threshold": args.threshold,
        "cache_mode": "dual",
        "batches": list(args.batches),
        "attention_backend": {name: e.attention.value for name, e in engines.items()},
        "tokens_per_s_by_batch": tokens_per_s,
        "tokens_per_step_by_batch": tokens_per_step,
        "ratios": _ratios(tokens_per_s),
        "kv_bytes_batch": int(kv_batch) if kv_batch else None,
        "kv_bytes_copied_per_cache_step": kv.get("copied"),
        "kv_bytes_written_per_cache_step": kv.get("written"),
        "kv_bytes_by_batch": kv_by_batch,
        "kv_bytes_per_token": engines["engine"].kv_memory().bytes_per_token,
        # the engine's request bookkeeping per step (planning, host arrays, applying commits), outside the
        # model runner's forward: host time a GPU's speed does not shorten
        "engine_bookkeeping_ms_per_step_by_batch": bookkeeping,
        "measured": {"engine_blocks": args.blocks, "no_cache_loop_steps": args.loop_steps},
        "lm_head_scale": scale or 1.0,
        "cuda_graphs": {name: e.runner.graphs_enabled for name, e in engines.items()},
        **floor,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def write_profile(engine: DLMEngine, args: argparse.Namespace, prompt_length: int) -> dict[str, dict[str, float]]:
    """Step latencies of ``engine`` by batch, as a measured latency profile at ``args.profile``; returns
    them (kind -> batch -> ms)."""
    context = prompt_length + args.gen_length
    by_kind: dict[str, dict[str, float]] = {"recompute_ms": {}, "cache_ms": {}, "full_ms": {}}  # kind -> batch -> ms
    for batch in args.profile_batches:
        for kind, ms in measure_step_latency(engine, batch, context, args.profile_repeats, args.seed).items():
            by_kind[kind][str(batch)] = ms
        log(f"profile batch {batch}: " + ", ".join(f"{k} {v[str(batch)]}" for k, v in by_kind.items()))
    profile = {
        "model": args.arch,
        "device": _device_name(args.device),
        "measured": True,
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "context_tokens": context,
        "block_length": args.block_length,
        "gen_length": args.gen_length,
        "cache_mode": "dual",
        "attention": engine.attention.value,
        "cuda_graphs": engine.runner.graphs_enabled,
        "kv_bytes_per_token": engine.kv_memory().bytes_per_token,
        "measured_on": (f"{_device_name(args.device)}, {platform.python_implementation()} "
                        f"{platform.python_version()}, torch {torch.__version__}, attention {engine.attention.value}, "
                        f"CUDA graphs {'on' if engine.runner.graphs_enabled else 'off'}, "
                        f"{time.strftime('%Y-%m-%d')}: python -m bench.engine --arch {args.arch} --device "
                        f"{args.device} --profile ... (random weights, prompt {prompt_length}, gen {args.gen_length}, "
                        f"block {args.block_length}, median of {args.profile_repeats} repeats); TP 1 only"),
        # a measurement may dip at some batch (noise, a kernel choice); the loader then times each batch as
        # the fastest batch at least as large, and says which points it changed (shared/profiles.py)
        "batch_monotone": "min-over-larger",
        "tp": {"1": by_kind},
        "notes": ("Measured at TP 1 by bench.engine (the tp section holds the measurement as it was taken)."
                  + (" TP 2, 4 and 8 are not measured: tp_scaling gives them from TP 1 through the modelled H100 "
                     "profile's tensor-parallel model (shared/profiles.py)." if args.arch == "llada-8b" else "")),
    }
    if args.arch == "llada-8b":  # the same shape as the modelled profile: its TP model gives TP > 1
        profile["tp_scaling"] = {"from_tp": 1, "like": "llada-8b-h100.json"}
    Path(args.profile).parent.mkdir(parents=True, exist_ok=True)
    Path(args.profile).write_text(json.dumps(profile, indent=2) + "\n")
    log(f"profile written to {args.profile}")
    return by_kind


# --- weights that commit several tokens per step ------------------------------------------------


def _one_block(engine: DLMEngine, prompt: list[int], args: argparse.Namespace) -> float:
    """Tokens per step decoding the first block of ``prompt`` at ``args.threshold`` (batch 1)."""
    state = engine.new_request("calibrate", prompt, args.gen_length, args.block_length, CacheMode.DUAL,
                               ignore_eos=True)
    steps = tokens = 0
    while state.current_block(engine.mask_id) == 0 and not state.finished:
        tokens += len(engine.step([(state, args.threshold)])[0].committed_positions)
        steps += 1
    engine.drop(state.request_id)
    return tokens / steps


def calibrate_lm_head(engine: DLMEngine, prompt: list[int], args: argparse.Namespace) -> float:
    """The LM-head scale at which one block decodes in about ``args.tokens_per_step`` tokens per step:
    bisection on its logarithm between 1 and 4096 (more confident logits commit more tokens per step)."""
    head = engine.model.model.transformer.ff_out.weight
    original = head.detach().clone()
    low, high = 0.0, 12.0  # log2 of the scale
    with torch.no_grad():
        for _ in range(args.calibration_rounds):
            mid = (low + high) / 2
            head.copy_(original * 2.0 ** mid)
            rate = _one_block(engine, prompt, args)
            log(f"calibration: lm head x{2.0 ** mid:.2f} -> {rate:.2f} tokens per step")
            low, high = (mid, high) if rate < args.tokens_per_step else (low, mid)
        head.copy_(original)
    return round(2.0 ** ((low + high) / 2), 3)


# --- the floor: a dense cache step of the same shape, in one CUDA graph -------------------------


@torch.no_grad()
def dense_cache_step(model: DLMForMaskedDiffusion, ids: torch.Tensor, positions: torch.Tensor,
                     keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """One dual-cache step of ``ids`` [B, W] over contiguous caches ``keys``/``values`` [B, H_kv, C, D] per
    layer (the block's keys and values written into the last W slots), plain torch with the model's
    own layers; the confidences [B, W]."""
    transformer = model.model.transformer
    batch, width = ids.shape
    x = transformer.wte(ids)
    cos, sin = model.rope.lookup(positions, model.rope_dtype, int(positions.max()))  # [W, Dh]
    for block, k_cache, v_cache in zip(transformer.blocks, keys, values, strict=True):
        h = block.attn_norm(x)
        heads = block.n_heads, block.n_kv_heads, block.head_dim
        q = apply_rope(block.q_proj(h).view(batch, width, heads[0], heads[2]).transpose(1, 2), cos, sin)
        k = apply_rope(block.k_proj(h).view(batch, width, heads[1], heads[2]).transpose(1, 2), cos, sin)
        v = block.v_proj(h).view(batch, width, heads[1], heads[2]).transpose(1, 2)
        k_cache[:, :, -width:].copy_(k)
        v_cache[:, :, -width:].copy_(v)
        out = torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=heads[0] != heads[1])
        x = block._mlp(x + block.attn_out(out.transpose(1, 2).reshape(batch, width, -1)))
    logits = transformer.ff_out(transformer.ln_f(x)).float()
    return torch.softmax(logits, dim=-1).max(dim=-1).values


def floor_ms(model: DLMForMaskedDiffusion, batch: int, context: int, block: int, repeats: int) -> float:
    """Median milliseconds of ``dense_cache_step`` at ``batch``: replays of one CUDA graph on CUDA, eager
    calls elsewhere."""
    device, config = model.device, model.config
    layer = model.model.transformer.blocks[0]
    ids = torch.randint(0, config.vocab_size - 3, (batch, block), device=device)
    positions = torch.arange(context - block, context, device=device)
    shape = (batch, layer.n_kv_heads, context, layer.head_dim)
    keys = [torch.randn(shape, dtype=model.dtype, device=device) for _ in model.model.transformer.blocks]
    values = [torch.randn(shape, dtype=model.dtype, device=device) for _ in model.model.transformer.blocks]
    model.rope.reserve(device, context)

    def run():
        return dense_cache_step(model, ids, positions, keys, values)

    if device.type == "cuda":
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    run()
    samples = []
    for _ in range(repeats):
        _sync(str(device))
        began = time.perf_counter()
        run()
        _sync(str(device))
        samples.append((time.perf_counter() - began) * 1000)
    return round(statistics.median(samples), 3)


def measure_floor_and_engine(model, engine: DLMEngine, args: argparse.Namespace, prompt_length: int,
                             steps: dict[str, dict[str, float]]) -> dict:
    """The floor and the engine's dual-cache step at each of ``args.floor_batches`` (the profile's
    measurement where it has the batch), and their ratio."""
    context = prompt_length + args.gen_length
    floor, engine_ms = {}, {}
    for batch in args.floor_batches:
        floor[str(batch)] = floor_ms(model, batch, context, args.block_length, args.floor_repeats)
        measured = steps.get("cache_ms", {}).get(str(batch))
        if measured is None:
            measured = measure_step_latency(engine, batch, context, args.profile_repeats, args.seed)["cache_ms"]
        engine_ms[str(batch)] = measured
        log(f"floor batch {batch}: {floor[str(batch)]} ms, engine cache step {engine_ms[str(batch)]} ms "
            f"({engine_ms[str(batch)] / floor[str(batch)]:.2f}x)")
    return {
        "floor_ms_by_batch": floor,
        "floor_graph": model.device.type == "cuda",
        "engine_cache_step_ms_by_batch": engine_ms,
        "engine_over_floor": {b: round(engine_ms[b] / floor[b], 3) for b in floor},
    }


def _warm_up(args: argparse.Namespace) -> argparse.Namespace:
    """The same run, shortened: one block of the engine, two steps of the loop."""
    return argparse.Namespace(**{**vars(args), "blocks": 1, "loop_steps": 2})


def _ratios(tokens_per_s: dict[str, dict[str, float]]) -> dict[str, float]:
    engine, loop = tokens_per_s["engine"], tokens_per_s["no_cache_loop"]
    out = {f"engine_over_no_cache_loop_at_batch_{b}": round(engine[b] / loop[b], 3) for b in engine}
    if "1" in engine and "8" in engine:
        out["engine_batch8_over_batch1"] = round(engine["8"] / engine["1"], 3)
        out["engine_batch8_over_no_cache_loop_batch1"] = round(engine["8"] / loop["1"], 3)
    return out


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=sorted(ARCHS), required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="write the figures to this path too")
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=None,
                   help="comma-separated batch sizes (default: 1,8,32 on CUDA, 1,8 on a CPU)")
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--prompt-length", type=int, default=0, help="default: the architecture's")
    p.add_argument("--blocks", type=int, default=0, help="blocks the engine decodes (default: 2 on CUDA, all on a CPU)")
    p.add_argument("--loop-steps", type=int, default=8, help="steps of the no-cache loop timed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="also measure engine_compiled (torch.compile'd MLPs)")
    p.add_argument("--sdpa", action="store_true", help="also measure engine_sdpa (one padded SDPA call per layer)")
    p.add_argument("--tokens-per-step", type=float, default=None,
                   help="scale the LM head so a block decodes in about this many tokens per step (default: 3 "
                        "for llada-8b, else 0: the random weights as they are)")
    p.add_argument("--lm-head-scale", type=float, default=None, help="scale the LM head by this (no calibration)")
    p.add_argument("--calibration-rounds", type=int, default=8)
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=None,
                   help="measure the graph-captured dense floor and the engine over it (default: on CUDA)")
    p.add_argument("--floor-batches", type=lambda s: [int(b) for b in s.split(",")], default=None,
                   help="default: 1,8,32 on CUDA, 1,8 on a CPU")
    p.add_argument("--floor-repeats", type=int, default=20)
    p.add_argument("--profile", help="also write the engine's step latencies as a measured profile to this path")
    p.add_argument("--profile-batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--profile-repeats", type=int, default=3)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.batches = args.batches or ([1, 8, 32] if cuda else [1, 8])
    args.blocks = args.blocks or (2 if cuda else -(-args.gen_length // args.block_length))
    if args.tokens_per_step is None:
        args.tokens_per_step = 3.0 if args.arch == "llada-8b" and args.lm_head_scale is None else 0.0
    args.floor = cuda if args.floor is None else args.floor
    args.floor_batches = args.floor_batches or ([1, 8, 32] if cuda else [1, 8])
    emit_json(measure(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
