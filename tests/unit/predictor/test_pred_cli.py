"""`dls collect-traces`, `dls train-predictor` and `python -m bench.predictor` end to end."""

import json
from pathlib import Path

import pytest

from bench import predictor as bench_predictor
from services.cli import main
from services.predictor.core.model import StepModel
from services.predictor.traces import COLUMNS, read_traces, write_traces
from shared.features import FEATURE_NAMES
from shared.tasks import Split
from tests.unit.predictor.pred_builders import fake_rows

REPO_ROOT = Path(__file__).resolve().parents[3]
BUNDLED_MODEL = REPO_ROOT / "models" / "dls-tiny"


def _fail(capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "problem"),
    [("", "file is empty"), (",".join(COLUMNS) + "\n", "no trace rows"), ("s1-r0,1,add\n", "missing columns")],
)
def test_training_on_an_unusable_file_names_file_and_problem(tmp_path, capsys, content, problem):
    bad = tmp_path / "traces.csv"
    bad.write_text(content)
    err = _fail(capsys, ["train-predictor", "--traces", str(bad), "--eval", "", "--out", str(tmp_path / "m")])
    assert f"dls: error: {bad}:" in err and problem in err
    assert not (tmp_path / "m").exists()


def test_training_with_a_corrupt_eval_file_fails_too(tmp_path, capsys):
    train = write_traces(tmp_path / "train.csv", fake_rows(20))
    bad = tmp_path / "heldout.csv"
    bad.write_text(train.read_text().replace(",add,", ",add,x,", 1).replace(",words,", ",words,x,", 1))
    err = _fail(capsys, ["train-predictor", "--traces", str(train), "--eval", str(bad), "--out", str(tmp_path / "m")])
    assert f"{bad}: line" in err


def test_train_predictor_writes_model_card_and_one_shot_model(tmp_path, capsys):
    train = write_traces(tmp_path / "train.csv", fake_rows(60))
    heldout = write_traces(tmp_path / "heldout.csv", fake_rows(20, seed=8, split=Split.HELD_OUT))
    out = tmp_path / "predictor"
    assert main(["train-predictor", "--traces", str(train), "--eval", str(heldout), "--out", str(out),
                 "--max-requests", "50", "--rounds", "20"]) == 0
    model = StepModel.load(out)
    assert model.card["training"]["num_requests"] == 50
    assert model.card["features"] == list(model.feature_names) and len(model.feature_names) == len(FEATURE_NAMES)
    assert set(model.card["error"]["by_threshold"]) and model.card["error"]["overall"]["num_rows"] > 0
    assert StepModel.load(out / "oneshot").feature_set == "arrival"


def test_bench_json_has_the_summary_keys(tmp_path, capsys):
    traces_dir = tmp_path / "traces"
    write_traces(traces_dir / "train.csv", fake_rows(120))
    write_traces(traces_dir / "heldout.csv", fake_rows(40, seed=8, split=Split.HELD_OUT))
    out = tmp_path / "bench.json"
    assert bench_predictor.main(["--json", str(out), "--quick", "--traces-dir", str(traces_dir),
                                 "--model", str(tmp_path / "no-model"), "--repeats", "2"]) == 0
    result = json.loads(out.read_text())
    assert set(result["relative_error"]) == {"one_shot", "progress", "progress_confidence"}
    assert result["per_row_cost_ratio"] > 0
    assert {"chosen", "relative_error_vs_per_step", "cost_saved"} <= set(result["granularity"])
    assert set(result["latency"]) == {"1", "64", "1024", "all_thresholds"}
    assert "error" in result["committed_model"]


@pytest.mark.skipif(not (BUNDLED_MODEL / "config.json").exists(), reason="bundled model not exported yet")
def test_collect_traces_with_the_real_engine(tmp_path):
    assert main(["collect-traces", "--model", str(BUNDLED_MODEL), "--out-dir", str(tmp_path),
                 "--train-requests", "6", "--heldout-requests", "4", "--batch-size", "4"]) == 0
    train, heldout = read_traces(tmp_path / "train.csv"), read_traces(tmp_path / "heldout.csv")
    assert train.num_requests <= 6 and heldout.num_requests <= 4  # a request may have switched late
    assert train.seeds == (1,) and heldout.seeds == (1001,)
    manifest = json.loads((tmp_path / "train.csv.json").read_text())
    assert manifest["engine_model"] == str(BUNDLED_MODEL) and manifest["seed"] == 1
    assert (train.remaining_recompute <= train.remaining_steps).all()
    assert (train.remaining_recompute[train.steps == 0] >= 1).all()  # dual cache: the first step recomputes


def test_card_records_the_collection_manifest(tmp_path):
    train = write_traces(tmp_path / "train.csv", fake_rows(40))
    (tmp_path / "train.csv.json").write_text(json.dumps({"engine_model": "models/x", "engine_model_steps_done": 7}))
    out = tmp_path / "predictor"
    assert main(["train-predictor", "--traces", str(train), "--eval", "", "--out", str(out), "--rounds", "10"]) == 0
    assert StepModel.load(out).card["training"]["collection"]["engine_model_steps_done"] == 7
