"""Sampling in the engine: temperature, top-p, top-k with seeded Gumbel noise; what each committed
position records (``logprobs``); stop strings."""

import math

import pytest
import torch

from services.worker.decoding.sampling import SamplingParams, cut, noise_seed, sample
from services.worker.engine.engine import DLMEngine
from services.worker.engine.request import EngineError, RequestState
from services.worker.reference import reference_generate
from shared.generation import stop_length
from shared.messages.base import CacheMode

from .conftest import tiny_model

PROMPT = [5, 9, 4, 11, 7, 3, 8]


class Letters:
    """A tokenizer for the tiny test models: id i is one letter, 0-2 are specials (nothing), decoded
    through Hugging Face's signature (``shared.tokenizer.answer_text`` skips special tokens)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("" if i < 3 else chr(ord("a") + i - 3) for i in ids)


def _run(engine: DLMEngine, state: RequestState, threshold: float = 0.7) -> RequestState:
    engine.run_to_completion([(state, threshold)])
    return state


def _sampled(engine: DLMEngine, request_id: str, seed: int | None, temperature: float = 1.5, **kwargs):
    return engine.new_request(request_id, PROMPT, 16, 8, CacheMode.NONE,
                              sampling=SamplingParams(temperature=temperature, seed=seed, **kwargs))


def test_temperature_zero_is_greedy_whatever_the_cut_and_seed(model):
    engine = DLMEngine(model, stop_at_eos=False)
    state = engine.new_request("r", PROMPT, 16, 8, CacheMode.NONE,
                               sampling=SamplingParams(temperature=0.0, top_p=0.3, top_k=2, seed=5))
    _run(engine, state)
    reference = reference_generate(model, PROMPT, 16, 8, 0.7, stop_at_eos=False)
    assert state.canvas == reference.tokens and state.num_steps == reference.num_steps


@pytest.mark.parametrize("kwargs", [{"top_k": 1}, {"top_p": 1e-9}])
def test_a_cut_that_keeps_one_token_samples_the_greedy_answer(model, kwargs):
    engine = DLMEngine(model, stop_at_eos=False)
    state = _run(engine, _sampled(engine, "r", seed=3, temperature=2.0, **kwargs))
    reference = reference_generate(model, PROMPT, 16, 8, 0.7, stop_at_eos=False)
    assert state.canvas == reference.tokens and state.num_steps == reference.num_steps


def test_a_seed_reproduces_the_answer_in_any_batch_and_other_seeds_differ(model):
    engine = DLMEngine(model, stop_at_eos=False)
    alone = _run(engine, _sampled(engine, "a", seed=11))
    other = DLMEngine(tiny_model(), stop_at_eos=False)  # another instance, same weights
    crowd = [(_sampled(other, f"c{i}", seed=i), 0.7) for i in range(4)]
    again = _sampled(other, "b", seed=11)  # another request id: the seed alone keys the noise
    other.run_to_completion([*crowd, (again, 0.7)])
    assert again.canvas == alone.canvas
    greedy = reference_generate(model, PROMPT, 16, 8, 0.7, stop_at_eos=False).tokens
    answers = {tuple(s.canvas) for s, _ in crowd} | {tuple(alone.canvas), tuple(greedy)}
    assert len(answers) >= 4  # four seeds and greedy: the draws differ


def test_without_a_seed_the_request_id_keys_the_noise(model):
    engine = DLMEngine(model, stop_at_eos=False)
    first = _run(engine, _sampled(engine, "same-id", seed=None))
    second = _run(engine, _sampled(engine, "same-id", seed=None))
    others = [_run(engine, _sampled(engine, f"id-{i}", seed=None)).canvas for i in range(4)]
    assert first.canvas == second.canvas
    assert any(canvas != first.canvas for canvas in others)


@pytest.mark.parametrize("mode", [CacheMode.NONE, CacheMode.DUAL])
def test_a_migrated_request_keeps_its_draws(model, mode):
    """Moved after each step to a fresh engine (state as plain data, no cache there): with no cache the
    logits are the same, so the tokens are; with a cache, the moved request's steps are recomputes,
    which are exact, and it still commits what a stay-at-home request run without cache commits."""
    home = DLMEngine(model, stop_at_eos=False)
    staying = home.new_request("r", PROMPT, 16, 8, CacheMode.NONE, sampling=SamplingParams(1.2, 0.9, 6, seed=4))
    _run(home, staying)
    state = home.new_request("r", PROMPT, 16, 8, mode, sampling=SamplingParams(1.2, 0.9, 6, seed=4))
    while not state.finished:
        engine = DLMEngine(model, stop_at_eos=False)  # a new instance for every step
        engine.step([(state, 0.7)])
    assert state.canvas == staying.canvas and state.num_steps == staying.num_steps


def test_draws_follow_softmax_over_temperature_within_the_cut():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]], dtype=torch.float64)
    params = SamplingParams(temperature=0.8, top_k=3)
    counts = torch.zeros(5)
    for seed in range(4000):
        _, token = sample(logits, params, noise_seed(seed, "", 0))
        counts[token] += 1
    kept = torch.softmax(logits[0, :3] / 0.8, dim=-1)
    assert counts[3] == 0 and counts[4] == 0  # outside top-k, and the excluded token
    assert torch.allclose(counts[:3] / 4000, kept.float(), atol=0.03)


def test_the_probability_reported_is_the_model_s_at_temperature_one():
    logits = torch.tensor([[3.0, 0.0, -2.0]], dtype=torch.float64)
    for seed in range(50):
        prob, token = sample(logits, SamplingParams(temperature=5.0), seed)
        assert math.isclose(float(prob), float(torch.softmax(logits, -1)[0, token]), rel_tol=1e-9)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64))
    assert torch.isfinite(cut(logits, 0, 0.49)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(cut(logits, 0, 0.79)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(cut(logits, 0, 0.81)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(cut(logits, 2, 1.0)).tolist() == [[True, True, False, False]]


def test_committed_positions_record_their_probability_and_top_tokens(model):
    engine = DLMEngine(model, stop_at_eos=False)
    state = engine.new_request("r", PROMPT, 16, 8, CacheMode.DUAL, num_top_logprobs=3)
    _run(engine, state)
    assert len(state.confidences) == len(state.top_token_ids) == 16
    for pos, token in enumerate(state.canvas):
        assert state.top_token_ids[pos][0] == token  # greedy: the most likely token is the one committed
        assert math.isclose(state.confidences[pos], state.top_probs[pos][0], rel_tol=1e-5)
        assert state.top_probs[pos] == sorted(state.top_probs[pos], reverse=True) and len(state.top_probs[pos]) == 3
        assert 0.0 < state.confidences[pos] <= 1.0
    sampled = _run(engine, _sampled(engine, "s", seed=2))
    assert all(0.0 < c <= 1.0 for c in sampled.confidences) and not sampled.top_token_ids


def test_a_stop_string_ends_the_answer_before_it(model):
    engine = DLMEngine(model, Letters(), stop_at_eos=False)
    whole = _run(engine, engine.new_request("w", PROMPT, 16, 8, CacheMode.NONE))
    text = Letters().decode(whole.canvas)
    stop = text[5:7]
    state = _run(engine, engine.new_request("s", PROMPT, 16, 8, CacheMode.NONE, stop=[stop, "zzzz"]))
    answer = engine.answer(state)
    assert answer.finish_reason == "stop"
    assert Letters().decode(answer.token_ids) == text[: text.index(stop)]
    assert state.num_steps <= whole.num_steps and state.finished


def test_stop_strings_need_a_tokenizer_and_options_are_checked(model):
    engine = DLMEngine(model)
    with pytest.raises(EngineError, match="tokenizer"):
        engine.new_request("r", PROMPT, 8, 8, stop=["x"])
    with pytest.raises(EngineError, match="top_p"):
        engine.new_request("r", PROMPT, 8, 8, sampling=SamplingParams(1.0, top_p=0.0))
    with pytest.raises(EngineError, match="num_top_logprobs"):
        engine.new_request("r", PROMPT, 8, 8, num_top_logprobs=21)


def test_stop_length_is_the_longest_prefix_before_the_stop():
    decode = Letters().decode
    ids = [3, 4, 5, 6, 7]  # "abcde"
    assert stop_length(ids, decode, ["cd"]) == 2
    assert stop_length(ids, decode, ["x", "a"]) == 0
    assert stop_length(ids, decode, ["x"]) is None and stop_length(ids, decode, []) is None
