import json

import pytest

from services.cli import build_parser
from sim import cli


def _run(argv):
    args = build_parser().parse_args(argv)
    return args.func(args)


def test_unknown_preset_names_the_field():
    with pytest.raises(cli.CliError, match="--preset: unknown preset 'nope'"):
        _run(["sim", "--preset", "nope"])


def test_unknown_policy_names_the_field():
    with pytest.raises(cli.CliError, match="--policies: unknown policy 'fifo'"):
        _run(["compare", "--preset", "tiny", "--policies", "dilaserve,fifo"])


def test_multi_model_compare_names_what_it_refuses():
    with pytest.raises(cli.CliError, match="--policies: 'nope' is not one of dilaserve"):
        _run(["compare", "--preset", "multi-model", "--quick", "--policies", "dilaserve,nope"])
    with pytest.raises(cli.CliError, match="--switch-s: must be >= 0"):
        _run(["compare", "--preset", "multi-model", "--quick", "--switch-s", "-1"])
    with pytest.raises(cli.CliError, match="--trace: not supported by the multi-model preset"):
        _run(["compare", "--preset", "multi-model", "--trace", "x.csv"])
    with pytest.raises(cli.CliError, match="--switch-s: only a multi-model preset"):
        _run(["compare", "--preset", "tiny", "--switch-s", "2"])


def test_bad_target_and_missing_trace():
    with pytest.raises(cli.CliError, match="--target"):
        _run(["capacity", "--preset", "tiny", "--target", "1.5"])
    with pytest.raises(cli.CliError, match="--trace: file not found"):
        _run(["sim", "--preset", "tiny", "--trace", "/nonexistent.csv"])


def _bursty_trace(path):
    """40 requests: two bursts of 0.2 s gaps around a 10 s quiet spell (native rate 39 / 17.6 s)."""
    gaps = [0.2] * 19 + [10.0] + [0.2] * 19
    times = [0.0]
    for gap in gaps:
        times.append(times[-1] + gap)
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    + "".join(f"{t:.3f},ChatGPT,140,264,404,API log\n" for t in times))
    return times


def test_compare_replays_a_trace_at_each_points_rate(tmp_path, monkeypatch):
    from sim import experiments
    from tests.unit.sim.sim_builders import make_trace

    monkeypatch.setattr(experiments, "calibrate", lambda *args, **kwargs: make_trace())
    times = _bursty_trace(tmp_path / "trace.csv")
    out = tmp_path / "out.json"
    _run(["compare", "--preset", "tiny", "--quick", "--trace", str(tmp_path / "trace.csv"), "--policies", "dilaserve",
          "--prediction", "fallback", "--json", str(out)])
    result = json.loads(out.read_text())
    capacity = result["setup"]["nominal_capacity_rps"]
    assert result["setup"]["trace"]["layout"] == "burstgpt" and result["setup"]["trace"]["num_requests"] == 40
    points = result["policies"]["dilaserve"]["points"]
    assert [p["rate_mult"] for p in points] == [1.0, 2.0]
    native = 39 / times[-1]
    for p in points:
        assert p["rps"] == pytest.approx(p["rate_mult"] * capacity, rel=1e-3)  # the point's rate was replayed
        assert p["trace_native_rps"] == pytest.approx(native, rel=1e-3)
        assert p["scale"] == pytest.approx(p["rps"] / native, rel=1e-3)
        assert 39 / p["duration_s"] == pytest.approx(p["rps"], rel=1e-3)  # last arrival: 39 gaps at that rate
        assert p["num_requests"] == 40
    assert points[1]["rps"] == pytest.approx(2 * points[0]["rps"], rel=1e-3)


def test_time_scale_replaces_the_points_rate(tmp_path, monkeypatch):
    from sim import experiments
    from tests.unit.sim.sim_builders import make_trace

    monkeypatch.setattr(experiments, "calibrate", lambda *args, **kwargs: make_trace())
    times = _bursty_trace(tmp_path / "trace.csv")
    out = tmp_path / "out.json"
    _run(["compare", "--preset", "tiny", "--quick", "--trace", str(tmp_path / "trace.csv"), "--time-scale", "4",
          "--policies", "dilaserve", "--prediction", "fallback", "--json", str(out)])
    (point,) = json.loads(out.read_text())["policies"]["dilaserve"]["points"]
    assert point["label"] == "time-scale 4" and point["scale"] == 4.0
    assert point["rps"] == pytest.approx(4 * 39 / times[-1], rel=1e-3)
    with pytest.raises(cli.CliError, match="--time-scale: scales a --trace"):
        _run(["sim", "--preset", "tiny", "--time-scale", "4"])


