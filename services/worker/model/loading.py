"""Loading a model directory: the bundled format, public LLaDA checkpoints, and Dream checkpoints.

* bundled (``model_type: dls-dlm``): ``save_pretrained`` output plus ``tokenizer.json``.
* LLaDA (``model_type: llada``): the public layout ``model.transformer.{wte, blocks.N.{q_proj, ...,
  ff_out}, ln_f, ff_out}`` in safetensors or ``pytorch_model*.bin`` files (sharded or not); mask id
  126336. Parameter names match ours, so only the config is translated.
* Dream (``model_type: Dream``): Qwen2-style names (``model.layers.N.self_attn.q_proj`` ...),
  grouped-query attention with q/k/v biases, logits shifted by one position.

Each family's decoding rule (``services/worker/decoding/rule.py``) is set on the model config
(``config.decoding_rule``): ``llada`` for the bundled model and LLaDA, Fast-dLLM's ``dream`` rule for
Dream; a ``decoding_rule`` field in ``config.json`` chooses another.

Tokenizers of LLaDA and Dream directories load through ``shared.tokenizer.load_hf_tokenizer``, as the
gateway loads them: code a checkpoint ships (Dream-org's ``tokenization_dream.py``) runs only with
``trust_remote_code`` (``DLS_TRUST_REMOTE_CODE``); without it, its ``tokenizer.json`` where it has one.

Every problem with a directory is reported as a :class:`CheckpointError` naming the file, field or
tensor that is wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.decoding.rule import CONFIG_KEY as RULE_KEY
from services.worker.decoding.rule import DecodingRule, parse_rule
from services.worker.model.dlm import DLMConfig, DLMForMaskedDiffusion
from shared.generation import GenerationLimits, read_generation_limits
from shared.served import model_name
from shared.tokenizer import TOKENIZER_FILE, CharTokenizer, TokenizerError, load_hf_tokenizer

LLADA_MASK_ID = 126336
DREAM_MASK_ID = 151666


class CheckpointError(ValueError):
    """A model directory that cannot be loaded; the message names what is wrong."""


@dataclass
class LoadedModel:
    model: DLMForMaskedDiffusion
    tokenizer: object | None
    limits: GenerationLimits  # default canvas and block, longest canvas
    name: str
    family: str  # "dls", "llada" or "dream"


def load_model(directory: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
               trust_remote_code: bool = False) -> LoadedModel:
    """``trust_remote_code``: let transformers run tokenizer code the checkpoint ships (the worker's
    ``DLS_TRUST_REMOTE_CODE``)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: model directory does not exist")
    raw = _read_config(directory)
    model_type = str(raw.get("model_type", "")).lower()
    if model_type == DLMConfig.model_type:
        loaded = _load_bundled(directory)
    elif model_type == "llada":
        loaded = _load_foreign(directory, _llada_config(raw, directory), _llada_name, "llada", trust_remote_code)
    elif model_type == "dream":
        loaded = _load_foreign(directory, _dream_config(raw, directory), _dream_name, "dream", trust_remote_code)
    else:
        raise CheckpointError(
            f"{directory / 'config.json'}: field 'model_type' is {raw.get('model_type')!r}; "
            f"expected '{DLMConfig.model_type}', 'llada' or 'Dream'"
        )
    loaded.model.to(device=device, dtype=dtype or loaded.model.dtype).eval()
    return loaded


def _read_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (every model directory needs a config.json)") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return raw


def _load_bundled(directory: Path) -> LoadedModel:
    if not _weight_files(directory):
        raise CheckpointError(f"{directory}: no weight files (model.safetensors or pytorch_model.bin)")
    try:
        model = DLMForMaskedDiffusion.from_pretrained(directory)
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{directory}: cannot load weights ({exc})") from None
    _rule({RULE_KEY: getattr(model.config, RULE_KEY, None)}, directory, DecodingRule.LLADA)  # a bad one: named
    tokenizer = CharTokenizer.from_pretrained(directory) if (directory / TOKENIZER_FILE).exists() else None
    return LoadedModel(model, tokenizer, _limits(directory), model_name(directory), "dls")


def _rule(raw: dict, directory: Path, default: DecodingRule) -> DecodingRule:
    """The decoding rule ``config.json`` names (``decoding_rule``), else the family's ``default``."""
    try:
        return parse_rule(raw.get(RULE_KEY) or default)
    except ValueError as exc:
        raise CheckpointError(f"{directory / 'config.json'}: {exc}") from None


def _limits(directory: Path) -> GenerationLimits:
    try:
        return read_generation_limits(directory)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def _require(raw: dict, key: str, directory: Path, alternatives: tuple[str, ...] = ()):
    for k in (key, *alternatives):
        if k in raw:
            value = raw[k]
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise CheckpointError(f"{directory / 'config.json'}: field '{k}' must be a positive number, got {value!r}")
            return value
    raise CheckpointError(f"{directory / 'config.json'}: missing field '{key}'")


