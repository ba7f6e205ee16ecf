import random

import pytest
import torch

from services.worker.engine.engine import DLMEngine
from services.worker.engine.request import EngineError
from services.worker.reference import reference_generate
from shared.messages.base import CacheMode, StepKind

from .conftest import tiny_model


def _requests(seed: int, count: int):
    """(prompt ids, gen length, block length, threshold) with mixed lengths and thresholds."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(3, 24) for _ in range(rng.randint(3, 30))]
        block = rng.choice([4, 8])
        gen = block * rng.randint(1, 3) + rng.choice([0, 0, 2])  # a ragged last block too
        out.append((prompt, gen, block, rng.choice([0.3, 0.5, 0.7, 0.9])))
    return out


@pytest.mark.parametrize("batch_size", [1, 4, 8])
def test_batched_engine_without_cache_equals_reference(model, batch_size):
    engine = DLMEngine(model, stop_at_eos=False)
    specs = _requests(seed=batch_size, count=batch_size)
    batch = [(engine.new_request(f"r{i}", p, g, b, CacheMode.NONE), t) for i, (p, g, b, t) in enumerate(specs)]
    engine.run_to_completion(batch)
    for (state, _), (prompt, gen, block, tau) in zip(batch, specs, strict=True):
        ref = reference_generate(model, prompt, gen, block, tau, stop_at_eos=False)
        assert state.canvas == ref.tokens
        assert state.num_steps == ref.num_steps


def test_thresholds_change_per_step_like_reference(model):
    engine = DLMEngine(model, stop_at_eos=False)
    schedule = [0.95, 0.3, 0.8, 0.5, 0.2, 0.9] * 10
    state = engine.new_request("r", list(range(3, 20)), 16, 8, CacheMode.NONE)
    while not state.finished:
        engine.step([(state, schedule[state.num_steps])])
    ref = reference_generate(model, list(range(3, 20)), 16, 8, lambda step: schedule[step], stop_at_eos=False)
    assert state.canvas == ref.tokens


def test_stop_at_eos_fills_the_rest_and_matches_reference():
    model = tiny_model(seed=3)
    with torch.no_grad():  # make EOS the favourite everywhere so generation stops after one block
        model.model.transformer.ff_out.weight[2] += 3.0
    engine = DLMEngine(model, stop_at_eos=True)
    state = engine.new_request("r", [5, 6, 7], 24, 8, CacheMode.NONE)
    engine.run_to_completion([(state, 0.9)])
    ref = reference_generate(model, [5, 6, 7], 24, 8, 0.9, stop_at_eos=True)
    assert state.canvas == ref.tokens and state.num_steps == ref.num_steps
    assert state.canvas[8:] == [2] * 16


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("mode", list(CacheMode))
def test_a_full_forward_predicts_where_the_answer_ends(mode, shift):
    """``predicted_end``: the first masked position (of the block or after it) whose most likely
    token, the mask excluded, is EOS, read from the full forward's logits; the canvas end when none.
    Reading the canvas after the block changes nothing the step commits."""
    model = tiny_model(seed=5, logits_shift=shift)
    with torch.no_grad():  # EOS likely, though not everywhere, so the answer ends inside the canvas
        model.model.transformer.ff_out.weight[2] += 0.6
    prompt = [5, 6, 7, 8]
    seeing, blind = DLMEngine(model, stop_at_eos=True), DLMEngine(model, stop_at_eos=True, predict_end=False)
    a, b = (e.new_request("r", prompt, 24, 8, mode) for e in (seeing, blind))
    checked = 0
    while not a.finished:
        kind = seeing.next_step_kind(a)
        expected = a.predicted_end
        if kind is StepKind.RECOMPUTE:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + a.canvas])).logits[0].float()
            logits[:, model.config.mask_token_id] = float("-inf")
            start = a.current_block(seeing.mask_id) * 8
            rows = logits[len(prompt) - shift:len(prompt) - shift + 24].argmax(-1).tolist()
            expected = next((p for p in range(start, 24) if a.canvas[p] == 1 and rows[p] == 2), 24)
            checked += 1
        [ra], [rb] = seeing.step([(a, 0.7)]), blind.step([(b, 0.7)])
        assert a.canvas == b.canvas and ra.committed_positions == rb.committed_positions
        eos = [p for p, t in zip(ra.committed_positions, ra.committed_token_ids, strict=True) if t == 2]
        assert ra.predicted_end == min([expected, *eos]) and rb.predicted_end is None
    assert checked >= 1 and b.finished


@pytest.mark.parametrize("mode", [CacheMode.PREFIX, CacheMode.DUAL])
def test_cache_modes_recompute_at_block_start_then_cache_steps(model, mode):
    engine = DLMEngine(model, stop_at_eos=False)
    state = engine.new_request("r", list(range(3, 23)), 16, 8, mode)
    kinds = engine.run_to_completion([(state, 0.99)])["r"]
    # a threshold of 0.99 commits about one token per step: each block starts with a recompute step
    assert kinds[0] is StepKind.RECOMPUTE
    assert kinds.count(StepKind.RECOMPUTE) == state.num_blocks
    assert StepKind.CACHE in kinds
    assert state.finished and engine.mask_id not in state.canvas
    assert not engine.has_cache("r")  # released when finished


def test_first_step_of_a_block_with_cache_equals_no_cache(model):
    engine = DLMEngine(model, stop_at_eos=False)
    a = engine.new_request("a", [4, 5, 6, 7], 16, 8, CacheMode.DUAL)
    b = engine.new_request("b", [4, 5, 6, 7], 16, 8, CacheMode.NONE)
    ra, rb = engine.step([(a, 0.5), (b, 0.5)])
    assert ra.committed_positions == rb.committed_positions and a.canvas == b.canvas


def test_dual_cache_step_is_exact_when_only_the_block_changes():
    # With one layer and nothing after the block, the stale cache equals a fresh one: the cache
    # step must then give exactly the no-cache result (checks RoPE positions and the key layout).
    model = tiny_model(seed=5)
    model.model.transformer.blocks = model.model.transformer.blocks[:1]
    model.config.n_layers = 1
    engine = DLMEngine(model, stop_at_eos=False)
    a = engine.new_request("a", [4, 9, 6, 7, 11], 8, 8, CacheMode.DUAL)
    b = engine.new_request("b", [4, 9, 6, 7, 11], 8, 8, CacheMode.NONE)
    for _ in range(8):
        if a.finished:
            break
        ra, rb = engine.step([(a, 0.6), (b, 0.6)])
        assert a.canvas == b.canvas


def test_mixed_cache_modes_and_joining_requests_in_one_batch(model):
    engine = DLMEngine(model, stop_at_eos=False)
    states = [engine.new_request(f"r{i}", list(range(3, 10 + 3 * i)), 16, 8, mode)
              for i, mode in enumerate([CacheMode.NONE, CacheMode.PREFIX, CacheMode.DUAL])]
    engine.step([(s, 0.8) for s in states[:2]])  # the third joins one step later
    engine.run_to_completion([(s, 0.8) for s in states])
    assert all(s.finished for s in states)
    ref = reference_generate(model, states[0].prompt_ids, 16, 8, 0.8, stop_at_eos=False)
    assert states[0].canvas == ref.tokens


def test_migrated_request_continues_from_plain_state(model):
    first, second = DLMEngine(model, stop_at_eos=False), DLMEngine(model, stop_at_eos=False)
    state = first.new_request("r", list(range(3, 15)), 16, 8, CacheMode.NONE)
    first.step([(state, 0.7)])
    first.step([(state, 0.7)])
    moved = type(state)(**vars(state))  # what another worker rebuilds from the stored state
    moved.canvas = list(state.canvas)
    second.run_to_completion([(moved, 0.7)])
    assert moved.canvas == reference_generate(model, list(range(3, 15)), 16, 8, 0.7, stop_at_eos=False).tokens


def test_migrated_cached_request_starts_with_a_recompute_step(model):
    first, second = DLMEngine(model, stop_at_eos=False), DLMEngine(model, stop_at_eos=False)
    state = first.new_request("r", list(range(3, 15)), 16, 8, CacheMode.DUAL)
    first.step([(state, 0.99)])
    assert first.next_step_kind(state) is StepKind.CACHE
    assert second.next_step_kind(state) is StepKind.RECOMPUTE


def test_step_result_reports_confidence_statistics(model):
    engine = DLMEngine(model, stop_at_eos=False)
    state = engine.new_request("r", [3, 4, 5], 8, 8, CacheMode.NONE)
    result = engine.step([(state, 0.99)])[0]
    c = result.confidence
    assert 0.0 <= c.min <= c.q25 <= c.median <= c.q75 <= 1.0 and c.min <= c.mean <= 1.0
    assert result.num_masked == 8 - len(result.committed_positions)


def test_bad_requests_are_refused_with_a_message(model):
    engine = DLMEngine(model)
    with pytest.raises(EngineError, match="prompt is empty"):
        engine.new_request("r", [], 8, 8)
    with pytest.raises(EngineError, match="exceeds"):
        engine.new_request("r", [3] * 600, 8, 8)
    state = engine.new_request("r", [3], 8, 8)
    with pytest.raises(EngineError, match="threshold"):
        engine.step([(state, 1.5)])
