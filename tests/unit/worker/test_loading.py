import json

import pytest
import torch
from safetensors.torch import save_file

from services.worker.decoding.rule import DecodingRule, decoding_rule
from services.worker.engine.engine import CacheMode, DLMEngine
from services.worker.model.loading import CheckpointError, load_model
from services.worker.reference import reference_generate
from tests.dream_checkpoint import write_dream_weights as _write_dream

from .conftest import tiny_model


def _write_llada(directory, model) -> None:
    c = model.config
    config = {"model_type": "llada", "d_model": c.d_model, "n_layers": c.n_layers, "n_heads": c.n_heads,
              "n_kv_heads": c.n_kv_heads, "mlp_hidden_size": c.mlp_hidden_size, "vocab_size": c.vocab_size,
              "embedding_size": c.vocab_size, "rope_theta": c.rope_theta, "mask_token_id": c.mask_token_id,
              "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id, "include_bias": False}
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "model.safetensors")


def test_llada_layout_checkpoint_loads_and_runs_a_step(tmp_path):
    original = tiny_model(seed=1, dtype=torch.float32)
    _write_llada(tmp_path, original)
    loaded = load_model(tmp_path)
    assert loaded.family == "llada"
    ids = torch.tensor([[3, 4, 5, 1, 1, 1]])
    assert torch.allclose(loaded.model(ids).logits, original(ids).logits, atol=1e-5)
    engine = DLMEngine(loaded.model, default_gen_length=8, default_block_length=4)
    state = engine.new_request("r", [3, 4, 5], cache_mode=CacheMode.DUAL)
    result = engine.step([(state, 0.9)])[0]
    assert len(result.committed_positions) >= 1


def test_dream_checkpoint_loads_with_gqa_bias_and_shifted_logits(tmp_path):
    original = tiny_model(seed=2, logits_shift=1, n_kv_heads=2, qkv_bias=True, dtype=torch.float32)
    _write_dream(tmp_path, original)
    loaded = load_model(tmp_path)
    assert loaded.family == "dream" and loaded.model.config.logits_shift == 1
    assert loaded.model.config.n_kv_heads == 2
    ids = torch.tensor([[3, 4, 5, 1, 1]])
    assert torch.allclose(loaded.model(ids).logits, original(ids).logits, atol=1e-5)
    assert decoding_rule(loaded.model.config) is DecodingRule.DREAM  # the family's default
    model = loaded.model.double()
    model.config.decoding_rule = DecodingRule.LLADA  # a model option (the Dream rule: test_dream_rule.py)
    engine = DLMEngine(model, stop_at_eos=False)
    state = engine.new_request("r", [3, 4, 5, 6], 8, 4, CacheMode.NONE)
    engine.run_to_completion([(state, 0.6)])
    reference = reference_generate(model, [3, 4, 5, 6], 8, 4, 0.6, stop_at_eos=False, rule=decoding_rule(model.config))
    assert state.canvas == reference.tokens


def test_dream_dual_cache_runs_to_completion(tmp_path):
    original = tiny_model(seed=2, logits_shift=1, n_kv_heads=2, qkv_bias=True, dtype=torch.float32)
    _write_dream(tmp_path, original)
    engine = DLMEngine(load_model(tmp_path).model, stop_at_eos=False)
    state = engine.new_request("r", [3, 4, 5, 6], 8, 4, CacheMode.DUAL)
    engine.run_to_completion([(state, 0.99)])
    assert state.finished and engine.mask_id not in state.canvas


@pytest.mark.parametrize(("family", "default"), [("llada", DecodingRule.LLADA), ("dream", DecodingRule.DREAM)])
def test_each_family_has_its_decoding_rule_and_config_json_may_name_another(tmp_path, family, default):
    if family == "dream":
        _write_dream(tmp_path, tiny_model(seed=1, logits_shift=1, qkv_bias=True, dtype=torch.float32))
    else:
        _write_llada(tmp_path, tiny_model(seed=1, dtype=torch.float32))
    assert decoding_rule(load_model(tmp_path).model.config) is default
    config = json.loads((tmp_path / "config.json").read_text())
    other = DecodingRule.LLADA if default is DecodingRule.DREAM else DecodingRule.DREAM
    (tmp_path / "config.json").write_text(json.dumps({**config, "decoding_rule": other.value}))
    assert decoding_rule(load_model(tmp_path).model.config) is other
    (tmp_path / "config.json").write_text(json.dumps({**config, "decoding_rule": "fast"}))
    with pytest.raises(CheckpointError, match="config.json: field 'decoding_rule' is 'fast'"):
        load_model(tmp_path)


def test_bundled_format_round_trips(tmp_path):
    original = tiny_model(seed=4, dtype=torch.float32)
    original.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    ids = torch.tensor([[3, 4, 1]])
    assert loaded.family == "dls" and torch.allclose(loaded.model(ids).logits, original(ids).logits)


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("no_dir", "does not exist"),
        ("no_config", "config.json: missing"),
        ("bad_json", "not valid JSON"),
        ("unknown_type", "field 'model_type'"),
        ("missing_field", "missing field 'd_model'"),
        ("no_weights", "no weight files"),
        ("missing_tensor", "weights missing from the checkpoint: model.transformer.blocks.1.q_proj.weight"),
        ("wrong_shape", "tensor 'model.transformer.wte.weight' has shape"),
        ("corrupt_weights", "cannot read weights"),
    ],
)
def test_malformed_checkpoint_directory_names_the_problem(tmp_path, breakage, message):
    model = tiny_model(seed=1, dtype=torch.float32)
    _write_llada(tmp_path, model)
    config = json.loads((tmp_path / "config.json").read_text())
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    target = tmp_path
    if breakage == "no_dir":
        target = tmp_path / "nope"
    elif breakage == "no_config":
        (tmp_path / "config.json").unlink()
    elif breakage == "bad_json":
        (tmp_path / "config.json").write_text("{not json")
    elif breakage == "unknown_type":
        (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    elif breakage == "missing_field":
        del config["d_model"]
        (tmp_path / "config.json").write_text(json.dumps(config))
    elif breakage == "no_weights":
        (tmp_path / "model.safetensors").unlink()
    elif breakage == "missing_tensor":
        del tensors["model.transformer.blocks.1.q_proj.weight"]
        save_file(tensors, tmp_path / "model.safetensors")
    elif breakage == "wrong_shape":
        tensors["model.transformer.wte.weight"] = torch.zeros(5, 5)
        save_file(tensors, tmp_path / "model.safetensors")
    elif breakage == "corrupt_weights":
        (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        load_model(target)
