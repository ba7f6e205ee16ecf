"""`dls calibrate` end to end on a copy of the bundled model with its calibration removed (small sizes:
24 prompts, 40 labelled problems, batches 1, 2 and 4): the bundle it writes is one every service loads, a
rerun skips what is done, a changed argument redoes that stage only, and a stopped run resumes where it
stopped. Real engine, real LightGBM."""

import json
import shutil
from pathlib import Path

import pytest

from bench.calibrate import copy_model, write_problems
from calibrate.random_model import write_random_model
from services.cli import main
from shared.calibration import MANIFEST, find
from shared.profiles import LatencyProfile
from shared.tasks import Family, Split, TaskGenerator

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "models" / "dls-tiny"
THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9)


def write_prompts(path: Path, count: int) -> Path:
    """Held-out task prompts as completion bodies, every sixth one a chat body."""
    problems = TaskGenerator(11, family_weights={Family.ADD: 0.4, Family.WORDS: 0.4, Family.CHAIN: 0.2}).problems(
        count, max_shots=4, split=Split.HELD_OUT)
    bodies = [{"messages": [{"role": "user", "content": p.prompt}]} if i % 6 == 5 else {"prompt": p.prompt}
              for i, p in enumerate(problems)]
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    model = copy_model(MODEL, root / "dls-tiny-copy")
    prompts = write_prompts(root / "prompts.jsonl", 24)
    problems = write_problems(root / "eval.jsonl", 40, 5, Family.ADD)
    return {"root": root, "model": model, "prompts": prompts, "eval": problems}


def args_of(files, *more: str) -> list[str]:
    return ["calibrate", "--model", str(files["model"]), "--prompts", str(files["prompts"]), "--eval",
            str(files["eval"]), "--scorer", "exact", "--max-batch", "4", "--repeats", "1", "--rounds", "50", *more]


def dls(capsys, argv: list[str]) -> tuple[str, str]:
    assert main(argv) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.fixture(scope="module")
def first_run(files):
    capture = pytest.MonkeyPatch()
    import io
    import sys

    out, err = io.StringIO(), io.StringIO()
    capture.setattr(sys, "stdout", out)
    capture.setattr(sys, "stderr", err)
    try:
        assert main(args_of(files)) == 0
    finally:
        capture.undo()
    return out.getvalue(), err.getvalue()


def test_the_bundle_loads_as_every_service_loads_it(files, first_run):
    from services.predictor.core.loading import load_predictor
    from services.predictor.service import load
    from services.scheduler.core.threshold import candidates_from_quality

    out, err = first_run
    calibration = find(files["model"])  # checks what it was made for against the copy's weights
    assert calibration is not None and calibration.device == "cpu"
    profile = LatencyProfile.load(calibration.profile_path)
    assert profile.measured and profile.tp_degrees == (1,) and profile.max_batch(1) == 4
    assert set(profile.curves[1]) == {"recompute_ms", "cache_ms", "full_ms"}
    for one_shot in (False, True):
        loaded = load(calibration.predictor_dir / ("oneshot" if one_shot else ""), one_shot)
        assert loaded.version
    assert load_predictor(files["model"]) is not None
    quality = json.loads(calibration.quality_path.read_text())
    assert set(quality["accuracy"]) == {str(t) for t in THRESHOLDS}
    assert quality["source"] == "labelled" and quality["scorer"] == "exact" and quality["problems"] == 40
    candidates = candidates_from_quality(THRESHOLDS, quality, budget_pp=100.0)
    assert candidates == THRESHOLDS  # every threshold within a budget of 100 points
    assert 0.9 in candidates_from_quality(THRESHOLDS, quality, budget_pp=0.0)

    manifest = calibration.manifest
    assert manifest["made_for"]["attention_backend"] == "sdpa" and manifest["created"].endswith("Z")
    assert manifest["command"].startswith("dls calibrate --model") and manifest["args"]["scorer"] == "exact"
    assert manifest["sizes"]["prompts"] == 24 and manifest["sizes"]["eval_problems"] == 40
    assert manifest["sizes"]["trace_rows"] > 24 * len(THRESHOLDS)
    artefacts = manifest["artefacts"]
    assert artefacts["profile"]["tp"] == [1] and artefacts["profile"]["max_batch"] == 4
    assert artefacts["profile"]["recompute_ms_b1"] > 0 and artefacts["profile"]["cache_ms_b1"] > 0
    predictor = artefacts["predictor"]
    assert (predictor["train_prompts"], predictor["heldout_prompts"]) == (19, 5)
    assert predictor["train_requests"] == 19 * len(THRESHOLDS) and predictor["heldout_requests"] == 5 * len(THRESHOLDS)
    assert predictor["ratio"] == pytest.approx(predictor["heldout_mre"] / predictor["one_shot_mre"], abs=1e-3)
    assert predictor["ratio"] < 1  # the online predictor beats the estimate made at arrival
    assert artefacts["quality"]["accuracy"] == quality["accuracy"] and artefacts["quality"]["source"] == "labelled"
    assert set(manifest["elapsed_s"]) == {"profile", "predictor", "quality"}
    # progress: what each stage does, n of N, the time
    assert "profile: TP 1 batch 4 (3/3)" in err and "95/95 requests" in err and "40/40 problems" in err
    assert "predictor: wrote" in out and "held-out error" in out


