"""Character-level tokenizer of the bundled model, with pad, mask and EOS ids, and its chat template.

It lives in ``shared`` because the gateway tokenizes (and templates chat) while the worker decodes.

The chat template renders a conversation in the model's own few-shot format, so chat asks exactly
what a completion prompt asks: a single user message holding ``347+589=`` becomes the prompt
``347+589=``, and earlier turns become worked examples (``3+4=`` answered ``7`` -> ``3+4=7\n``).
It is Jinja, as Hugging Face chat templates are, stored in ``tokenizer.json`` (``chat_template``).
"""

from __future__ import annotations

import json
from pathlib import Path

PAD, MASK, EOS = "<pad>", "<mask>", "<eos>"
_SPECIALS = (PAD, MASK, EOS)
_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz+-*=@:;,.? \n"
TOKENIZER_FILE = "tokenizer.json"

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
