"""Character-level tokenizer of the bundled model, with pad, mask and EOS ids."""

from __future__ import annotations

import json
from pathlib import Path

PAD, MASK, EOS = "<pad>", "<mask>", "<eos>"
_SPECIALS = (PAD, MASK, EOS)
_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz+-*=@:;,.? \n"
TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    """Text that the tokenizer cannot encode, or a bad tokenizer file."""


class CharTokenizer:
    """One token per character; ids 0-2 are ``<pad>``, ``<mask>``, ``<eos>``."""

    def __init__(self, chars: str = _CHARS) -> None:
        self.vocab = list(_SPECIALS) + list(chars)
        self._char_to_id = {c: i for i, c in enumerate(self.vocab) if c not in _SPECIALS}  # char -> id
        self.pad_token_id, self.mask_token_id, self.eos_token_id = 0, 1, 2

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

    def save_pretrained(self, directory: str | Path) -> None:
        chars = "".join(self.vocab[len(_SPECIALS) :])
        Path(directory, TOKENIZER_FILE).write_text(json.dumps({"type": "char", "chars": chars}))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> CharTokenizer:
        path = Path(directory, TOKENIZER_FILE)
        try:
            data = json.loads(path.read_text())
            return cls(data["chars"])
        except FileNotFoundError:
            raise TokenizerError(f"{path}: tokenizer file missing") from None
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise TokenizerError(f"{path}: not a char tokenizer file ({exc})") from None
