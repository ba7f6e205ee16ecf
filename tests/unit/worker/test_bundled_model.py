"""The bundled model as shipped: it loads, it adds, and its thresholds trade steps for quality."""

import subprocess
import sys
from pathlib import Path

import pytest

from services.worker.engine.engine import CacheMode, DLMEngine
from shared.tasks import Family, Split, TaskGenerator, check_answer

MODEL_DIR = Path(__file__).resolve().parents[3] / "models" / "dls-tiny"


@pytest.fixture(scope="module")
def engine():
    return DLMEngine.from_pretrained(MODEL_DIR)


def test_zero_shot_addition(engine):
    result = engine.generate("347+589=", threshold=0.9)
    assert result.text == "936"


def _score(engine, problems, threshold):
    states = [engine.new_request(f"r{i}", engine.encode(p.prompt), cache_mode=CacheMode.DUAL)
              for i, p in enumerate(problems)]
    engine.run_to_completion([(s, threshold) for s in states])
    correct = sum(check_answer(p, engine.decode(s.canvas)) for p, s in zip(problems, states, strict=True))
    return correct / len(problems), sum(s.num_steps for s in states) / len(states)


def test_lower_threshold_is_faster_and_worse_on_coupled_words(engine):
    problems = [TaskGenerator(seed=11).problem(2, Split.HELD_OUT, Family.WORDS) for _ in range(48)]
    acc_high, steps_high = _score(engine, problems, 0.9)
    acc_low, steps_low = _score(engine, problems, 0.5)
    assert steps_low < steps_high
    assert acc_low < acc_high


def test_dls_generate_prints_the_answer_and_steps():
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "347+589=", "--threshold", "0.9", "--model", str(MODEL_DIR)],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert out.stdout.strip() == "936"
    assert "steps:" in out.stderr


def test_dls_generate_rejects_a_bad_threshold():
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "1+1=", "--threshold", "1.5", "--model", str(MODEL_DIR)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2 and "--threshold" in out.stderr


@pytest.mark.parametrize("gen_length", [8, 16, 32, 64, 128])
def test_the_answer_does_not_follow_the_canvas(engine, gen_length):
    """What a client allows (max_tokens -> canvas) never changes an answer that fits."""
    assert engine.generate("347+589=", threshold=0.9, gen_length=gen_length, block_length=8).text == "936"


@pytest.mark.parametrize("cache", list(CacheMode))
def test_early_stop_at_eos_in_every_cache_mode(engine, cache):
    stopped = engine.generate("12+30=", threshold=0.9, gen_length=64, block_length=8, cache=cache)
    whole = engine.generate("12+30=", threshold=0.9, gen_length=64, block_length=8, cache=cache, ignore_eos=True)
    assert stopped.text == whole.text == "42"
    assert (stopped.finish_reason, whole.finish_reason) == ("stop", "length")
    assert stopped.blocks_skipped == 7  # the answer ends in block 0 of 8
    assert whole.blocks_skipped == 0 and whole.num_steps >= stopped.num_steps + 7  # one forward a block at least


def test_a_long_chain_spans_blocks_and_a_cap_cuts_it(engine):
    problem = TaskGenerator(seed=5).problem(0, Split.HELD_OUT, Family.CHAIN)
    full = engine.generate(problem.prompt, threshold=0.9, gen_length=128, block_length=16)
    assert check_answer(problem, full.text) and full.finish_reason == "stop"
    assert len(full.text) + 1 > 3 * 16  # over three blocks of 16 at least
    cut = engine.generate(problem.prompt, threshold=0.9, max_tokens=20, block_length=16)
    assert cut.finish_reason == "length" and len(cut.text) == 20


def test_the_first_forward_tells_the_block_where_a_chain_ends(engine):
    """The step predictor's end feature: after a request's first step (a full forward) the engine
    says which block its EOS will be in, and the request stops there (what the simulator's replay
    engine assumes when it reports the recorded end)."""
    problems = TaskGenerator(seed=9).problems(12, 0, split=Split.HELD_OUT)
    chains = [p for p in problems if p.family is Family.CHAIN] or [TaskGenerator(seed=9).problem(0, Split.HELD_OUT, Family.CHAIN)]
    for i, problem in enumerate(chains):
        state = engine.new_request(f"c{i}", engine.encode(problem.prompt), 128, 16, CacheMode.DUAL)
        [first] = engine.step([(state, 0.9)])
        assert first.predicted_end is not None
        engine.run_to_completion([(state, 0.9)])
        end = state.canvas.index(engine.eos_id)
        assert first.predicted_end // 16 == end // 16, problem.prompt
