"""Acceptance (issue 41): on a random Dream-style checkpoint (shifted logits, GQA, q/k/v biases), loaded as
workers load it (its family's rule: Fast-dLLM's Dream rule, ``config.decoding_rule``), the engine's
tokens and steps equal the reference decoder's Dream rule, with no cache, prefix and dual cache, at
batch 1 and in a mixed batch (requests joining at different steps, mixed prompt, canvas and block
lengths and thresholds).

What the rule is: ``services/worker/decoding/rule.py``; the engine applies it in its step plan (cache
windows from the block) and in the commit rule on the device (``eligible``, ``inclusive``).
"""


import pytest

from services.worker.decoding.rule import DecodingRule, decoding_rule
from services.worker.engine.engine import DLMEngine
from services.worker.model.loading import load_model
from services.worker.reference import reference_generate
from shared.messages.base import CacheMode
from tests.dream_checkpoint import write_dream_weights

from .conftest import random_specs, tiny_model

MODES = [CacheMode.NONE, CacheMode.PREFIX, CacheMode.DUAL]


@pytest.fixture(scope="module")
def dream_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dream")
    write_dream_weights(directory, tiny_model(seed=4, logits_shift=1, n_kv_heads=2, qkv_bias=True))
    model = load_model(directory).model  # float64, as written
    assert decoding_rule(model.config) is DecodingRule.DREAM and model.config.logits_shift == 1
    return model


def _specs(seed: int, count: int) -> list[tuple[list[int], int, int, float]]:
    """The first request at threshold 0, where the rules differ most (the LLaDA rule commits a whole
    block at its first forward, the Dream rule one position)."""
    return random_specs(seed, count, prompt_lengths=(1, 30), first_threshold=0.0)


def _check(model, state, spec, mode) -> None:
    prompt, gen, block, tau = spec
    ref = reference_generate(model, prompt, gen, block, tau, stop_at_eos=False, cache=mode, rule=DecodingRule.DREAM)
    assert (state.canvas, state.num_steps) == (ref.tokens, ref.num_steps)


@pytest.mark.parametrize("mode", MODES)
def test_engine_equals_the_dream_reference_at_batch_1(dream_model, mode):
    engine = DLMEngine(dream_model, stop_at_eos=False, kv_page_size=4)
    for i, spec in enumerate(_specs(seed=11, count=4)):
        prompt, gen, block, tau = spec
        state = engine.new_request(f"r{i}", prompt, gen, block, mode)
        engine.run_to_completion([(state, tau)])
        _check(dream_model, state, spec, mode)


@pytest.mark.parametrize("mode", MODES)
def test_engine_equals_the_dream_reference_in_a_mixed_batch(dream_model, mode):
    engine = DLMEngine(dream_model, stop_at_eos=False, kv_page_size=4)
    specs = _specs(seed=12 + len(mode), count=6)
    states = [engine.new_request(f"r{i}", p, g, b, mode) for i, (p, g, b, _) in enumerate(specs)]
    step = 0
    while not all(s.finished for s in states):  # request i joins at step i; finished ones leave
        live = [(s, spec[3]) for i, (s, spec) in enumerate(zip(states, specs, strict=True))
                if i <= step and not s.finished]
        if live:
            engine.step(live)
        step += 1
    for state, spec in zip(states, specs, strict=True):
        _check(dream_model, state, spec, mode)
