"""bf16 follows the reference modeling code's precision (issue 39, item 7).

LLaDA's modeling code (``modeling_llada.py``) and Dream's (``modeling_dream.py``, Qwen2's) run a bf16
model with a few steps in float32: RMSNorm normalises in float32 and casts back *before* the weight
multiplies (in bf16); LLaDA rotates queries and keys in float32 (``rope_full_precision``), Dream in the
model's dtype with cos/sin cast to it. The first tests pin those formulas (written here from the
published code) against the model's layers; the last decodes in bf16 with the engine and with the
project's reference decoder run the reference's way (the padded forward, keys in position order, no
mask where there is no padding), token for token, in every cache mode.
"""

import random

import pytest
import torch

from services.worker.engine.engine import DLMEngine
from services.worker.model.dlm import RMSNorm, apply_rope
from services.worker.reference import reference_generate
from shared.messages.base import CacheMode

from .conftest import tiny_model

MODES = [CacheMode.NONE, CacheMode.PREFIX, CacheMode.DUAL]


def test_rms_norm_casts_back_before_the_weight_as_llada_and_dream_do():
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x = (torch.randn(16, 64) * 3).to(torch.bfloat16)
    h = x.float()
    published = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    weight_in_fp32 = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.float()).to(torch.bfloat16)
    assert torch.equal(norm(x), published)
    assert not torch.equal(published, weight_in_fp32)  # the order is visible in bf16: the test can fail


@pytest.mark.parametrize("full_precision", [True, False])
def test_rope_runs_in_float32_for_llada_and_in_the_model_dtype_for_dream(full_precision):
    model = tiny_model(dtype=torch.bfloat16)
    model.config.rope_full_precision = full_precision
    positions = torch.arange(40, 60)
    cos, sin = model.rope.lookup(positions[:, None], model.rope_dtype)
    q = torch.randn(20, 4, 8).to(torch.bfloat16)
    half = 4
    if full_precision:  # LLaDA: q.float(), fp32 sin/cos, the rotation in fp32, then back
        f = q.float()
        expected = (f * cos + torch.cat((-f[..., half:], f[..., :half]), -1) * sin).to(torch.bfloat16)
    else:  # Qwen2/Dream: cos/sin cast to the model's dtype, the rotation in it
        expected = q * cos + torch.cat((-q[..., half:], q[..., :half]), -1) * sin
    assert cos.dtype == (torch.float32 if full_precision else torch.bfloat16)
    assert torch.equal(apply_rope(q, cos, sin), expected)


def _specs(seed: int, count: int, same_length: bool):
    rng = random.Random(seed)
    length = rng.randint(4, 40)
    return [([rng.randrange(3, 60) for _ in range(length if same_length else rng.randint(4, 40))], 32, 8,
             rng.choice([0.5, 0.7, 0.9])) for _ in range(count)]


@pytest.mark.parametrize("mode", MODES)
def test_bf16_engine_decodes_the_reference_decoders_tokens(mode):
    model = tiny_model(seed=0, dtype=torch.bfloat16, vocab_size=64)
    # batch 1 (several prompts of their own lengths), then a batch whose requests share their lengths:
    # one SDPA call reads exactly each request's keys there (a mixed batch pads keys to the longest,
    # which sums them in another order: in bf16 that may round differently, see docs/performance.md)
    for batched, specs in ((False, _specs(1, 6, same_length=False)), (True, _specs(2, 6, same_length=True))):
        engine = DLMEngine(model, stop_at_eos=False, kv_page_size=4)
        states = [engine.new_request(f"r{i}", p, g, b, mode) for i, (p, g, b, _) in enumerate(specs)]
        if batched:
            engine.run_to_completion([(s, t) for s, (*_, t) in zip(states, specs, strict=True)])
        else:
            for s, (*_, t) in zip(states, specs, strict=True):
                engine.run_to_completion([(s, t)])
        for state, (prompt, gen, block, tau) in zip(states, specs, strict=True):
            ref = reference_generate(model, prompt, gen, block, tau, stop_at_eos=False, cache=mode.value)
            assert (state.canvas, state.num_steps) == (ref.tokens, ref.num_steps), (batched, state.request_id)
