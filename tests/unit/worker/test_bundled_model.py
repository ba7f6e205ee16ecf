"""The bundled model as shipped: it loads, it adds, and its thresholds trade steps for quality."""

import subprocess
import sys
from pathlib import Path

import pytest

from services.worker.engine import CacheMode, DLMEngine
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