def _llada_config(raw: dict, d: Path) -> DLMConfig:
    return DLMConfig(
        vocab_size=int(raw.get("embedding_size") or _require(raw, "vocab_size", d)),
        d_model=int(_require(raw, "d_model", d)),
        n_layers=int(_require(raw, "n_layers", d)),
        n_heads=int(_require(raw, "n_heads", d)),
        n_kv_heads=int(raw.get("n_kv_heads") or raw["n_heads"]),
        mlp_hidden_size=int(_require(raw, "mlp_hidden_size", d)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_sequence_length=int(raw.get("max_sequence_length", 4096)),
        qkv_bias=bool(raw.get("include_bias", False) or raw.get("include_qkv_bias", False)),
        mask_token_id=int(raw.get("mask_token_id", LLADA_MASK_ID)),
        pad_token_id=int(raw.get("pad_token_id", 126081)),
        eos_token_id=int(raw.get("eos_token_id", 126081)),
        rope_full_precision=bool(raw.get("rope_full_precision", True)),  # LLaDA-8B's config: true
        **{RULE_KEY: _rule(raw, d, DecodingRule.LLADA).value},
    )


def _dream_config(raw: dict, d: Path) -> DLMConfig:
    heads = int(_require(raw, "num_attention_heads", d))
    return DLMConfig(
        vocab_size=int(_require(raw, "vocab_size", d)),
        d_model=int(_require(raw, "hidden_size", d)),
        n_layers=int(_require(raw, "num_hidden_layers", d)),
        n_heads=heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or heads),
        mlp_hidden_size=int(_require(raw, "intermediate_size", d)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_sequence_length=int(raw.get("max_position_embeddings", 2048)),
        qkv_bias=True,
        logits_shift=1,
        mask_token_id=int(raw.get("mask_token_id", DREAM_MASK_ID)),
        pad_token_id=int(raw.get("pad_token_id", 151643)),
        eos_token_id=int(raw.get("eos_token_id", 151643)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_full_precision=False,  # Qwen2's rotary: cos/sin cast to the model's dtype, rotated in it
        **{RULE_KEY: _rule(raw, d, DecodingRule.DREAM).value},  # Fast-dLLM's Dream rule
    )


def _llada_name(name: str) -> str:
    return name  # the bundled model already uses LLaDA's names


_DREAM_RENAMES = (
    (r"^model\.embed_tokens\.", "model.transformer.wte."),
    (r"^model\.norm\.", "model.transformer.ln_f."),
    (r"^lm_head\.", "model.transformer.ff_out."),
    (r"^model\.layers\.(\d+)\.self_attn\.q_proj\.", r"model.transformer.blocks.\1.q_proj."),
    (r"^model\.layers\.(\d+)\.self_attn\.k_proj\.", r"model.transformer.blocks.\1.k_proj."),
    (r"^model\.layers\.(\d+)\.self_attn\.v_proj\.", r"model.transformer.blocks.\1.v_proj."),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"model.transformer.blocks.\1.attn_out."),
    (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.", r"model.transformer.blocks.\1.ff_proj."),
    (r"^model\.layers\.(\d+)\.mlp\.up_proj\.", r"model.transformer.blocks.\1.up_proj."),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.", r"model.transformer.blocks.\1.ff_out."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"model.transformer.blocks.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"model.transformer.blocks.\1.ff_norm."),
)


def _dream_name(name: str) -> str:
    for pattern, replacement in _DREAM_RENAMES:
        renamed, count = re.subn(pattern, replacement, name)
        if count:
            return renamed
    return name


def _weight_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    return files or sorted(directory.glob("pytorch_model*.bin"))


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    files = _weight_files(directory)
    if not files:
        raise CheckpointError(f"{directory}: no weight files (*.safetensors or pytorch_model*.bin)")
    tensors: dict[str, torch.Tensor] = {}  # checkpoint name -> tensor
    for path in files:
        try:
            if path.suffix == ".safetensors":
                from safetensors.torch import load_file

                tensors.update(load_file(path))
            else:
                tensors.update(torch.load(path, map_location="cpu", weights_only=True))
        except Exception as exc:  # noqa: BLE001 - any reader failure is a bad file
            raise CheckpointError(f"{path}: cannot read weights ({type(exc).__name__}: {exc})") from None
    return tensors


def _load_foreign(directory: Path, config: DLMConfig, rename, family: str, trust_remote_code: bool) -> LoadedModel:
    with torch.device("meta"):
        model = DLMForMaskedDiffusion(config)
    expected = model.state_dict()
    tensors = {rename(k): v for k, v in _read_tensors(directory).items()}
    if config.tie_word_embeddings and "model.transformer.ff_out.weight" not in tensors:
        tensors["model.transformer.ff_out.weight"] = tensors.get("model.transformer.wte.weight")
    _check_tensors(directory, expected, tensors)
    model = model.to_empty(device="cpu")
    model.load_state_dict({k: tensors[k] for k in expected}, strict=True)
    model.to(next(iter(tensors.values())).dtype)
    return LoadedModel(model, _foreign_tokenizer(directory, trust_remote_code), _limits(directory), model_name(directory),
                       family)


def _check_tensors(directory: Path, expected: dict, tensors: dict) -> None:
    missing = [k for k in expected if tensors.get(k) is None]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise CheckpointError(f"{directory}: weights missing from the checkpoint: {shown}")
    for name, param in expected.items():
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise CheckpointError(
                f"{directory}: tensor '{name}' has shape {tuple(tensors[name].shape)}, "
                f"config.json implies {tuple(param.shape)}"
            )


def _foreign_tokenizer(directory: Path, trust_remote_code: bool):
    if not any((directory / f).exists() for f in (TOKENIZER_FILE, "tokenizer_config.json")):
        return None
    try:
        return load_hf_tokenizer(directory, trust_remote_code)
    except TokenizerError as exc:
        raise CheckpointError(str(exc)) from None
