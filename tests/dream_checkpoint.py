"""Dream-style model directories, built at test time (nothing is downloaded).

* Weights: a ``DLMForMaskedDiffusion`` saved as a Dream checkpoint (``config.json`` with
  ``model_type: Dream``, Qwen2 parameter names in ``model.safetensors``), as Dream-org ships them.
* Tokenizer: Qwen2-style byte-level tokens (one per byte: the 256 byte-level symbols are ids 0-255)
  with Dream's special tokens after them and the ChatML chat template, shipped as Dream-org ships it:
  ``tokenizer_config.json`` maps ``AutoTokenizer`` to ``tokenization_dream.DreamTokenizer``, code in
  the directory (written below, a slow ``PreTrainedTokenizer`` reading ``vocab.json``), and there is
  no ``tokenizer.json`` unless asked for (``fast_file=True``: the same tokens as a fast tokenizer).
* ``chain_model``: weights that answer by a fixed chain of tokens (each position predicted from the
  token before it, the shifted logits of Dream), certain where the token before is committed and
  uniform where it is still masked, so the answer is known whatever the decoding rule or threshold.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from services.worker.model.dlm import DLMConfig, DLMForMaskedDiffusion

NUM_BYTES = 256
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")  # ids 256..259
EOS_ID, IM_START_ID, IM_END_ID, MASK_ID = range(NUM_BYTES, NUM_BYTES + len(SPECIAL_TOKENS))
VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REMOTE_CLASS = "tokenization_dream.DreamTokenizer"

# Dream-org's tokenizer is code in the checkpoint; this one reads vocab.json and maps each byte of the
# text to its byte-level symbol, as Qwen2's byte-level BPE does before merging (it has no merges)
TOKENIZATION_DREAM = '''"""DreamTokenizer: byte-level tokens, one per byte (a stand-in for Dream-org's tokenization_dream.py)."""

import json

from transformers import PreTrainedTokenizer


def byte_symbols():
    """byte -> the printable character that stands for it (GPT-2's byte-level table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class DreamTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "vocab.json"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, **kwargs):
        with open(vocab_file, encoding="utf-8") as handle:
            self.encoder = json.load(handle)
        self.decoder = {i: token for token, i in self.encoder.items()}
        self.symbol_of = byte_symbols()
        self.byte_of = {symbol: b for b, symbol in self.symbol_of.items()}
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self.encoder)

    def get_vocab(self):
        return dict(self.encoder, **self.added_tokens_encoder)

    def _tokenize(self, text, **kwargs):
        return [self.symbol_of[b] for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token):
        return self.encoder[token]

    def _convert_id_to_token(self, index):
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens):
        return bytes(self.byte_of[s] for s in "".join(tokens)).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


def byte_vocab() -> dict[str, int]:
    """Byte-level symbol -> id (0..255), the order ``tokenizers``' ByteLevel alphabet sorts to."""
    return {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}


def write_dream_tokenizer(directory: Path, fast_file: bool = False) -> None:
    """Dream-org's layout: vocab.json, tokenizer_config.json pointing ``AutoTokenizer`` at
    ``tokenization_dream.DreamTokenizer`` (written here), and with ``fast_file`` a ``tokenizer.json``."""
    vocab = byte_vocab()
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "tokenization_dream.py").write_text(TOKENIZATION_DREAM)
    special = {str(NUM_BYTES + i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                    "single_word": False, "special": True}
               for i, token in enumerate(SPECIAL_TOKENS)}
    config = {
        "added_tokens_decoder": special, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "mask_token": "<|mask|>",
        "unk_token": None, "clean_up_tokenization_spaces": False, "model_max_length": 512,
        "chat_template": CHATML, "tokenizer_class": "DreamTokenizer",
        "auto_map": {"AutoTokenizer": [REMOTE_CLASS, None]},
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if fast_file:
        fast = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        fast.decoder = decoders.ByteLevel()
        fast.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
        fast.save(str(directory / "tokenizer.json"))


_TO_QWEN = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
            "attn_out": "self_attn.o_proj", "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
            "ff_out": "mlp.down_proj", "attn_norm": "input_layernorm", "ff_norm": "post_attention_layernorm"}


