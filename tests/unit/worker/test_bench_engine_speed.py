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
    assert set(figures["tokens_per_s_by_batch"]) == {"engine", "no_cache_loop"}  # engine_sdpa only on CUDA
    assert all(set(by_batch) == {"1", "3"} and min(by_batch.values()) > 0
               for by_batch in figures["tokens_per_s_by_batch"].values())
    assert figures["attention_backend"] == {"engine": "sdpa"}
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
