import numpy as np
import pytest

from shared.tasks import Family
from sim.workload import TraceError, WorkloadConfig, generate, read_burstgpt


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
    rows = read_burstgpt(path)
    assert [r[0] for r in rows] == [0, 4, 6, 8]  # the failed request (0 response tokens) is dropped
    config = WorkloadConfig(arrival="burstgpt", trace_path=str(path), time_scale=2.0, lengths="sharegpt-like")
    requests = generate(config, 1.0, 0.1).requests
    assert [r.arrival_s for r in requests] == [0, 2, 3, 4]
    assert [r.nominal_prompt_tokens for r in requests] == [10, 12, 13, 14]


def test_burstgpt_errors_name_the_problem(tmp_path):
    with pytest.raises(TraceError, match="not found"):
        read_burstgpt(tmp_path / "missing.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("Time,Model\n1,x\n")
    with pytest.raises(TraceError, match="Request tokens"):
        read_burstgpt(bad)
