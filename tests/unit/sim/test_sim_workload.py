import numpy as np
import pytest

from shared.request_traces import TraceError, read_trace
from shared.tasks import Family
from sim.workload import WorkloadConfig, generate


def test_poisson_rate_and_determinism():
    config = WorkloadConfig(num_requests=2000, seed=3)
    a, b = generate(config, 100.0, 0.1), generate(config, 100.0, 0.1)
    times = [r.arrival_s for r in a.requests]
    assert times == [r.arrival_s for r in b.requests]
    assert [r.problem for r in a.requests[:20]] == [r.problem for r in b.requests[:20]]
    assert len(times) == 2000 and np.all(np.diff(times) >= 0)
    assert 90 < 2000 / times[-1] < 110
    assert all(r.slo_s == pytest.approx(0.5) and r.problem.num_shots == 5 for r in a.requests)


def test_gamma_is_burstier_than_poisson():
    def cv(arrival):
        t = [r.arrival_s for r in generate(WorkloadConfig(arrival=arrival, num_requests=3000, cv=3.0), 50.0, 0.1).requests]
        gaps = np.diff(t)
        return gaps.std() / gaps.mean()

    assert cv("gamma") > 2 * cv("poisson")


def test_sharegpt_like_lengths_map_onto_shots_and_blocks():
    config = WorkloadConfig(lengths="sharegpt-like", num_requests=3000)
    requests = generate(config, 50.0, 0.1).requests
    assert 120 < np.mean([r.nominal_prompt_tokens for r in requests]) < 160
    assert 230 < np.mean([r.nominal_output_tokens for r in requests]) < 300
    shots = [r.problem.num_shots for r in requests]
    assert 3.5 < np.mean(shots) < 5.5 and max(shots) <= 8
    assert {r.gen_len for r in requests} <= {8, 16, 24, 32}
    assert all(r.problem.family is Family.ADD for r in requests if r.gen_len == 8)


def test_burstgpt_like_has_quiet_and_peak_minutes():
    config = WorkloadConfig(arrival="burstgpt-like", num_requests=10**6, duration_s=600.0, period_s=600.0)
    times = np.array([r.arrival_s for r in generate(config, 20.0, 0.1).requests])
    per_minute = np.histogram(times, bins=10, range=(0, 600))[0]
    assert per_minute.max() > 5 * per_minute.min()


@pytest.mark.parametrize(
    "header,row",
    [
        ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type", "{t},ChatGPT,{p},{o},0,Conversation log"),
        (
            "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type",
            "{t},s1,3,GPT-4,{p},{o},0,API log",
        ),
    ],
)
def test_burstgpt_both_layouts_and_time_scale(tmp_path, header, row):
    path = tmp_path / "trace.csv"
    lines = [header] + [row.format(t=100 + 2 * i, p=10 + i, o=0 if i == 1 else 20) for i in range(5)]
    path.write_text("\n".join(lines) + "\n")
    rows = read_trace(path).rows
    assert [r[0] for r in rows] == [0, 4, 6, 8]  # the failed request (0 response tokens) is dropped
    config = WorkloadConfig(arrival="trace", trace_path=str(path), time_scale=2.0, lengths="sharegpt-like")
    workload = generate(config, 1.0, 0.1)
    assert [r.arrival_s for r in workload.requests] == [0, 2, 3, 4]
    assert [r.nominal_prompt_tokens for r in workload.requests] == [10, 12, 13, 14]
    # the explicit scale replaces the rate asked for: 3 gaps in 8 trace seconds, twice as fast
    assert workload.trace_native_rps == pytest.approx(3 / 8) and workload.scale == 2.0
    assert workload.rate_rps == pytest.approx(3 / 4)


def test_trace_replayed_at_the_rate_asked_keeps_its_bursts(tmp_path):
    path = tmp_path / "bursty.csv"
    gaps = [0.1] * 10 + [5.0] + [0.1] * 10  # a burst, a quiet spell, a burst
    times = np.concatenate([[0.0], np.cumsum(gaps)])
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    + "".join(f"{t:.3f},ChatGPT,100,200,300,API log\n" for t in times))
    config = WorkloadConfig(arrival="trace", trace_path=str(path), lengths="sharegpt-like")
    slow, fast = generate(config, 2.0, 0.1), generate(config, 8.0, 0.1)
    for workload, rate in ((slow, 2.0), (fast, 8.0)):
        arrivals = np.array([r.arrival_s for r in workload.requests])
        assert len(arrivals) == 22 and (len(arrivals) - 1) / arrivals[-1] == pytest.approx(rate)
        assert workload.rate_rps == pytest.approx(rate) and workload.trace_native_rps == pytest.approx(21 / 7.0)
        assert workload.scale == pytest.approx(rate / 3.0)
        replayed_gaps = np.diff(arrivals)
        assert np.allclose(replayed_gaps / replayed_gaps[0], np.array(gaps) / gaps[0], rtol=1e-3)  # same shape


def test_burstgpt_errors_name_the_problem(tmp_path):
    with pytest.raises(TraceError, match="not found"):
        generate(WorkloadConfig(arrival="trace", trace_path=str(tmp_path / "missing.csv")), 1.0, 0.1)
    bad = tmp_path / "bad.csv"
    bad.write_text("Timestamp,Model\n1,x\n")
    with pytest.raises(TraceError, match="unknown trace layout"):
        generate(WorkloadConfig(arrival="trace", trace_path=str(bad)), 1.0, 0.1)
