"""bench.engine --arch: the speed benchmark's figures (their presence and the KV traffic, not timings)."""

import json

from bench import engine
from shared.profiles import LatencyProfile


def test_speed_bench_reports_tokens_per_s_and_kv_bytes(tmp_path, capsys):
    out = tmp_path / "speed.json"
    profile = tmp_path / "profiles" / "tiny-measured.json"
    argv = ["--arch", "llada-tiny", "--device", "cpu", "--gen-length", "32", "--block-length", "8",
            "--batches", "1,3", "--loop-steps", "2", "--json", str(out),
            "--profile", str(profile), "--profile-batches", "1,2", "--profile-repeats", "1"]
    assert engine.main(argv) == 0
    figures = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == figures
    assert set(figures["tokens_per_s_by_batch"]) == {"engine", "no_cache_loop"}  # engine_eager only on CUDA
    assert figures["lm_head_scale"] == 1.0 and "floor_ms_by_batch" not in figures  # both off by default here
    assert all(set(by_batch) == {"1", "3"} and min(by_batch.values()) > 0
               for by_batch in figures["tokens_per_s_by_batch"].values())
    assert figures["attention_backend"] == {"engine": "sdpa"}
    # the engine's host work outside the runner, timed in the same runs
    bookkeeping = figures["engine_bookkeeping_ms_per_step_by_batch"]
    assert set(bookkeeping) == {"1", "3"} and min(bookkeeping.values()) > 0
    # the cache is read in place: cache steps copy nothing and write their blocks only
    per_token = figures["kv_bytes_per_token"]
    assert figures["kv_bytes_batch"] == 3
    assert figures["kv_bytes_copied_per_cache_step"] == 0
    assert figures["kv_bytes_written_per_cache_step"] == 3 * 8 * per_token
    assert figures["kv_bytes_by_batch"]["3"]["gathered_before"] == 3 * (16 + 32 - 8) * per_token
    # the step latencies, as a profile the scheduler and the simulator load
    loaded = LatencyProfile.load(profile)
    assert loaded.measured and loaded.model == "llada-tiny" and loaded.context_tokens == 16 + 32
    assert set(json.loads(profile.read_text())["tp"]["1"]) == {"recompute_ms", "cache_ms", "full_ms"}


def test_the_floor_and_the_calibrated_head_are_reported(tmp_path):
    out = tmp_path / "speed.json"
    argv = ["--arch", "llada-tiny", "--device", "cpu", "--gen-length", "32", "--block-length", "8",
            "--batches", "1,2", "--loop-steps", "2", "--json", str(out), "--tokens-per-step", "3",
            "--calibration-rounds", "4", "--floor", "--floor-batches", "1,2", "--floor-repeats", "2",
            "--profile-repeats", "1"]
    assert engine.main(argv) == 0
    figures = json.loads(out.read_text())
    assert figures["lm_head_scale"] > 1.0  # random weights commit one token per step; the head was scaled
    assert max(figures["tokens_per_step_by_batch"]["engine"].values()) > 1.0
    assert set(figures["floor_ms_by_batch"]) == set(figures["engine_cache_step_ms_by_batch"]) == {"1", "2"}
    assert not figures["floor_graph"]  # a CPU: the floor ran eagerly
    assert all(ratio > 0 for ratio in figures["engine_over_floor"].values())


def test_the_runner_clock_times_the_forward_and_gives_the_method_back():
    from bench.engine_speed import ARCHS, _RunnerClock, random_model, random_prompts
    from services.worker.engine.engine import DLMEngine

    model = random_model(ARCHS["llada-tiny"], "cpu", 0)
    eng = DLMEngine(model, stop_at_eos=False)
    state = eng.new_request("r", random_prompts(model.config, 1, 8, 0)[0], 16, 8)
    with _RunnerClock(eng) as clock:
        eng.step([(state, 0.9)])
        assert clock.seconds > 0
    assert "forward" not in vars(eng.runner)  # the class's forward again
    eng.step([(state, 0.9)])
