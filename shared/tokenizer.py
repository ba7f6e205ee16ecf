"""Character-level tokenizer of the bundled model, with pad, mask and EOS ids, and its chat template.

It lives in ``shared`` because the gateway tokenizes (and templates chat) while the worker decodes.

The chat template renders a conversation in the model's own few-shot format, so chat asks exactly
what a completion prompt asks: a single user message holding ``347+589=`` becomes the prompt
``347+589=``, and earlier turns become worked examples (``3+4=`` answered ``7`` -> ``3+4=7\n``).
It is Jinja, as Hugging Face chat templates are, stored in ``tokenizer.json`` (``chat_template``).

For every model (the bundled one and Hugging Face checkpoints): ``answer_text``, the one function that
turns answer tokens into the API's text (special tokens dropped), and ``load_hf_tokenizer``, how the
gateway and every worker load a checkpoint's tokenizer (code a checkpoint ships runs only with
``DLS_TRUST_REMOTE_CODE``; without it, its ``tokenizer.json`` where it has one).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

PAD, MASK, EOS = "<pad>", "<mask>", "<eos>"
_SPECIALS = (PAD, MASK, EOS)
_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz+-*=@:;,.? \n"
TOKENIZER_FILE = "tokenizer.json"  # the bundled format's, and a Hugging Face fast tokenizer's

# A user turn is followed directly by its answer (as a query by its answer in a few-shot prompt); an
# answer, a system text or a user turn that no answer follows ends its line.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['content'] }}"
    "{%- if message['role'] != 'user' or (not loop.last and messages[loop.index0 + 1]['role'] != 'assistant') -%}"
    "{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


class TokenizerError(ValueError):
    """Text that the tokenizer cannot encode, or a bad tokenizer file."""


class CharTokenizer:
    """One token per character; ids 0-2 are ``<pad>``, ``<mask>``, ``<eos>``."""

    def __init__(self, chars: str = _CHARS, chat_template: str | None = CHAT_TEMPLATE) -> None:
        self.chat_template = chat_template  # Jinja over ``messages``; None: the model has none
        self.vocab = list(_SPECIALS) + list(chars)
        self._char_to_id = {c: i for i, c in enumerate(self.vocab) if c not in _SPECIALS}  # char -> id
        self.pad_token_id, self.mask_token_id, self.eos_token_id = 0, 1, 2

    @property
    def alphabet(self) -> str:
        """Every character it encodes (the text of a prompt must be made of these)."""
        return "".join(self.vocab[len(_SPECIALS):])

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._char_to_id[c] for c in text]
        except KeyError as exc:
            raise TokenizerError(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: list[int], stop_at_eos: bool = True) -> str:
        out = []
        for i in ids:
            if i == self.eos_token_id and stop_at_eos:
                break
            out.append("_" if i == self.mask_token_id else "" if i < len(_SPECIALS) else self.vocab[i])
        return "".join(out)

    def can_encode(self, text: str) -> bool:
        return all(c in self._char_to_id for c in text)

    def apply_chat_template(self, messages: list[dict[str, str]], template: str | None = None) -> str:
        """The prompt for ``messages`` ({role, content}); ``template`` overrides the model's own."""
        template = template or self.chat_template
        if not template:
            raise TokenizerError("this tokenizer has no chat template (set one, or use /v1/completions)")
        return render_chat_template(template, messages)

    def save_pretrained(self, directory: str | Path) -> None:
        chars = "".join(self.vocab[len(_SPECIALS) :])
        data = {"type": "char", "chars": chars}
        if self.chat_template:
            data["chat_template"] = self.chat_template
        Path(directory, TOKENIZER_FILE).write_text(json.dumps(data))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> CharTokenizer:
        path = Path(directory, TOKENIZER_FILE)
        try:
            data = json.loads(path.read_text())
            return cls(data["chars"], data.get("chat_template"))
        except FileNotFoundError:
            raise TokenizerError(f"{path}: tokenizer file missing") from None
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise TokenizerError(f"{path}: not a char tokenizer file ({exc})") from None


