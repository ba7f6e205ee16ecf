"""The live stack's control-plane time per step, from hand-made request timelines."""

from loadgen.timelines import batch_when_queued, instance_steps, step_gaps


def _timeline(request_id: str, steps: list[tuple[str, float, float]]) -> dict:
    """steps: (instance, start s, duration ms), as GET /v1/requests/{id}/timeline lists them."""
    return {"id": request_id, "steps": [{"instance_id": i, "started_at": s, "duration_ms": d} for i, s, d in steps]}


def test_a_batched_step_is_one_step_of_its_instance():
    timelines = [_timeline("a", [("w0", 10.0, 50.0), ("w0", 10.056, 50.0)]),
                 _timeline("b", [("w0", 10.0, 50.0)])]
    [(start, end, ids, queued), second] = instance_steps(timelines)["w0"]
    assert (start, ids, queued) == (10.0, {"a", "b"}, 0) and abs(end - 10.05) < 1e-9 and second[2] == {"a"}


def test_gaps_count_where_the_instance_had_a_request_waiting_not_idle_time():
    timelines = [
        # "a" steps back to back on w0, 6 ms apart, then waits 2 s for "c" (idle: not a shared request)
        _timeline("a", [("w0", 0.0, 50.0), ("w0", 0.056, 50.0), ("w0", 0.112, 50.0)]),
        _timeline("c", [("w0", 2.0, 50.0)]),
        # "b" moves to w1: steps on two instances are never paired
        _timeline("b", [("w1", 0.0, 40.0), ("w0", 0.2, 50.0)]),
    ]
    gaps = step_gaps(timelines)
    assert gaps["num_gaps"] == 2
    assert abs(gaps["mean_ms"] - 6.0) < 1e-6 and abs(gaps["p50_ms"] - 6.0) < 1e-6
    assert abs(gaps["mean_forward_ms"] - 48.333) < 1e-2  # six steps: five of 50 ms, one of 40


def test_no_consecutive_steps_no_figure():
    assert step_gaps([_timeline("a", [("w0", 0.0, 50.0)])])["mean_ms"] is None
    assert step_gaps([])["num_gaps"] == 0


def _arrived(request_id: str, arrival: float, steps: list[tuple[str, float, float]]) -> dict:
    """A timeline whose request arrived at ``arrival`` (its steps' start_ms count from there)."""
    timeline = _timeline(request_id, steps)
    for step in timeline["steps"]:
        step["start_ms"] = (step["started_at"] - arrival) * 1000.0
    return timeline


def test_the_batch_is_counted_only_for_steps_that_start_while_another_request_waits():
    timelines = [
        _arrived("a", 0.0, [("w0", 0.0, 50.0), ("w0", 0.1, 50.0), ("w0", 0.3, 50.0)]),
        _arrived("b", 0.0, [("w0", 0.0, 50.0), ("w0", 0.1, 50.0)]),
        # "c" arrives at 0.05 and waits until 0.3: the step at 0.1 (a, b) ran while it waited
        _arrived("c", 0.05, [("w0", 0.3, 50.0)]),
    ]
    # the first step started before "c" arrived; the last one is its own first step
    assert batch_when_queued(timelines) == {"num_steps": 1, "mean_batch": 2.0,
                                            "mean_first_step_wait_s": round(0.25 / 3, 3),  # only "c" waited
                                            "deep_queue": {"num_steps": 0, "mean_batch": None}}
    nobody = batch_when_queued(timelines[:2])
    assert (nobody["num_steps"], nobody["mean_batch"], nobody["mean_first_step_wait_s"]) == (0, None, 0.0)


def test_a_deep_queue_is_what_the_scheduler_had_queued_when_it_composed_the_step():
    """Not every wait is a queue: "c" waits for w1's step while w0 starts one without it (light load);
    only the step composed while "d" sat in the scheduler's queue, placed nowhere, counts as under a
    deep queue (the step records' ``queued``)."""
    timelines = [
        _arrived("a", 0.0, [("w0", 0.0, 50.0), ("w0", 0.1, 50.0)]),
        _arrived("b", 0.0, [("w1", 0.0, 80.0), ("w1", 0.2, 80.0)]),
        _arrived("c", 0.05, [("w1", 0.2, 80.0)]),
        _arrived("d", 0.15, [("w0", 0.4, 50.0)]),
    ]
    timelines[0]["steps"][1]["queued"] = 0  # w0 at 0.1, while "c" waited for w1: not a queue
    timelines[1]["steps"][1]["queued"] = timelines[2]["steps"][0]["queued"] = 1  # w1 at 0.2, "d" queued
    report = batch_when_queued(timelines)
    assert report["num_steps"] == 2 and report["deep_queue"] == {"num_steps": 1, "mean_batch": 2.0}
