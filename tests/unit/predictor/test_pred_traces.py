"""Trace collection labels, the CSV round trip, and the errors for unusable files."""

import math
from pathlib import Path

import numpy as np
import pytest

import services.predictor.core.predictor as predictor_module
from services.predictor.core.predictor import PredictionQuery
from services.predictor.traces import COLUMNS, TraceError, read_traces, write_traces
from shared import features
from shared.features import FEATURE_NAMES
from tests.unit.predictor.pred_builders import fake_rows, fake_traces


def test_labels_count_the_steps_that_followed():
    rows = fake_rows(30, switch_fraction=0.0)
    by_request: dict[str, list[dict]] = {}
    for row in rows:
        by_request.setdefault(row["request_id"], []).append(row)
    for request_rows in by_request.values():
        total = request_rows[0]["remaining_steps"]
        assert request_rows[0]["step"] == 0  # no switch: the arrival row is there
        assert [r["step"] for r in request_rows] == list(range(total))
        assert [r["remaining_steps"] for r in request_rows] == list(range(total, 0, -1))
        for r in request_rows:
            assert r["remaining_recompute"] + r["remaining_cache"] == r["remaining_steps"]
        # dual cache, gen 16, block 8: one recompute step per block still to start
        assert request_rows[0]["remaining_recompute"] == 2


def test_rows_only_where_the_threshold_stays_constant():
    rows = fake_rows(40, switch_fraction=1.0)
    switched = [r for r in rows if r["switched"]]
    assert switched, "some requests should switch before they finish"
    requests_with_switch = {r["request_id"] for r in switched}
    for request_id in requests_with_switch:
        first = next(r for r in rows if r["request_id"] == request_id)
        assert first["previous_threshold"] != first["threshold"]  # the first row right after the switch
    assert all(r["step"] > 0 for r in rows if r["request_id"] in requests_with_switch)


def test_round_trip(tmp_path):
    rows = fake_rows(20)
    traces = read_traces(write_traces(tmp_path / "t.csv", rows))
    assert len(traces) == len(rows)
    assert traces.num_requests == 20
    assert traces.seeds == (3,)
    expected = np.array([[r[name] for name in FEATURE_NAMES] for r in rows], dtype=float)
    np.testing.assert_array_equal(np.isnan(traces.features), np.isnan(expected))
    np.testing.assert_allclose(np.nan_to_num(traces.features), np.nan_to_num(expected))
    assert traces.first_requests(5).num_requests == 5


def test_trainer_rows_come_from_the_shared_feature_function(tmp_path, monkeypatch):
    """Collection (whose rows the trainer reads) and the online predictor build rows with one function."""
    produced = set()
    real = features.step_features

    def spy(*args, **kwargs):
        row = real(*args, **kwargs)
        produced.add(tuple(np.nan_to_num(row, nan=-1.0)))
        return row

    monkeypatch.setattr(predictor_module, "step_features", spy)
    traces = fake_traces(tmp_path, num_requests=10)
    # every row the trainer reads is one the shared function produced
    assert all(tuple(np.nan_to_num(row, nan=-1.0)) in produced for row in traces.features)
    query = PredictionQuery("q", 2, 16, 30, 8, 5, 5, 8, (0.1, 0.2, 0.3, 0.3, 0.4))
    assert query.features(0.7) == real(0.7, 16, 30, 8, 5, 5, (0.1, 0.2, 0.3, 0.3, 0.4), 8)


def _write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("", "file is empty"),
        (",".join(COLUMNS) + "\n", "no trace rows"),
        ("a,b,c\n1,2,3\n", "missing columns"),
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe garbage", "not a text CSV"),
    ],
)
def test_unusable_files_name_the_file_and_problem(tmp_path, content, problem):
    path = _write(tmp_path / "bad.csv", content)
    with pytest.raises(TraceError) as info:
        read_traces(path)
    assert str(path) in str(info.value)
    assert problem in str(info.value)


def test_corrupt_row_names_the_line(tmp_path):
    good = write_traces(tmp_path / "good.csv", fake_rows(5))
    lines = good.read_text().splitlines()
    lines[3] = lines[3].replace(lines[3].split(",")[8], "0.x", 1)  # the threshold column
    path = _write(tmp_path / "bad.csv", "\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=r"bad\.csv: line 4: column threshold: not a number"):
        read_traces(path)
    truncated = _write(tmp_path / "cut.csv", "\n".join(good.read_text().splitlines()[:3]) + "\ns3-r0,3,wor\n")
    with pytest.raises(TraceError, match=r"cut\.csv: line 4: expected \d+ fields"):
        read_traces(truncated)


def test_inconsistent_labels_are_rejected(tmp_path):
    rows = fake_rows(3)
    rows[0] = {**rows[0], "remaining_cache": rows[0]["remaining_cache"] + 1}
    path = write_traces(tmp_path / "t.csv", rows)
    with pytest.raises(TraceError, match="remaining_recompute \\+ remaining_cache"):
        read_traces(path)


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="no such trace file"):
        read_traces(tmp_path / "nope.csv")


def test_nan_only_where_allowed(tmp_path):
    rows = fake_rows(3)
    rows[1] = {**rows[1], "prompt_length": math.nan}
    with pytest.raises(TraceError, match="column prompt_length: missing"):
        read_traces(write_traces(tmp_path / "t.csv", rows))
