"""``shared.generation`` (max_tokens as a cap) and the bundled tokenizer's chat template."""

from __future__ import annotations

import json

import pytest

from shared.generation import GenerationLimits, answer_of, canvas_length, read_generation_limits
from shared.tokenizer import CharTokenizer, TokenizerError

EOS = 2


def test_the_canvas_is_max_tokens_in_whole_blocks_bounded_by_the_model():
    assert canvas_length(5, 8, 128) == 8
    assert canvas_length(16, 8, 128) == 16
    assert canvas_length(17, 8, 128) == 24
    assert canvas_length(4096, 8, 128) == 128
    with pytest.raises(ValueError, match="max_tokens"):
        canvas_length(0, 8, 128)


def test_limits_pick_the_default_and_apply_every_bound():
    limits = GenerationLimits(gen_length=128, block_length=8, max_gen_length=128)
    assert limits.canvas(None, 8) == 128  # no max_tokens: the model's default canvas
    assert limits.canvas(20, 16) == 32
    assert limits.canvas(512, 8) == 128
    assert limits.canvas(512, 8, operator_cap=64) == 64
    assert GenerationLimits(256, 32, None).canvas(1000, 32) == 1024  # bounded by the context only


def test_the_answer_stops_at_eos_and_is_cut_at_the_cap():
    canvas = [5, 6, 7, EOS, EOS, EOS, EOS, EOS]
    assert answer_of(canvas, EOS) == ([5, 6, 7], "stop")
    assert answer_of(canvas, EOS, max_tokens=4) == ([5, 6, 7], "stop")
    assert answer_of(canvas, EOS, max_tokens=2) == ([5, 6], "length")  # the cap came before the EOS
    assert answer_of([5, 6, 7, 8], EOS) == ([5, 6, 7, 8], "length")  # the canvas filled up
    assert answer_of(canvas, EOS, max_tokens=6, ignore_eos=True) == (canvas[:6], "length")


def test_generation_limits_are_read_from_the_training_record(tmp_path):
    assert read_generation_limits(tmp_path) == (256, 32, None)  # no record: LLaDA's setting
    record = tmp_path / "training_info.json"
    record.write_text(json.dumps({"train_config": {"gen_length": 16, "block_length": 8}}))
    assert read_generation_limits(tmp_path) == (16, 8, 16)  # trained on one canvas: promises no longer one
    record.write_text(json.dumps({"train_config": {"gen_length": 128, "block_length": 8, "max_gen_length": 128}}))
    assert read_generation_limits(tmp_path) == (128, 8, 128)
    record.write_text(json.dumps({"train_config": {"gen_length": "long"}}))
    with pytest.raises(ValueError, match="training_info.json"):
        read_generation_limits(tmp_path)


def test_the_chat_template_asks_what_the_plain_prompt_asks():
    tokenizer = CharTokenizer()
    assert tokenizer.apply_chat_template([{"role": "user", "content": "347+589="}]) == "347+589="
    turns = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"},
             {"role": "user", "content": "347+589="}]
    assert tokenizer.apply_chat_template(turns) == "3+4=7\n347+589="  # earlier turns: worked examples
    system = [{"role": "system", "content": "add."}, {"role": "user", "content": "2+2="}]
    assert tokenizer.apply_chat_template(system) == "add.\n2+2="


def test_the_template_travels_with_the_tokenizer_file_and_can_be_missing(tmp_path):
    CharTokenizer().save_pretrained(tmp_path)
    assert CharTokenizer.from_pretrained(tmp_path).apply_chat_template([{"role": "user", "content": "1+1="}]) == "1+1="
    bare = CharTokenizer(chat_template=None)
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "1+1="}])
    override = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert bare.apply_chat_template([{"role": "user", "content": "x"}], override) == "[x]"
    with pytest.raises(TokenizerError, match="does not render"):
        bare.apply_chat_template([{"role": "user", "content": "x"}], "{% for %}")
