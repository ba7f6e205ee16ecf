"""The prompts and labelled problems `dls calibrate` reads, and their token ids as the gateway makes them.

Prompt files (``--prompts``), one of:

* JSONL (``.jsonl``, or a first line that is a JSON object): one OpenAI request body a line, a
  completion body (``{"prompt": "..."}``, a list of strings being one prompt each, or a list of token
  ids) or a chat body (``{"messages": [{"role": ..., "content": ...}, ...]}``, content a string or a
  list of text parts), optionally with ``max_tokens`` (or ``max_completion_tokens``): the request's
  canvas is then the one the gateway gives it. Other fields are ignored (calibration decodes greedily);
* ShareGPT JSON: a list of ``{"conversations": [{"from": "human", "value": ...}, ...]}``; the first
  human turn of each is a prompt (conversations without one are skipped);
* plain text: one prompt a line (blank lines skipped).

Labelled problems (``--eval``): JSONL, a completion or chat body per line plus ``"answer"``, the
expected answer (a string or a number).

Errors are ``PromptFileError``s naming the line. Chat bodies are rendered through the model's chat
template the way the gateway renders them (``services.gateway.models``: the bundled model's character
codec, or a checkpoint's Hugging Face tokenizer with its template, the special tokens then in the text).
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("auto", "jsonl", "sharegpt", "text")
HUMAN_ROLES = ("human", "user")


class PromptFileError(ValueError):
    """A prompt or problem file that cannot be used; the message names the line where there is one."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(f"line {line}: {message}" if line is not None else message)
        self.line = line


@dataclass(frozen=True)
class PromptSpec:
    """One prompt as a file states it (before tokenization)."""

    line: int  # where it is in its file (ShareGPT: the conversation's index, from 1)
    source: str  # completion | chat | sharegpt | text: what kind of body it was
    text: str | None = None  # a completion prompt's text
    messages: tuple[tuple[str, str], ...] = ()  # a chat body's (role, text) messages
    token_ids: tuple[int, ...] = ()  # a completion prompt given as token ids
    max_tokens: int | None = None  # the request's answer cap (None: the model's default canvas)
    answer: str | None = None  # the expected answer (labelled problems only)


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt as the gateway would send it to a worker."""

    line: int
    source: str
    token_ids: tuple[int, ...]
    gen_length: int  # its canvas
    max_tokens: int | None
    answer: str | None = None
    family: str = ""  # the row label in traces and quality (a task family, else ``source``)
    problem: object | None = None  # a task problem (``shared.tasks.Problem``): scored by its family's check


def file_digest(path: str | Path) -> str:
    """A short hash of a file's bytes: what a resumed run compares to know the file did not change."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


# --- reading --------------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PromptFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise PromptFileError(f"{path}: is a directory, not a file") from None
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def detect_format(path: Path, text: str) -> str:
    stripped = text.lstrip()
    if path.suffix == ".jsonl" or stripped.startswith("{"):
        return "jsonl"
    if stripped.startswith("["):
        return "sharegpt"
    return "text"


def read_prompts(path: str | Path, fmt: str = "auto") -> list[PromptSpec]:
    """Every prompt of a prompt file (module docstring); ``PromptFileError`` naming the line."""
    path = Path(path)
    text = _read_text(path)
    fmt = detect_format(path, text) if fmt == "auto" else fmt
    if fmt == "jsonl":
        prompts = [spec for line, body in _jsonl(text) for spec in _body(body, line, labelled=False)]
    elif fmt == "sharegpt":
        prompts = _sharegpt(text)
    elif fmt == "text":
        prompts = [PromptSpec(n, "text", text=line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    else:
        raise PromptFileError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    if not prompts:
        raise PromptFileError(f"{path}: no prompts in it (read as {fmt})")
    return prompts


def read_problems(path: str | Path) -> list[PromptSpec]:
    """Every labelled problem of a JSONL file: a completion or chat body plus ``answer``."""
    path = Path(path)
    problems = [spec for line, body in _jsonl(_read_text(path)) for spec in _body(body, line, labelled=True)]
    if not problems:
        raise PromptFileError(f"{path}: no problems in it")
    return problems


def _jsonl(text: str):
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"not JSON ({exc.msg} at column {exc.colno})", number) from None
        if not isinstance(body, dict):
            raise PromptFileError(f"expected a JSON object (a request body), got {type(body).__name__}", number)
        yield number, body


def _body(body: dict, line: int, labelled: bool) -> list[PromptSpec]:
    """The prompts one request body holds (a completion body's list of prompts is several)."""
    max_tokens = _max_tokens(body, line)
    answer = _answer(body, line) if labelled else None
    if "messages" in body:
        return [PromptSpec(line, "chat", messages=_messages(body["messages"], line), max_tokens=max_tokens,
                           answer=answer)]
    if "prompt" not in body:
        raise PromptFileError("neither 'prompt' (a completion body) nor 'messages' (a chat body)", line)
    prompt = body["prompt"]
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [PromptSpec(line, "completion", token_ids=tuple(prompt), max_tokens=max_tokens, answer=answer)]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, str) for t in prompt):
        if labelled and len(prompt) > 1:
            raise PromptFileError("'prompt' holds several prompts but there is one 'answer'", line)
        texts = prompt
    else:
        raise PromptFileError("'prompt' must be a string, a list of strings or a list of token ids", line)
    if any(not t.strip() for t in texts):
        raise PromptFileError("'prompt' is empty", line)
    return [PromptSpec(line, "completion", text=t, max_tokens=max_tokens, answer=answer) for t in texts]