def qwen_name(name: str) -> str:
    """Our parameter name (LLaDA's layout) as a Dream checkpoint names it."""
    parts = name.split(".")  # model.transformer.<...>
    if parts[2] == "wte":
        return "model.embed_tokens.weight"
    if parts[2] == "ln_f":
        return "model.norm.weight"
    if parts[2] == "ff_out":
        return "lm_head.weight"
    layer, module, leaf = parts[3], parts[4], parts[5]
    return f"model.layers.{layer}.{_TO_QWEN[module]}.{leaf}"


def write_dream_weights(directory: Path, model: DLMForMaskedDiffusion) -> None:
    """``config.json`` (``model_type: Dream``) and ``model.safetensors`` in Qwen2's names."""
    c = model.config
    config = {"model_type": "Dream", "hidden_size": c.d_model, "num_hidden_layers": c.n_layers,
              "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
              "intermediate_size": c.mlp_hidden_size, "vocab_size": c.vocab_size, "rope_theta": c.rope_theta,
              "mask_token_id": c.mask_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id,
              "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_sequence_length,
              "tie_word_embeddings": False}
    (directory / "config.json").write_text(json.dumps(config))
    save_file({qwen_name(k): v.contiguous() for k, v in model.state_dict().items()}, directory / "model.safetensors")


def chain_model(successor: dict[int, int], certainty: float = 24.0) -> DLMForMaskedDiffusion:
    """A Dream-architecture model (shifted logits, GQA, q/k/v biases) whose blocks add nothing, so each
    position's output depends on its own token only: the token after ``t`` is ``successor[t]`` with
    logit ``certainty`` (the others 0), and after a masked position (or any token not in ``successor``)
    every token is equally likely."""
    config = DLMConfig(vocab_size=VOCAB_SIZE, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, mlp_hidden_size=64,
                       qkv_bias=True, logits_shift=1, mask_token_id=MASK_ID, pad_token_id=EOS_ID,
                       eos_token_id=EOS_ID, max_sequence_length=512)
    torch.manual_seed(0)
    model = DLMForMaskedDiffusion(config).float()
    t = model.model.transformer
    if len(successor) > config.d_model:
        raise ValueError(f"at most {config.d_model} chain tokens, got {len(successor)}")
    with torch.no_grad():
        for block in t.blocks:  # the blocks' outputs vanish: the residual stream is the token's embedding
            block.attn_out.weight.zero_()
            block.ff_out.weight.zero_()
        t.wte.weight.zero_()
        t.ln_f.weight.fill_(1.0)
        t.ff_out.weight.zero_()
        scale = certainty / config.d_model ** 0.5  # the final norm makes a one-hot embedding sqrt(d) long
        for slot, (token, after) in enumerate(successor.items()):
            t.wte.weight[token, slot] = 1.0
            t.ff_out.weight[after, slot] = scale
    return model.eval()


def build_dream_directory(directory: Path, answer: list[int], after_prompt: int, fast_file: bool = False) -> Path:
    """A servable Dream-style directory whose model answers ``answer`` (then EOS) after any prompt ending
    in the token ``after_prompt``; the tokenizer as ``write_dream_tokenizer`` ships it."""
    directory.mkdir(parents=True, exist_ok=True)
    chain = [after_prompt, *answer, EOS_ID]
    successor = dict(zip(chain, chain[1:], strict=False))
    if len(successor) != len(chain) - 1:
        raise ValueError("a chain token repeats: the answer would not be a chain")
    successor[EOS_ID] = EOS_ID
    write_dream_weights(directory, chain_model(successor))
    write_dream_tokenizer(directory, fast_file)
    return directory
