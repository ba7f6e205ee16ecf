"""The model catalogue: the served model's name, tokenizer, context limit and generation defaults.

The gateway tokenizes, so it loads the served model's tokenizer, never its weights (and never torch):

* the bundled format (``tokenizer.json`` of ``shared.tokenizer.CharTokenizer``): one token per
  character, with a chat template that renders a conversation as the model's few-shot prompt;
* any other directory: its Hugging Face tokenizer as every worker loads it
  (``shared.tokenizer.load_hf_tokenizer``: code a checkpoint ships runs only with
  ``DLS_TRUST_REMOTE_CODE``; without it, its ``tokenizer.json`` where it has one), with its chat template.

Answer text (and each ``logprobs`` token) comes from ``shared.tokenizer.answer_text``, the function the
workers' engines decode with: special tokens render as nothing, so an answer's text is the same
whichever of them made it.

``DLS_GATEWAY_CHAT_TEMPLATE`` replaces the model's template; a model with neither answers chat with a
400 that says so (joining messages some other way would ask the model something it was not trained
on). The model's name is its directory's basename (what workers put in their heartbeats).
``config.json`` gives ``max_sequence_length`` (or ``max_position_embeddings``) and the mask id;
``shared.generation.read_generation_limits`` the default canvas and block and the longest canvas.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shared.calibration import Calibration, CalibrationError, find, uncalibrated_message
from shared.generation import GenerationLimits, read_generation_limits
from shared.served import model_name
from shared.tokenizer import (
    TOKENIZER_FILE,
    CharTokenizer,
    TokenizerError,
    answer_text,
    load_hf_tokenizer,
    render_chat_template,
)

logger = logging.getLogger(__name__)

FALLBACK_MAX_SEQUENCE_LENGTH = 4096  # context limit of a config that names none
MASK_CHAR = "_"  # how an uncommitted canvas position is shown

# model_type -> mask id of public checkpoints whose config.json does not name it
_MASK_IDS_BY_MODEL_TYPE = {"llada": 126336, "dream": 151666}


class ModelLoadError(ValueError):
    """A served model directory the gateway cannot use; the message names the file or field."""


class UnknownModelError(KeyError):
    """A request named a model this gateway does not serve."""

    def __init__(self, name: str, served: Sequence[str]) -> None:
        super().__init__(name)
        self.name = name
        self.served = list(served)

    def __str__(self) -> str:
        return f"model {self.name!r} is not served here (served: {', '.join(self.served)})"


class TextCodec(Protocol):
    """Text <-> token ids for one model, as the gateway needs them."""

    mask_token_id: int  # the id of an uncommitted canvas position
    alphabet: str | None  # every character the tokenizer can encode, when that set is closed; None: any text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``TokenizerError`` if the tokenizer cannot encode it."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Generated text: special tokens (EOS, end-of-turn, ...) dropped (``shared.tokenizer.answer_text``)."""
        ...

    def render_canvas(self, token_ids: Sequence[int]) -> str:
        """A generation canvas with every masked position shown as ``_`` (EOS and pads dropped)."""
        ...

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> tuple[str, bool]:
        """(prompt text, whether it already holds the special tokens) for (role, content) messages;
        ``TokenizerError`` when there is no chat template or it does not render."""
        ...


class CharCodec:
    """The bundled character-level tokenizer."""

    def __init__(self, tokenizer: CharTokenizer, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.mask_token_id = tokenizer.mask_token_id
        self.alphabet = tokenizer.alphabet
        self.chat_template = chat_template  # overrides the tokenizer's own

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return answer_text(self.tokenizer, token_ids, self.mask_token_id)

    def render_canvas(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), stop_at_eos=False)  # the mask decodes as "_"

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> tuple[str, bool]:
        conversation = [{"role": role, "content": content} for role, content in messages]
        return self.tokenizer.apply_chat_template(conversation, self.chat_template), False


