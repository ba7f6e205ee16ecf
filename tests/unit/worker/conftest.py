import random

import pytest
import torch

from services.worker.model.dlm import DLMConfig, DLMForMaskedDiffusion


def tiny_model(seed: int = 0, logits_shift: int = 0, n_kv_heads: int | None = None, qkv_bias: bool = False,
               vocab_size: int = 24, dtype=torch.float64) -> DLMForMaskedDiffusion:
    """A randomly initialised tiny model with peaky outputs, so thresholds make a difference."""
    torch.manual_seed(seed)
    config = DLMConfig(vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads,
                       mlp_hidden_size=64, mask_token_id=1, pad_token_id=0, eos_token_id=2,
                       logits_shift=logits_shift, qkv_bias=qkv_bias, max_sequence_length=512)
    model = DLMForMaskedDiffusion(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.35)
    return model.to(dtype).eval()


@pytest.fixture
def model():
    return tiny_model()


def random_specs(seed: int, count: int, *, prompt_lengths=(1, 40), first_threshold: float | None = None,
                 modes=None) -> list[tuple]:
    """Random requests for token-for-token tests: (prompt ids, gen length, block length, threshold), and
    the cache mode when ``modes`` is given (taken in turn). Prompt and canvas lengths are mixed and
    blocks ragged; ``first_threshold`` fixes the first request's threshold."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(3, 24) for _ in range(rng.randint(*prompt_lengths))]
        block = rng.choice([4, 8])
        gen = block * rng.randint(1, 3) + rng.choice([0, 0, 3])
        if i == 0 and first_threshold is not None:
            threshold = first_threshold
        else:
            threshold = rng.choice([0.3, 0.6, 0.9, 0.99])
        out.append((prompt, gen, block, threshold) + ((modes[i % len(modes)],) if modes else ()))
    return out