def test_reruns_skip_what_is_done_redo_what_changed_and_resume_where_stopped(files, first_run, capsys):
    out, err = dls(capsys, args_of(files))
    assert out.count("done before with the same inputs: skipped") == 3 and "up to date" in out
    assert "loading" not in err  # nothing was loaded

    created = json.loads((files["model"] / "calibration" / MANIFEST).read_text())["created"]
    out, err = dls(capsys, args_of(files, "--max-eval", "30"))
    assert "profile: done before" in out and "predictor: done before" in out
    assert "quality: made before with other inputs (--max-eval: 400 -> 30): measuring again" in out
    assert "removed the old" in out
    manifest = find(files["model"]).manifest
    assert manifest["artefacts"]["quality"]["problems"] == 30 and manifest["created"] >= created

    # a run stopped while decoding threshold 0.5: no manifest, no quality record, that threshold's answers missing
    bundle = files["model"] / "calibration"
    for path in (bundle / MANIFEST, bundle / "work" / "quality.json", bundle / "work" / "quality" / "dual-0.5.json"):
        path.unlink()
    assert find(files["model"]) is None  # uncalibrated meanwhile
    out, err = dls(capsys, args_of(files, "--max-eval", "30"))
    assert err.count("decoded before: kept") == 4 and "quality: threshold 0.5 (dual cache, 5/5): 30/30" in err
    assert find(files["model"]).manifest["artefacts"]["quality"]["problems"] == 30


def test_without_labels_the_curve_is_the_agreement_with_the_highest_threshold(files, first_run, capsys, tmp_path):
    out, _ = dls(capsys, ["calibrate", "--model", str(files["model"]), "--prompts", str(files["prompts"]),
                          "--only", "quality", "--thresholds", "0.6,0.9", "--out", str(tmp_path / "agree")])
    quality = json.loads((tmp_path / "agree" / "quality.json").read_text())
    assert quality["source"] == "agreement" and quality["scorer"] == "agreement with threshold 0.9"
    assert quality["accuracy"]["0.9"] == 1.0 and 0 <= quality["accuracy"]["0.6"] <= 1
    assert quality["problems"] == 24 and "no labelled problems" in quality["note"]
    assert "no manifest yet (no profile; no predictor)" in out  # a bundle with one stage is not a calibration
    assert not (tmp_path / "agree" / MANIFEST).exists()


@pytest.mark.timeout(180)
def test_tp_2_is_measured_with_the_tensor_parallel_engine(capsys, tmp_path):
    model = write_random_model("llada-tiny", tmp_path / "llada-tiny")
    out, err = dls(capsys, ["calibrate", "--model", str(model), "--only", "profile", "--tp", "1,2", "--max-batch",
                            "2", "--repeats", "1", "--prompt-tokens", "16", "--out", str(tmp_path / "bundle")])
    profile = LatencyProfile.load(tmp_path / "bundle" / "profile.json")
    assert profile.tp_degrees == (1, 2) and profile.derived_tp == () and profile.context_tokens == 256 + 16
    assert "starting TP 2 (2 ranks" in err and "TP 2 batch 2 (4/4)" in err
    data = json.loads((tmp_path / "bundle" / "profile.json").read_text())
    assert "dls calibrate" in data["notes"] and data["measured_on"].endswith("--prompt-tokens 16")
    shutil.rmtree(model)
