"""Generate the modelled LLaDA-8B step-latency profile for H100 SXM (TP 1, 2, 4, 8).

Stdlib only. Running it rewrites ``profiles/llada-8b-h100.json`` next to this file::

    python profiles/model_h100.py            # writes the JSON, prints a summary
    python profiles/model_h100.py --check    # exits 1 if the JSON on disk is stale

The derivation (roofline per step, TP communication, calibration to the paper's TP scaling) is
written out in ``profiles/llada-8b-h100.md``; the constants below are the ones it names.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# LLaDA-8B (GSAI-ML/LLaDA-8B-Instruct config.json)
D_MODEL = 4096
NUM_LAYERS = 32
NUM_HEADS = 32  # no GQA: K and V have all 32 heads
MLP_HIDDEN = 12288  # SwiGLU: gate, up, down
VOCAB = 126464
BYTES_PER_PARAM = 2  # bf16

# Request shape the profile is measured at (DESIGN: prompt ~256 + generation 256, block 32)
CONTEXT_TOKENS = 512
BLOCK_LENGTH = 32
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
TP_DEGREES = (1, 2, 4, 8)

# H100 SXM 80GB
PEAK_FLOPS = 989e12  # dense bf16
PEAK_MFU = 0.60  # model FLOP utilisation reached by large GEMMs
MFU_HALF_TOKENS = 128  # tokens per GEMM at which MFU is half of PEAK_MFU
HBM_BYTES_PER_S = 3.35e12
HBM_EFFICIENCY = 0.80  # achievable share of peak HBM bandwidth
ALLREDUCE_BUS_BYTES_PER_S = 350e9  # NCCL ring all-reduce bus bandwidth over NVLink 4
ALLREDUCE_LATENCY_S = 15e-6  # per all-reduce call
STEP_OVERHEAD_S = 0.8e-3  # launch, sampling and commit per step (framework overhead)

# Paper, Fig. 4(a): step latency vs TP-1 at batch 1 (TP-2 about -25%, TP-4 about -55%)
PAPER_TP_RATIO = {2: 0.75, 4: 0.45}

PARAMS_PER_LAYER = 4 * D_MODEL * D_MODEL + 3 * D_MODEL * MLP_HIDDEN
PARAMS_BLOCKS = NUM_LAYERS * PARAMS_PER_LAYER
PARAMS_LM_HEAD = VOCAB * D_MODEL
# KV cache: K and V, every layer, every head, bf16
KV_BYTES_PER_TOKEN = 2 * NUM_LAYERS * D_MODEL * BYTES_PER_PARAM


def step_flops(query_tokens: int, key_tokens: int, logit_tokens: int) -> float:
    """FLOPs of one forward for one request (2 per multiply-add)."""
    linear = 2 * PARAMS_BLOCKS * query_tokens
    attention = NUM_LAYERS * 4 * query_tokens * key_tokens * D_MODEL  # QK^T and AV
    lm_head = 2 * PARAMS_LM_HEAD * logit_tokens
    return linear + attention + lm_head


def step_bytes(batch: int, kv_read_tokens: int, kv_write_tokens: int) -> float:
    """HBM bytes of one forward: every weight once, plus each request's KV traffic."""
    weights = (PARAMS_BLOCKS + PARAMS_LM_HEAD) * BYTES_PER_PARAM
    return weights + batch * (kv_read_tokens + kv_write_tokens) * KV_BYTES_PER_TOKEN


def mfu(tokens_per_gemm: float) -> float:
    """MFU grows with GEMM height (tokens in the batch) and saturates at PEAK_MFU."""
    return PEAK_MFU * tokens_per_gemm / (tokens_per_gemm + MFU_HALF_TOKENS)


def step_shape(recompute: bool) -> tuple[int, int, int, int, int]:
    """(query tokens, key tokens, logit tokens, KV read, KV write) per request.

    Recompute: full forward over prompt + generation, writes the cache, logits for the block.
    Cache step (dual cache): only the block's tokens, reading the whole cached sequence.
    """
    if recompute:
        return CONTEXT_TOKENS, CONTEXT_TOKENS, BLOCK_LENGTH, 0, CONTEXT_TOKENS
    return BLOCK_LENGTH, CONTEXT_TOKENS, BLOCK_LENGTH, CONTEXT_TOKENS, BLOCK_LENGTH


