"""What makes `dls calibrate` resumable (a stage is done when its key and artefact are there; what changed
is said), its progress lines, the profile's batch sizes, and traces of prompts at every threshold."""

import io
from pathlib import Path

import pytest

from calibrate.bundle import Bundle, key_changes, read_json, write_json
from calibrate.progress import Progress
from services.worker.profiling import Curves, batch_sizes, measure_batches

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "models" / "dls-tiny"


def test_a_stage_is_done_only_with_the_same_key_and_its_artefact(tmp_path):
    bundle = Bundle(tmp_path / "b")
    assert bundle.check_writable() is None
    key = {"weights": "w1", "--max-batch": 8}
    assert bundle.status("profile", key, bundle.path("profile.json")) == (False, [])
    bundle.finish("profile", key, {"max_batch": 8}, {"device": "cpu"}, 1.23)
    assert bundle.status("profile", key, bundle.path("profile.json")) == (False, [])  # no artefact yet
    write_json(bundle.path("profile.json"), {})
    assert bundle.status("profile", key, bundle.path("profile.json")) == (True, [])
    done, changes = bundle.status("profile", {**key, "--max-batch": 16}, bundle.path("profile.json"))
    assert not done and changes == ["--max-batch: 8 -> 16"]
    assert bundle.record("profile")["elapsed_s"] == 1.2
    bundle.forget("profile")
    assert bundle.record("profile") is None


def test_key_changes_name_every_difference():
    assert key_changes(None, {"a": 1}) == []
    assert key_changes({"a": 1, "b": [1, 2], "gone": 3}, {"a": 1, "b": [1, 3]}) == ["b: [1, 2] -> [1, 3]",
                                                                                     "gone: 3 -> null"]


def test_json_is_written_atomically_and_a_torn_file_reads_as_missing(tmp_path):
    path = write_json(tmp_path / "w" / "x.json", {"a": 1})
    assert read_json(path) == {"a": 1} and not list(path.parent.glob("*.tmp"))
    path.write_text('{"a": ')
    assert read_json(path) is None


def test_the_manifest_goes_first_and_the_predictor_is_swapped_whole(tmp_path):
    bundle = Bundle(tmp_path)
    bundle.check_writable()
    assert not bundle.remove_manifest()
    bundle.path("manifest.json").write_text("{}")
    assert bundle.remove_manifest() and not bundle.path("manifest.json").exists()
    for version in ("old", "new"):
        made = bundle.work_path("predictor.new")
        (made / "oneshot").mkdir(parents=True)
        (made / "model.txt").write_text(version)
        bundle.replace_predictor(made)
    assert bundle.path("predictor/model.txt").read_text() == "new" and not made.exists()
    assert not bundle.work_path("predictor.old").exists()


def test_progress_is_rate_limited_per_task_and_always_says_the_last():
    now = [0.0]
    err = io.StringIO()
    progress = Progress(out=io.StringIO(), err=err, clock=lambda: now[0], every_s=2.0)
    for done in range(1, 11):
        now[0] += 0.5
        progress.count("traces", done, 10, "requests", since=0.0)
    lines = err.getvalue().splitlines()
    assert lines == ["[    0.5s] traces: 1/10 requests, 0.5 s", "[    2.5s] traces: 5/10 requests, 2.5 s",
                     "[    4.5s] traces: 9/10 requests, 4.5 s", "[    5.0s] traces: 10/10 requests, 5.0 s"]


def test_batch_sizes_double_up_to_the_largest():
    assert batch_sizes(1) == [1] and batch_sizes(16) == [1, 2, 4, 8, 16] and batch_sizes(24) == [1, 2, 4, 8, 16, 24]
    with pytest.raises(ValueError):
        batch_sizes(0)


class _RunsOutAt:
    """An engine whose step runs out of device memory from ``batch`` requests on."""

    def __init__(self, engine, batch: int) -> None:
        self.engine, self.batch = engine, batch

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self, batch):
        if len(batch) >= self.batch:
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.engine.step(batch)


def test_the_largest_batch_is_bounded_by_memory_and_measured_batches_are_kept():
    from services.worker.engine.engine import DLMEngine

    engine = DLMEngine.from_pretrained(MODEL)
    seen = []
    curves = measure_batches(_RunsOutAt(engine, 4), [1, 2, 4, 8], 40, repeats=1,
                             on_batch=lambda b, c: seen.append(b))
    assert curves.bounded_by_memory == 4 and curves.batches == [1, 2] and seen == [1, 2]
    assert engine.kv_memory().used_bytes == 0  # the requests of the batch that failed are dropped
    resumed = measure_batches(engine, [1, 2, 4], 40, repeats=1, curves=Curves({k: dict(v) for k, v in curves.ms.items()}),
                              on_batch=lambda b, c: seen.append(b))
    assert seen == [1, 2, 4] and resumed.batches == [1, 2, 4] and resumed.ms["cache_ms"]["1"] == curves.ms["cache_ms"]["1"]


def test_prompts_are_traced_at_every_threshold_with_switches():
    from services.predictor.traces import CollectConfig, TracePrompt, collect_traces
    from services.worker.engine.engine import DLMEngine

    engine = DLMEngine.from_pretrained(MODEL)
    prompts = [TracePrompt(tuple(engine.encode(text)), "completion", 0, gen) for text, gen in
               (("347+589=", None), ("@a=", 16), ("12+7=", None))]
    for switch_fraction in (0.0, 1.0):
        config = CollectConfig((0.6, 0.9), switch_fraction, batch_size=8, every_threshold=True)
        rows = collect_traces(engine, prompts, seed=3, config=config)
        by_request = {}
        for row in rows:
            by_request.setdefault(row["request_id"], []).append(row)
        assert len(by_request) == 6  # 3 prompts x 2 thresholds
        assert {r["family"] for r in rows} == {"completion"}
        assert {r["output_length"] for r in rows if r["request_id"] in ("s3-r2", "s3-r3")} == {16.0}  # its own canvas
        if switch_fraction == 0:  # each prompt once at each threshold, from its first step
            assert sorted(r[0]["threshold"] for r in by_request.values()) == [0.6, 0.6, 0.6, 0.9, 0.9, 0.9]
        else:  # every request runs its first steps at the other threshold: rows after a switch say so
            assert any(r["switched"] == 1 for r in rows)
