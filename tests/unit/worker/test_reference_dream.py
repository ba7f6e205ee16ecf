"""The reference decoder's Dream rule on its own (Fast-dLLM's ``dream/model/generation_utils_block.py``):
what a block's first forward commits, where a cache step's window starts, the inclusive threshold."""

import pytest
import torch

from services.worker.decoding.rule import (
    DecodingRule,
    cache_window_start,
    decoding_rule,
    parse_rule,
    select_commits,
)
from services.worker.model.dlm import DLMConfig
from services.worker.reference import reference_generate

from .conftest import tiny_model

MODES = ["none", "prefix", "dual"]
PROMPT = [5, 9, 4, 11, 7, 3, 8, 12, 6]


def _dream_model(seed: int = 4):
    return tiny_model(seed=seed, logits_shift=1, n_kv_heads=2, qkv_bias=True)  # shifted logits, GQA, biases


def _first_steps(committed: list[list[int]], block_length: int) -> dict[int, int]:
    """block -> the index of the step that first committed in it."""
    first: dict[int, int] = {}
    for step, positions in enumerate(committed):
        for block in {p // block_length for p in positions}:
            first.setdefault(block, step)
    return first


def _greedy(logits_row: torch.Tensor, mask_id: int) -> int:
    row = logits_row.float().clone()
    row[mask_id] = float("-inf")
    return int(row.argmax())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.9])
def test_a_block_first_forward_commits_the_block_start_alone_predicted_from_the_position_before(mode, threshold):
    model = _dream_model()
    gen, block = 20, 8  # a ragged last block
    result = reference_generate(model, PROMPT, gen, block, threshold, stop_at_eos=False, cache=mode,
                                rule=DecodingRule.DREAM)
    first = _first_steps(result.committed, block)
    assert sorted(first) == [0, 1, 2]
    mask = model.config.mask_token_id
    for b, step in first.items():
        start = b * block
        assert result.committed[step] == [start]  # that position alone, whatever the threshold
        # its token: the full forward's prediction at the position before it, on the canvas of that moment
        canvas = result.tokens[:start] + [mask] * (gen - start)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + canvas])).logits[0]
        assert result.tokens[start] == _greedy(logits[len(PROMPT) + start - 1], mask)


@pytest.mark.parametrize("mode", MODES)
def test_at_threshold_zero_a_block_takes_two_steps_under_the_dream_rule_and_one_under_llada(mode):
    model = _dream_model(seed=5)
    gen, block = 24, 8
    dream = reference_generate(model, PROMPT, gen, block, 0.0, stop_at_eos=False, cache=mode, rule="dream")
    llada = reference_generate(model, PROMPT, gen, block, 0.0, stop_at_eos=False, cache=mode)
    assert dream.num_steps == 2 * (gen // block)  # the block start, then every other position at once
    assert [len(c) for c in dream.committed] == [1, block - 1] * (gen // block)
    assert llada.num_steps == gen // block and [len(c) for c in llada.committed] == [block] * (gen // block)


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_a_cache_step_window_starts_at_the_block_and_each_output_predicts_the_next_position(mode):
    model = _dream_model(seed=6)
    gen, block, tau = 16, 8, 0.3
    mask, prompt_len = model.config.mask_token_id, len(PROMPT)
    result = reference_generate(model, PROMPT, gen, block, tau, stop_at_eos=False, cache=mode, rule="dream")
    # block 0 by hand: the full forward keeps every position's keys and values and commits the block start
    x = torch.tensor([PROMPT + [mask] * gen])
    with torch.no_grad():
        full = model(x, return_kv=True)
    x[0, prompt_len] = _greedy(full.logits[0, prompt_len - 1], mask)
    # the cache step: fresh tokens from the block start, the kept keys and values of everything else
    start, end = prompt_len, prompt_len + block if mode == "dual" else x.shape[1]
    outside = torch.cat((torch.arange(0, start), torch.arange(end, x.shape[1])))
    context = [(k[:, :, outside], v[:, :, outside]) for k, v in full.kv]
    with torch.no_grad():
        window = model(x[:, start:end], position_ids=torch.arange(start, end)[None], context_kv=context,
                       context_valid=torch.ones((1, len(outside)), dtype=torch.bool)).logits[0]
    rows = window[: block - 1].float()  # outputs at positions start .. start+6 predict start+1 .. start+7
    rows[:, mask] = float("-inf")
    conf, tokens = torch.softmax(rows, dim=-1).max(dim=-1)
    expected = sorted({int(i) + 1 for i in torch.nonzero(conf >= tau).flatten()} | {int(conf.argmax()) + 1})
    assert result.committed[1] == expected
    assert [result.tokens[p] for p in expected] == [int(tokens[p - 1]) for p in expected]


def test_the_dream_threshold_is_inclusive_and_the_block_start_goes_alone():
    conf = torch.tensor([0.5, 0.9, 0.95, 0.2])
    assert select_commits(DecodingRule.DREAM, conf.clone(), 0.9, block_start_masked=False).tolist() == [1, 2]
    assert select_commits(DecodingRule.LLADA, conf.clone(), 0.9, block_start_masked=False).tolist() == [2]
    assert select_commits(DecodingRule.DREAM, conf.clone(), 0.0, block_start_masked=True).tolist() == [0]
    assert select_commits(DecodingRule.LLADA, conf.clone(), 0.0, block_start_masked=True).tolist() == [0, 1, 2, 3]
    low = torch.tensor([0.1, 0.3, 0.2])  # none clears the threshold: the most confident one still goes
    assert select_commits(DecodingRule.DREAM, low, 0.9, block_start_masked=False).tolist() == [1]


def test_windows_and_the_rule_a_config_names():
    assert cache_window_start(DecodingRule.DREAM, 40, 1) == 40
    assert cache_window_start(DecodingRule.LLADA, 40, 1) == 39 and cache_window_start(DecodingRule.LLADA, 40, 0) == 40
    assert decoding_rule(DLMConfig()) is DecodingRule.LLADA  # a config naming none: DiLaServe's
    assert decoding_rule(DLMConfig(decoding_rule="dream")) is DecodingRule.DREAM
    with pytest.raises(ValueError, match="field 'decoding_rule' is 'fast'; expected one of 'llada', 'dream'"):
        parse_rule("fast")


def test_the_llada_rule_stays_the_default_of_the_reference():
    model = _dream_model(seed=7)
    model.config.decoding_rule = "dream"  # the reference follows its argument, not the config
    for tau in (0.5, 0.0):
        default = reference_generate(model, PROMPT, 16, 8, tau, stop_at_eos=False, cache="dual")
        llada = reference_generate(model, PROMPT, 16, 8, tau, stop_at_eos=False, cache="dual", rule="llada")
        assert (default.tokens, default.committed) == (llada.tokens, llada.committed)
    dream = reference_generate(model, PROMPT, 16, 8, 0.0, stop_at_eos=False, cache="dual", rule="dream")
    assert default.committed[0] == list(range(8)) and dream.committed[0] == [0]