def work_seconds(batch: int, recompute: bool) -> float:
    """Roofline time of the step's GEMMs and memory traffic on one GPU (TP 1)."""
    query, keys, logits, kv_read, kv_write = step_shape(recompute)
    compute = batch * step_flops(query, keys, logits) / (PEAK_FLOPS * mfu(batch * query))
    memory = step_bytes(batch, kv_read, kv_write) / (HBM_BYTES_PER_S * HBM_EFFICIENCY)
    return max(compute, memory)


def allreduce_seconds(tp: int, batch: int, recompute: bool) -> float:
    """Two ring all-reduces per layer (after attention and after the MLP) of the activations."""
    if tp == 1:
        return 0.0
    query = step_shape(recompute)[0]
    message = batch * query * D_MODEL * BYTES_PER_PARAM
    one = 2 * (tp - 1) / tp * message / ALLREDUCE_BUS_BYTES_PER_S + ALLREDUCE_LATENCY_S
    return 2 * NUM_LAYERS * one


def step_seconds(tp: int, batch: int, recompute: bool, efficiency: float) -> float:
    split_work = work_seconds(batch, recompute) / (tp * efficiency)
    return split_work + allreduce_seconds(tp, batch, recompute) + STEP_OVERHEAD_S


def calibrate_efficiency() -> dict[int, float]:
    """TP efficiency per degree so that the batch-1 recompute step matches the paper's ratios.

    tp -> efficiency. TP-8 is not in the paper: it keeps TP-4's efficiency (no further gain).
    """
    tp1 = step_seconds(1, 1, True, 1.0)
    tp_to_efficiency = {1: 1.0}
    for tp, ratio in PAPER_TP_RATIO.items():
        budget = ratio * tp1 - allreduce_seconds(tp, 1, True) - STEP_OVERHEAD_S
        tp_to_efficiency[tp] = work_seconds(1, True) / (tp * budget)
    tp_to_efficiency[8] = tp_to_efficiency[4]
    return tp_to_efficiency


def build_profile() -> dict:
    tp_to_efficiency = calibrate_efficiency()
    tp_section = {}
    for tp in TP_DEGREES:
        eff = tp_to_efficiency[tp]
        tp_section[str(tp)] = {
            "recompute_ms": {str(b): round(1e3 * step_seconds(tp, b, True, eff), 3) for b in BATCH_SIZES},
            "cache_ms": {str(b): round(1e3 * step_seconds(tp, b, False, eff), 3) for b in BATCH_SIZES},
        }
    return {
        "model": "llada-8b",
        "device": "H100-SXM-80GB",
        "measured": False,
        "dtype": "bf16",
        "context_tokens": CONTEXT_TOKENS,
        "block_length": BLOCK_LENGTH,
        "cache_mode": "dual",
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        "tp_efficiency": {str(tp): round(e, 4) for tp, e in tp_to_efficiency.items()},
        "tp": tp_section,
        "notes": (
            "Modelled, not measured: roofline per step (max of FLOPs at a batch-dependent MFU up to "
            f"{PEAK_MFU:.0%} of {PEAK_FLOPS / 1e12:.0f} TFLOP/s and HBM traffic at {HBM_EFFICIENCY:.0%} of "
            f"{HBM_BYTES_PER_S / 1e12:.2f} TB/s), plus ring all-reduces and {STEP_OVERHEAD_S * 1e3:.1f} ms "
            "overhead per step; TP efficiency calibrated so batch-1 recompute steps are -25% (TP-2) and "
            "-55% (TP-4) vs TP-1 as in the DiLaServe paper. Generated by profiles/model_h100.py; "
            "derivation in profiles/llada-8b-h100.md."
        ),
    }


def render(profile: dict) -> str:
    return json.dumps(profile, indent=2) + "\n"


def summary(profile: dict) -> str:
    lines = ["tp  kind       " + " ".join(f"b={b:<6}" for b in BATCH_SIZES)]
    for tp, kinds in profile["tp"].items():
        for kind, curve in kinds.items():
            lines.append(f"{tp:<3} {kind:<10} " + " ".join(f"{curve[str(b)]:<8.2f}" for b in BATCH_SIZES))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("llada-8b-h100.json"))
    parser.add_argument("--check", action="store_true", help="fail if the file on disk differs")
    args = parser.parse_args(argv)
    text = render(build_profile())
    if args.check:
        stale = not args.out.exists() or args.out.read_text() != text
        print(f"{args.out}: {'stale' if stale else 'up to date'}")
        return 1 if stale else 0
    args.out.write_text(text)
    print(summary(json.loads(text)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
