"""``shared.request_traces``: the BurstGPT, Azure and Mooncake layouts, errors that name the line, and
replay at a target rate that keeps the trace's shape."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shared.request_traces import TraceError, TraceRow, native_rate, read_trace

DATA = Path(__file__).resolve().parents[1] / "data"
AZURE = DATA / "AzureLLMInferenceTrace_conv_first10min.csv"
BURSTGPT = DATA / "burstgpt_sample.csv"


def _write(tmp_path, name: str, lines: list[str]) -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_azure_slice_is_read_with_sub_second_timestamps():
    trace = read_trace(AZURE)
    assert trace.layout == "azure" and len(trace.rows) == 2867
    assert trace.rows[:2] == (TraceRow(0.0, 374, 44), TraceRow(pytest.approx(4.314579, abs=1e-6), 396, 109))
    assert trace.rows[-1].arrival_s == pytest.approx(599.971336, abs=1e-6)  # 18:25:46.6519260 - 18:15:46.6805900
    assert native_rate(trace.rows) == pytest.approx(2866 / 599.971336)


def test_mooncake_jsonl_milliseconds_and_extra_keys(tmp_path):
    path = _write(tmp_path, "conv.jsonl", [
        json.dumps({"timestamp": 1500, "input_length": 600, "output_length": 20, "hash_ids": [1, 2]}),
        json.dumps({"timestamp": 0, "input_length": 300, "output_length": 10, "hash_ids": [1]}),
        "",
        json.dumps({"timestamp": 4000, "input_length": 90, "output_length": 0, "hash_ids": []}),
    ])
    trace = read_trace(path)
    assert trace.layout == "mooncake"
    assert trace.rows == (TraceRow(0.0, 300, 10), TraceRow(1.5, 600, 20))  # sorted; 0 output tokens dropped
    assert len(read_trace(path, keep_failures=True).rows) == 3


def test_burstgpt_model_filter_is_burstgpt_only():
    assert [r.arrival_s for r in read_trace(BURSTGPT, models=("GPT-4",)).rows] == [0.0, 10.0, 21.0]
    with pytest.raises(TraceError, match="azure layout has no Model column"):
        read_trace(AZURE, models=("GPT-4",))


@pytest.mark.parametrize("name,lines,message", [
    ("azure.csv", ["TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.68,374,44",
                   "2023-11-16 18:15:4x,396,109"], r"azure\.csv:3: TIMESTAMP: expected 'YYYY-MM-DD HH:MM:SS"),
    ("azure2.csv", ["TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.68,374,44",
                    "2023-11-16 18:15:47.1,3.5,109"], r"azure2\.csv:3: ContextTokens: not a whole number: '3\.5'"),
    ("azure3.csv", ["TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.68,374"],
     r"azure3\.csv:2: expected 3 fields"),
    ("burst.csv", ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
                   "5,ChatGPT,472,18,490,Conversation log", "nine,ChatGPT,1,2,3,API log"],
     r"burst\.csv:3: Timestamp: not a number: 'nine'"),
    ("burst2.csv", ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
                    "5,ChatGPT,472,-18,454,Conversation log"], r"burst2\.csv:2: Response tokens: negative"),
    ("moon.jsonl", ['{"timestamp": 0, "input_length": 3, "output_length": 4}', '{"timestamp": 5, "input_length": 3'],
     r"moon\.jsonl:2: not a JSON object"),
    ("moon2.jsonl", ['{"timestamp": 0, "input_length": 3, "output_length": 4}', '{"timestamp": 5, "input_length": 3}'],
     r"moon2\.jsonl:2: missing key\(s\) output_length"),
    ("moon3.jsonl", ['{"timestamp": "soon", "input_length": 3, "output_length": 4}'],
     r"moon3\.jsonl:1: timestamp: not a number: 'soon'"),
    ("other.csv", ["time,prompt,output", "1,2,3"], r"other\.csv:1: unknown trace layout"),
])
def test_malformed_rows_name_the_file_line_and_field(tmp_path, name, lines, message):
    with pytest.raises(TraceError, match=message):
        read_trace(_write(tmp_path, name, lines))


def test_missing_file_and_no_rows(tmp_path):
    with pytest.raises(TraceError, match="not found"):
        read_trace(tmp_path / "missing.csv")
    with pytest.raises(TraceError, match="no successful requests"):
        read_trace(_write(tmp_path, "empty.csv", ["TIMESTAMP,ContextTokens,GeneratedTokens"]))


def test_replay_at_a_target_rate_keeps_the_shape():
    trace = read_trace(AZURE)
    slow, fast = trace.replay(rate_rps=5.0), trace.replay(rate_rps=20.0)
    for replay, rate in ((slow, 5.0), (fast, 20.0)):
        times = np.array(replay.times)
        assert (len(times) - 1) / (times[-1] - times[0]) == pytest.approx(rate)  # the mean rate asked for
        assert replay.rate_rps == pytest.approx(rate) and replay.native_rps == pytest.approx(native_rate(trace.rows))
    assert fast.scale == pytest.approx(4 * slow.scale)
    native = np.array([r.arrival_s for r in trace.rows])
    assert np.allclose(np.array(fast.times) * fast.scale, native)  # every gap shrinks by the same factor
    assert fast.rows == trace.rows


def test_replay_windows_and_explicit_time_scale():
    trace = read_trace(BURSTGPT)  # successful rows at 0, 4, 9, 14, 16, 25, 28, 31 s
    assert trace.replay(time_scale=4.0).times == (0.0, 1.0, 2.25, 3.5, 4.0, 6.25, 7.0, 7.75)
    assert trace.replay(time_scale=1.0, duration_s=15.0).times == (0.0, 4.0, 9.0, 14.0)
    first4 = trace.replay(rate_rps=1.0, num_requests=4)
    assert first4.native_rps == pytest.approx(3 / 14) and first4.times[-1] == pytest.approx(3.0)
    by_duration = trace.replay(rate_rps=2.0, duration_s=2.0)  # 4 rows span 1.5 s at 2 req/s; 5 would span 2 s
    assert len(by_duration.times) == 4 and by_duration.times[-1] < 2.0
    with pytest.raises(TraceError, match="at least two requests"):
        trace.replay(rate_rps=1.0, num_requests=1)
    with pytest.raises(TraceError, match="one of them"):
        trace.replay(rate_rps=1.0, time_scale=2.0)