def render_chat_template(template: str, messages: list[dict[str, str]], **variables) -> str:
    """Render a Jinja chat template in a sandbox (as transformers does); errors name the template."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return environment.from_string(template).render(messages=messages, add_generation_prompt=True, **variables)
    except TemplateError as exc:
        raise TokenizerError(f"the chat template does not render: {exc}") from None


# --- every model's tokenizer: the answer's text, and how a checkpoint's tokenizer is loaded -------

TRUST_REMOTE_CODE_SETTING = "DLS_TRUST_REMOTE_CODE"  # shared.settings.ServiceSettings.trust_remote_code


def answer_text(tokenizer, token_ids: Sequence[int], mask_token_id: int | None = None) -> str:
    """The text of answer tokens, as the API returns it everywhere (completions, chat, stream deltas,
    ``stop`` matching, each ``logprobs`` token): special tokens (EOS, pads, the mask, a chat model's
    end-of-turn, ...) render as nothing, and it never stops early (the answer's tokens are already cut
    where the answer ends). The one decoding function of every model: the worker's engine and the
    gateway both call it."""
    ids = [int(i) for i in token_ids if i != mask_token_id]
    if isinstance(tokenizer, CharTokenizer):
        return tokenizer.decode([i for i in ids if i != tokenizer.mask_token_id], stop_at_eos=False)
    return tokenizer.decode(ids, skip_special_tokens=True)


def remote_tokenizer_code(directory: str | Path) -> str | None:
    """The tokenizer class a checkpoint maps ``AutoTokenizer`` to in code it ships (``auto_map`` of its
    ``tokenizer_config.json`` or ``config.json``, e.g. Dream's ``tokenization_dream.DreamTokenizer``);
    None when it ships none."""
    for name in ("tokenizer_config.json", "config.json"):
        try:
            data = json.loads(Path(directory, name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        entry = data.get("auto_map", {}).get("AutoTokenizer") if isinstance(data, dict) else None
        if isinstance(entry, str):
            return entry
        if isinstance(entry, list | tuple) and any(entry):
            return next(e for e in entry if e)
    return None


def load_hf_tokenizer(directory: str | Path, trust_remote_code: bool = False):
    """A checkpoint's Hugging Face tokenizer, loaded the same way by the gateway and every worker.

    * It ships no tokenizer code: ``AutoTokenizer``.
    * It ships code (``remote_tokenizer_code``) and ``trust_remote_code`` (``DLS_TRUST_REMOTE_CODE``):
      ``AutoTokenizer`` runs that code, as the checkpoint's authors meant.
    * It ships code, the setting is off, and it has a ``tokenizer.json``: the fast tokenizer built from
      that file (with ``tokenizer_config.json``'s special tokens and chat template); no code runs.
    * Otherwise: ``TokenizerError`` naming the setting that allows the code.
    """
    directory = Path(directory)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # heavy: only for foreign checkpoints

    code = remote_tokenizer_code(directory)
    if code and not trust_remote_code:
        if not (directory / TOKENIZER_FILE).exists():
            raise TokenizerError(
                f"{directory}: the tokenizer is code shipped with the checkpoint ({code}) and there is no "
                f"{TOKENIZER_FILE} to load instead; set {TRUST_REMOTE_CODE_SETTING}=true (gateway and "
                "workers) to let transformers run that code")
        loader = PreTrainedTokenizerFast.from_pretrained
    else:
        loader = functools.partial(AutoTokenizer.from_pretrained, trust_remote_code=trust_remote_code)
    try:
        return loader(str(directory))
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds here
        if "trust_remote_code" in str(exc):
            raise TokenizerError(f"{directory}: the tokenizer needs code shipped with the checkpoint; set "
                                 f"{TRUST_REMOTE_CODE_SETTING}=true (gateway and workers) to let transformers "
                                 "run it") from None
        raise TokenizerError(f"{directory}: no usable tokenizer ({type(exc).__name__}: {exc})") from None
