"""The live stack's control-plane time per step, from hand-made request timelines."""

from loadgen.timelines import instance_steps, step_gaps


def _timeline(request_id: str, steps: list[tuple[str, float, float]]) -> dict:
    """steps: (instance, start s, duration ms), as GET /v1/requests/{id}/timeline lists them."""
    return {"id": request_id, "steps": [{"instance_id": i, "started_at": s, "duration_ms": d} for i, s, d in steps]}


def test_a_batched_step_is_one_step_of_its_instance():
    timelines = [_timeline("a", [("w0", 10.0, 50.0), ("w0", 10.056, 50.0)]),
                 _timeline("b", [("w0", 10.0, 50.0)])]
    [(start, end, ids), second] = instance_steps(timelines)["w0"]
    assert (start, ids) == (10.0, {"a", "b"}) and abs(end - 10.05) < 1e-9 and second[2] == {"a"}


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