def _messages(messages, line: int) -> tuple[tuple[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise PromptFileError("'messages' must be a non-empty list", line)
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise PromptFileError(f"messages[{i}] must be an object with a 'role'", line)
        content = message.get("content")
        if isinstance(content, list):  # text parts, as OpenAI's API allows
            if not all(isinstance(p, dict) and p.get("type", "text") == "text" for p in content):
                raise PromptFileError(f"messages[{i}].content: only text parts are supported", line)
            content = "".join(str(p.get("text") or "") for p in content)
        if not isinstance(content, str):
            raise PromptFileError(f"messages[{i}].content must be a string or a list of text parts", line)
        role = "system" if message["role"] == "developer" else message["role"]  # as the gateway renders it
        out.append((role, content))
    return tuple(out)


def _max_tokens(body: dict, line: int) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PromptFileError(f"'max_tokens' must be a positive integer, got {value!r}", line)
    return value


def _answer(body: dict, line: int) -> str:
    answer = body.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise PromptFileError("no 'answer' (the expected answer: a string or a number)"
                              if answer is None else f"'answer' must be a string or a number, got {answer!r}", line)
    return str(answer)


def _sharegpt(text: str) -> list[PromptSpec]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"not JSON ({exc.msg})", exc.lineno) from None
    if not isinstance(data, list):
        raise PromptFileError("a ShareGPT file holds a JSON list of conversations")
    prompts = []
    for index, item in enumerate(data, 1):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            raise PromptFileError(f"conversation {index}: no 'conversations' list")
        human = next((t.get("value") for t in turns if isinstance(t, dict) and t.get("from") in HUMAN_ROLES), None)
        if isinstance(human, str) and human.strip():
            prompts.append(PromptSpec(index, "sharegpt", text=human))
    return prompts


# --- token ids, as the gateway makes them ------------------------------------------------------------


def load_codec(model_dir: str | Path, trust_remote_code: bool = False):
    """The served model's tokenizer wrapped as the gateway wraps it (``services.gateway.models``)."""
    from services.gateway.models import CharCodec, HfCodec, is_char_tokenizer
    from services.worker.model.loading import DREAM_MASK_ID, LLADA_MASK_ID
    from shared.tokenizer import TOKENIZER_FILE, CharTokenizer, load_hf_tokenizer

    directory = Path(model_dir)
    if is_char_tokenizer(directory / TOKENIZER_FILE):
        return CharCodec(CharTokenizer.from_pretrained(directory))
    config = json.loads((directory / "config.json").read_text())
    mask_id = config.get("mask_token_id", {"llada": LLADA_MASK_ID, "dream": DREAM_MASK_ID}.get(
        str(config.get("model_type", "")).lower(), -1))  # used to render canvases only, which calibration never does
    return HfCodec(load_hf_tokenizer(directory, trust_remote_code), int(mask_id))


def encode(specs: list[PromptSpec], codec, limits, context: int) -> tuple[list[EncodedPrompt], list[str]]:
    """(prompts that fit, why each other one was left out). ``limits``: the model's generation limits
    (``shared.generation``: a body's ``max_tokens`` becomes the canvas the gateway would give it);
    ``context``: its longest sequence, prompt plus canvas. A prompt the tokenizer cannot encode or a
    chat template that does not render raises ``PromptFileError`` naming the line."""
    from shared.tokenizer import TokenizerError

    kept, left_out = [], []
    for spec in specs:
        try:
            if spec.messages:
                text, templated = codec.chat_prompt(list(spec.messages))
                ids = codec.encode(text, add_special_tokens=not templated)
            else:
                ids = list(spec.token_ids) or codec.encode(spec.text)
        except TokenizerError as exc:
            raise PromptFileError(f"the model's tokenizer cannot take it: {exc}", spec.line) from None
        gen_length = limits.canvas(spec.max_tokens, limits.block_length)
        if not ids:
            left_out.append(f"line {spec.line}: empty after tokenization")
        elif len(ids) + gen_length > context:
            left_out.append(f"line {spec.line}: {len(ids)} tokens plus a canvas of {gen_length} exceed the "
                            f"model's context of {context}")
        else:
            kept.append(EncodedPrompt(spec.line, spec.source, tuple(ids), gen_length, spec.max_tokens, spec.answer,
                                      spec.source))
    return kept, left_out


def median_length(prompts: list[EncodedPrompt]) -> int:
    return int(statistics.median(len(p.token_ids) for p in prompts))