class HfCodec:
    """A Hugging Face tokenizer (``AutoTokenizer``), for LLaDA / Dream directories."""

    def __init__(self, tokenizer, mask_token_id: int, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.mask_token_id = mask_token_id
        self.alphabet = None  # byte-level BPE: any text encodes
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:  # noqa: BLE001 - tokenizer backends raise assorted errors
            raise TokenizerError(f"the tokenizer cannot encode the text ({type(exc).__name__}: {exc})") from None

    def decode(self, token_ids: Sequence[int]) -> str:
        return answer_text(self.tokenizer, token_ids, self.mask_token_id)

    def render_canvas(self, token_ids: Sequence[int]) -> str:
        parts: list[str] = []
        run: list[int] = []  # consecutive committed ids, decoded together (multi-token characters)
        for token_id in token_ids:
            if token_id == self.mask_token_id:
                parts.append(self.tokenizer.decode(run, skip_special_tokens=True) + MASK_CHAR)
                run = []
            else:
                run.append(token_id)
        parts.append(self.tokenizer.decode(run, skip_special_tokens=True))
        return "".join(parts)

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> tuple[str, bool]:
        if not self.chat_template:
            raise TokenizerError("the model's tokenizer has no chat template: set DLS_GATEWAY_CHAT_TEMPLATE, "
                                 "or use /v1/completions")
        conversation = [{"role": role, "content": content} for role, content in messages]
        special = {name: getattr(self.tokenizer, name, None) for name in ("bos_token", "eos_token")}
        return render_chat_template(self.chat_template, conversation, **special), True


@dataclass(frozen=True)
class ServedModel:
    """One model the gateway serves."""

    name: str  # the API's model id: the directory's basename
    directory: Path  # where it was loaded from
    codec: TextCodec  # its tokenizer
    max_sequence_length: int  # prompt plus generation must fit in this many tokens
    limits: GenerationLimits  # default canvas (max_tokens of requests that set none) and block, longest canvas
    created: int  # unix time (s) of its config (the API's ``created``)
    calibration: Calibration | None = None  # its checked calibration bundle (None: uncalibrated)

    @property
    def default_gen_length(self) -> int:
        return self.limits.gen_length

    @property
    def default_block_length(self) -> int:
        return self.limits.block_length


class ModelCatalogue:
    """The models this gateway serves, by name (``DLS_GATEWAY_MODEL_DIRS``, else the model directory)."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        self._by_name = {model.name: model for model in models}  # model name -> model

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str) -> ServedModel:
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownModelError(name, list(self._by_name)) from None

    @property
    def models(self) -> list[ServedModel]:
        return list(self._by_name.values())


def load_served_model(model_dir: str | Path, default_gen_length: int | None = None,
                      default_block_length: int | None = None, chat_template: str = "",
                      trust_remote_code: bool = False, calibration_dir: str = "") -> ServedModel:
    """Tokenizer, limits and defaults of ``model_dir``; settings' defaults win over the model's.

    ``chat_template``: a file path or a Jinja template replacing the tokenizer's own ("": keep it);
    ``calibration_dir``: its calibration bundle ("": inside the model; one made for other weights is
    refused, naming what differs: ``shared.calibration``).
    """
    directory = Path(model_dir)
    if not directory.is_dir():
        raise ModelLoadError(f"{directory}: model directory does not exist")
    config = _read_json(directory / "config.json", required=True)
    try:
        limits = read_generation_limits(directory)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    limits = limits._replace(gen_length=default_gen_length or limits.gen_length,
                             block_length=default_block_length or limits.block_length)
    codec = _load_codec(directory, config, _template_text(chat_template), trust_remote_code)
    return ServedModel(
        name=model_name(directory),  # as every service and the workers name it (shared.served)
        directory=directory,
        codec=codec,
        max_sequence_length=_max_sequence_length(config, directory),
        limits=limits,
        created=int((directory / "config.json").stat().st_mtime),
        calibration=_calibration(directory, calibration_dir),
    )


def _calibration(directory: Path, calibration_dir: str) -> Calibration | None:
    try:
        calibration = find(directory, calibration_dir or None)
    except CalibrationError as exc:
        raise ModelLoadError(str(exc)) from None
    if calibration is None:
        logger.warning(uncalibrated_message(directory))
    return calibration


def _template_text(setting: str) -> str | None:
    """The template a setting names: a readable file's text, else the setting itself (None if empty)."""
    if not setting:
        return None
    path = Path(setting)
    try:
        if path.is_file():
            return path.read_text()
    except OSError as exc:
        raise ModelLoadError(f"DLS_GATEWAY_CHAT_TEMPLATE: cannot read {path} ({exc})") from None
    if "{" not in setting:  # neither a file nor a template: most likely a mistyped path
        raise ModelLoadError(f"DLS_GATEWAY_CHAT_TEMPLATE: {setting!r} is not a file, nor a Jinja template")
    return setting


def _read_json(path: Path, required: bool) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        if required:
            raise ModelLoadError(f"{path}: missing") from None
        return {}
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _max_sequence_length(config: dict, directory: Path) -> int:
    for key in ("max_sequence_length", "max_position_embeddings"):
        if key in config:
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ModelLoadError(f"{directory / 'config.json'}: field '{key}' must be an integer >= 2, "
                                     f"got {value!r}")
            return value
    return FALLBACK_MAX_SEQUENCE_LENGTH


def _load_codec(directory: Path, config: dict, chat_template: str | None, trust_remote_code: bool) -> TextCodec:
    if (directory / TOKENIZER_FILE).exists() and is_char_tokenizer(directory / TOKENIZER_FILE):
        try:
            return CharCodec(CharTokenizer.from_pretrained(directory), chat_template)
        except TokenizerError as exc:
            raise ModelLoadError(str(exc)) from None
    try:
        tokenizer = load_hf_tokenizer(directory, trust_remote_code)
    except TokenizerError as exc:
        raise ModelLoadError(str(exc)) from None
    mask_id = config.get("mask_token_id",
                         _MASK_IDS_BY_MODEL_TYPE.get(str(config.get("model_type", "")).lower(),
                                                     getattr(tokenizer, "mask_token_id", None)))
    if mask_id is None:
        raise ModelLoadError(f"{directory / 'config.json'}: no mask_token_id, and the tokenizer has no mask token")
    return HfCodec(tokenizer, int(mask_id), chat_template)


def is_char_tokenizer(path: Path) -> bool:
    """The bundled format's ``tokenizer.json`` (a Hugging Face fast tokenizer uses the same file name)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and data.get("type") == "char"
