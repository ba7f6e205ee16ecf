import pytest
import torch

from services.worker.model import DLMConfig, DLMForMaskedDiffusion


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