def test_generated_arrivals_record_no_trace(tmp_path, monkeypatch):
    from sim import experiments
    from tests.unit.sim.sim_builders import make_trace

    monkeypatch.setattr(experiments, "calibrate", lambda *args, **kwargs: make_trace())
    out = tmp_path / "out.json"
    _run(["sim", "--preset", "tiny", "--quick", "--policy", "dilaserve", "--prediction", "fallback", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["setup"]["trace"] is None
    assert all(p["trace_native_rps"] is None and p["scale"] is None for p in result["policies"]["dilaserve"]["points"])


@pytest.mark.parametrize(("flags", "pipelining", "overlap"), [
    ([], True, True), (["--no-pipelining"], False, True), (["--no-overlap"], False, False),
])
def test_compare_models_pipelining_and_overlap_as_live_with_switches(tmp_path, monkeypatch, flags, pipelining,
                                                                   overlap):
    from sim import experiments
    from tests.unit.sim.sim_builders import make_trace

    monkeypatch.setattr(experiments, "calibrate", lambda *args, **kwargs: make_trace())
    out = tmp_path / "out.json"
    _run(["compare", "--preset", "tiny", "--quick", "--policies", "dilaserve", "--prediction", "fallback",
          "--json", str(out), *flags])
    result = json.loads(out.read_text())
    assert (result["setup"]["pipelining"], result["setup"]["overlap"]) == (pipelining, overlap)
    points = result["policies"]["dilaserve"]["points"]
    assert all(p["num_finished"] == p["num_requests"] for p in points)
    # 16-token answers: overlap's 32-token minimum never continues a step, pipelining (no minimum) does
    assert (sum(p["pipelined_steps"] for p in points) > 0) == pipelining
    assert all(p["continued_steps"] == p["pipelined_steps"] for p in points)
    assert all(p["repeated_steps"] == 0 for p in points)  # its held commands are never late: no repeat


def test_overlap_continues_steps_before_the_pass_in_the_simulator(tmp_path, monkeypatch):
    from sim import experiments
    from tests.unit.sim.sim_builders import make_trace

    monkeypatch.setattr(experiments, "calibrate", lambda *args, **kwargs: make_trace())
    out = tmp_path / "out.json"
    _run(["compare", "--preset", "tiny", "--quick", "--policies", "dilaserve", "--prediction", "fallback",
          "--json", str(out), "--no-pipelining", "--overlap-min-tokens", "2"])
    result = json.loads(out.read_text())
    assert result["setup"]["overlap_min_tokens"] == 2 and not result["setup"]["pipelining"]
    points = result["policies"]["dilaserve"]["points"]
    assert sum(p["continued_steps"] for p in points) > 0 and all(p["pipelined_steps"] == 0 for p in points)
    assert all(p["num_finished"] == p["num_requests"] for p in points)


def test_a_kv_budget_is_checked_and_compared_with_none(tmp_path, monkeypatch, capsys):
    from sim import experiments
    from tests.unit.sim.sim_builders import make_trace

    with pytest.raises(cli.CliError, match="--kv-budget-mib: must be positive"):
        _run(["compare", "--preset", "tiny", "--kv-budget-mib", "0"])
    with pytest.raises(cli.CliError, match="--kv-budget-mib: .* holds no token"):
        _run(["compare", "--preset", "tiny", "--kv-budget-mib", "0.1"])
    monkeypatch.setattr(experiments, "calibrate", lambda *args, **kwargs: make_trace())
    out = tmp_path / "out.json"
    _run(["compare", "--preset", "tiny", "--quick", "--policies", "dilaserve", "--prediction", "fallback",
          "--no-fidelity", "--kv-budget-mib", "64", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["setup"]["kv_budget"]["tokens_by_tp"]["1"] == 128  # 64 MiB / 512 KiB per token
    assert result["setup"]["kv_budget"]["tokens_by_tp"]["2"] == 256
    assert set(result["policies"]) == {"dilaserve", "dilaserve (no KV budget)"}
    bound, free = (result["policies"][k]["points"] for k in ("dilaserve", "dilaserve (no KV budget)"))
    assert all("num_preemptions" in p for p in bound + free)
    assert "preempt" in capsys.readouterr().out
