"""`dls calibrate`'s arguments: every bad input is a CliError naming its flag (before anything is loaded
on the device), and a model other than the bundled one is refused without --prompts."""

import json
import os
from pathlib import Path

import pytest

from calibrate.cli import build_setup
from calibrate.random_model import write_random_model
from services.cli import build_parser, main
from shared.cli import CliError

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "models" / "dls-tiny"


def setup_of(*argv: str):
    return build_setup(build_parser().parse_args(["calibrate", *argv]))


@pytest.fixture
def model(tmp_path) -> Path:
    """A writable stand-in for the bundled model: its config, tokenizer and generation limits, linked weights."""
    copy = tmp_path / "tiny"
    copy.mkdir()
    for name in ("config.json", "tokenizer.json", "training_info.json", "model.safetensors"):
        os.symlink(MODEL / name, copy / name)
    return copy


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> Path:
    """A model that is not the bundled one: random LLaDA-layout weights, no tokenizer."""
    return write_random_model("llada-tiny", tmp_path_factory.mktemp("foreign") / "llada-tiny")


def jsonl(path: Path, bodies) -> Path:
    path.write_text("".join((b if isinstance(b, str) else json.dumps(b)) + "\n" for b in bodies))
    return path


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "/nonexistent"], "--model /nonexistent: no such directory"),
    (["--thresholds", "0.5,x"], "--thresholds: expected numbers separated by commas"),
    (["--thresholds", "0,0.5"], r"--thresholds must be in \(0, 1\]"),
    (["--only", "profile,speed"], "--only: unknown stage speed"),
    (["--tp", "0"], "--tp: expected positive degrees"),
    (["--device", "tpu"], "--device tpu: expected cpu, cuda or cuda:N"),
    (["--max-batch", "0"], "--max-batch must be positive"),
    (["--heldout-fraction", "1"], r"--heldout-fraction must be in \(0, 1\)"),
    (["--cache-modes", "dual,paged"], "--cache-modes: expected none, prefix or dual"),
    (["--gen-lengths", "16,0"], "--gen-lengths and --block-lengths must be positive"),
    (["--prompts", "/nonexistent.jsonl"], "--prompts /nonexistent.jsonl: .*no such file"),
    (["--prompts-format", "csv", "--prompts", "x"], "--prompts-format csv: unknown"),
    (["--scorer", "exact"], "--scorer needs --eval FILE"),
])
def test_bad_arguments_name_their_flag(model, argv, message):
    if argv[0] != "--model":
        argv = ["--model", str(model), *argv]
    with pytest.raises(CliError, match=message):
        setup_of(*argv)


def test_cuda_without_a_gpu_is_refused_naming_the_device(model):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(CliError, match="--device cuda: .*sees no CUDA device"):
        setup_of("--model", str(model), "--device", "cuda")


def test_eval_and_scorer_errors(model, tmp_path):
    problems = jsonl(tmp_path / "e.jsonl", [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "four"}])
    with pytest.raises(CliError, match="--eval needs --scorer"):
        setup_of("--model", str(model), "--eval", str(problems))
    with pytest.raises(CliError, match="--scorer rouge: unknown .*exact, gsm8k, contains, choice"):
        setup_of("--model", str(model), "--eval", str(problems), "--scorer", "rouge")
    with pytest.raises(CliError, match=f"--eval {problems}: line 2: no number in the expected answer .*--scorer gsm8k"):
        setup_of("--model", str(model), "--eval", str(problems), "--scorer", "gsm8k")
    broken = jsonl(tmp_path / "b.jsonl", [{"prompt": "1+2=", "answer": "3"}, "", "{oops"])
    with pytest.raises(CliError, match=f"--eval {broken}: line 3: not JSON"):
        setup_of("--model", str(model), "--eval", str(broken), "--scorer", "exact")
    setup = setup_of("--model", str(model), "--eval", str(problems), "--scorer", "exact")
    assert setup.scorer.name == "exact" and len(setup.eval_specs) == 2 and setup.bundled


def test_a_bad_prompt_line_is_named(model, tmp_path):
    prompts = jsonl(tmp_path / "p.jsonl", [{"prompt": "1+2="}] * 12 + [{"messages": "hi"}])
    with pytest.raises(CliError, match=f"--prompts {prompts}: line 13: 'messages' must be a non-empty list"):
        setup_of("--model", str(model), "--prompts", str(prompts))


def test_too_few_prompts_for_a_predictor(model, tmp_path):
    prompts = jsonl(tmp_path / "p.jsonl", [{"prompt": "1+2="}] * 4)
    with pytest.raises(CliError, match="4 prompts; the predictor needs at least 10"):
        setup_of("--model", str(model), "--prompts", str(prompts))
    assert setup_of("--model", str(model), "--prompts", str(prompts), "--only", "quality").prompt_specs


def test_a_model_other_than_the_bundled_one_needs_prompts(foreign, tmp_path):
    with pytest.raises(CliError, match=f"--prompts: {foreign} is not the bundled model.*pass --prompts FILE"):
        setup_of("--model", str(foreign), "--out", str(tmp_path / "b"))
    with pytest.raises(CliError, match="--prompts"):
        setup_of("--model", str(foreign), "--out", str(tmp_path / "b"), "--only", "quality")
    setup = setup_of("--model", str(foreign), "--out", str(tmp_path / "b"), "--only", "profile")  # no prompts needed
    assert not setup.bundled and setup.stages == ("profile",)


def test_the_bundled_model_is_recognised_in_a_copy(model):
    assert setup_of("--model", str(model)).bundled


def test_an_unwritable_bundle_names_out(model, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(CliError, match=f"--out {blocked}/b: cannot write"):
        setup_of("--model", str(model), "--out", str(blocked / "b"))
    monkeypatch.delenv("DLS_CALIBRATION_DIR", raising=False)
    os.chmod(model, 0o555)
    try:
        if os.access(model, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        with pytest.raises(CliError, match="pass --out"):
            setup_of("--model", str(model))
    finally:
        os.chmod(model, 0o755)


def test_the_dls_command_prints_the_error(model, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--model", str(model), "--scorer", "exact"])
    assert exit_info.value.code == 2
    assert "dls: error: --scorer needs --eval FILE" in capsys.readouterr().err
