"""The prompt files `dls calibrate` reads (JSONL completion and chat bodies, ShareGPT, plain text, labelled
JSONL), their errors with line numbers, and their token ids as the gateway makes them."""

import json
from pathlib import Path

import pytest

from calibrate.prompts import PromptFileError, encode, load_codec, median_length, read_problems, read_prompts
from shared.generation import read_generation_limits

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "models" / "dls-tiny"


def write(tmp_path: Path, name: str, lines) -> Path:
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_jsonl_completion_and_chat_bodies(tmp_path):
    path = write(tmp_path, "p.jsonl", [
        {"model": "x", "prompt": "347+589=", "max_tokens": 16, "temperature": 0},
        "",
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "@a="}]}]},
        {"prompt": ["1+2=", "3+4="]},
        {"prompt": [5, 6, 7]},
    ])
    specs = read_prompts(path)
    assert [(s.line, s.source) for s in specs] == [(1, "completion"), (3, "chat"), (4, "completion"),
                                                   (4, "completion"), (5, "completion")]
    assert specs[0].text == "347+589=" and specs[0].max_tokens == 16
    assert specs[1].messages == (("system", "s"), ("user", "@a="))
    assert [s.text for s in specs[2:4]] == ["1+2=", "3+4="] and specs[4].token_ids == (5, 6, 7)


def test_sharegpt_takes_the_first_human_turn(tmp_path):
    path = tmp_path / "share.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "1+1="},
                           {"from": "gpt", "value": "2"}]},
        {"conversations": [{"from": "gpt", "value": "no human here"}]},
        {"conversations": [{"from": "user", "value": "@b="}]},
    ]))
    specs = read_prompts(path)
    assert [(s.line, s.source, s.text) for s in specs] == [(1, "sharegpt", "1+1="), (3, "sharegpt", "@b=")]


def test_plain_text_one_prompt_a_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("1+2=\n\n@c=\n")
    assert [(s.line, s.text) for s in read_prompts(path)] == [(1, "1+2="), (3, "@c=")]
    assert read_prompts(path, "text")[0].source == "text"


@pytest.mark.parametrize(("lines", "message"), [
    ([{"prompt": "a"}, "{not json"], "line 2: not JSON"),
    ([{"prompt": "a"}, {"prompt": "b"}, [1, 2]], "line 3: expected a JSON object"),
    ([{"input": "a"}], "line 1: neither 'prompt'"),
    ([{"prompt": ""}], "line 1: 'prompt' is empty"),
    ([{"prompt": {"x": 1}}], "line 1: 'prompt' must be"),
    ([{"messages": []}], "line 1: 'messages' must be a non-empty list"),
    ([{"messages": [{"content": "x"}]}], "line 1: messages[0] must be an object with a 'role'"),
    ([{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}], "line 1: messages[0].content: only text"),
    ([{"prompt": "a", "max_tokens": 0}], "line 1: 'max_tokens' must be a positive integer"),
])
def test_bad_jsonl_lines_are_named(tmp_path, lines, message):
    with pytest.raises(PromptFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_prompts(write(tmp_path, "p.jsonl", lines))


def test_missing_empty_and_directory_files(tmp_path):
    with pytest.raises(PromptFileError, match="no such file"):
        read_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(PromptFileError, match="is a directory"):
        read_prompts(tmp_path)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(PromptFileError, match="no prompts in it"):
        read_prompts(tmp_path / "empty.txt")
    (tmp_path / "bad.json").write_text("[{\"conversations\": 3}]")
    with pytest.raises(PromptFileError, match="conversation 1: no 'conversations' list"):
        read_prompts(tmp_path / "bad.json")


def test_labelled_problems_need_an_answer(tmp_path):
    specs = read_problems(write(tmp_path, "e.jsonl", [{"prompt": "1+2=", "answer": 3},
                                                       {"messages": [{"role": "user", "content": "@a="}], "answer": "bog"}]))
    assert [(s.source, s.answer) for s in specs] == [("completion", "3"), ("chat", "bog")]
    with pytest.raises(PromptFileError, match="line 2: no 'answer'"):
        read_problems(write(tmp_path, "e.jsonl", [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2="}]))
    with pytest.raises(PromptFileError, match="line 1: 'prompt' holds several prompts"):
        read_problems(write(tmp_path, "e.jsonl", [{"prompt": ["a", "b"], "answer": "3"}]))


def test_encoded_as_the_gateway_encodes_them(tmp_path):
    codec, limits = load_codec(MODEL), read_generation_limits(MODEL)
    specs = read_prompts(write(tmp_path, "p.jsonl", [
        {"prompt": "347+589="},
        {"messages": [{"role": "user", "content": "347+589="}]},  # one user message holding a task prompt: itself
        {"prompt": "1+2=", "max_tokens": 12},  # the canvas the gateway gives it: rounded up to blocks of 8
        {"prompt": "1+2=" * 100},  # 400 tokens plus the canvas of 128 exceed the context of 512
        {"prompt": "UPPER"},  # not in the character tokenizer's alphabet
    ][:4]))
    kept, left_out = encode(specs, codec, limits, context=512)
    assert kept[0].token_ids == kept[1].token_ids == tuple(codec.encode("347+589="))
    assert [p.gen_length for p in kept] == [128, 128, 16] and kept[2].max_tokens == 12
    assert left_out == ["line 4: 400 tokens plus a canvas of 128 exceed the model's context of 512"]
    assert median_length(kept) == 8
    with pytest.raises(PromptFileError, match="line 1: the model's tokenizer cannot take it"):
        encode(read_prompts(write(tmp_path, "q.jsonl", [{"prompt": "UPPER"}])), codec, limits, context=512)
