"""The dashboard's routes on a fake bus: the pages, /v1/cluster from heartbeats and request events,
and the timeline's canvas frames rebuilt from the stored steps."""

from __future__ import annotations

from services.gateway.dashboard import ClusterMonitor, timeline
from shared.messages.control import WorkerStatus
from shared.state import RequestRecord, RequestStatus, StepKind, StepRecord
from tests.unit.gateway.gateway_builders import MODEL, TOKENIZER, FakeBus, client, heartbeat


def _record(text: str = "42") -> RequestRecord:
    eos = TOKENIZER.eos_token_id
    canvas = TOKENIZER.encode(text) + [eos, eos]
    return RequestRecord(request_id="cmpl-t", status=RequestStatus.FINISHED, prompt_token_ids=TOKENIZER.encode("12+30="),
                         canvas=canvas, mask_token_id=TOKENIZER.mask_token_id, gen_length=4, block_length=4,
                         num_steps=3, num_committed=4, threshold_history=[0.9, 0.7, 0.9], arrival_time=100.0,
                         deadline=101.0, slo_ms=1000.0, instance_history=["w0", "w1"], num_recompute_steps=2,
                         model=MODEL, finish_reason="stop", finished_at=100.5)


def _steps() -> list[StepRecord]:
    return [
        StepRecord(step_index=1, instance_id="w0", kind=StepKind.RECOMPUTE, block_index=0, threshold=0.9,
                   committed_positions=[1], started_at=100.1, duration_s=0.05),
        StepRecord(step_index=2, instance_id="w1", kind=StepKind.RECOMPUTE, block_index=0, threshold=0.7,
                   committed_positions=[0, 2], started_at=100.2, duration_s=0.05, loaded_state=True),
        StepRecord(step_index=3, instance_id="w1", kind=StepKind.CACHE, block_index=0, threshold=0.9,
                   committed_positions=[3], started_at=100.3, duration_s=0.02),
    ]


def test_timeline_frames_fill_the_canvas_step_by_step():
    body = timeline(_record(), _steps(), _codec())
    assert body["tokens"][:2] == ["4", "2"] and body["tokens"][2:] == ["", ""]  # EOS shows as nothing
    assert [f["committed"] for f in body["frames"]] == [[], [1], [0, 1, 2], [0, 1, 2, 3]]
    assert [f["new"] for f in body["frames"]] == [[], [1], [0, 2], [3]]
    assert [(s["instance_id"], s["kind"], s["tokens_committed"]) for s in body["steps"]] == [
        ("w0", "recompute", 1), ("w1", "recompute", 2), ("w1", "cache", 1)]
    assert body["steps"][0]["committed_text"] == "2" and body["instances"] == ["w0", "w1"]
    assert round(body["steps"][1]["start_ms"]) == 200


def _codec():
    from services.gateway.models import load_served_model
    from tests.unit.gateway.gateway_builders import MODEL_DIR

    return load_served_model(str(MODEL_DIR), None, None).codec


def test_pages_and_timeline_route():
    bus = FakeBus()
    bus.records["cmpl-t"] = (_record(), _steps())
    test_client, _ = client(bus=bus)
    with test_client:
        for path in ("/dashboard", "/requests/cmpl-t"):
            page = test_client.get(path)
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "/static/dashboard/common.js" in page.text
        assert test_client.get("/static/dashboard/timeline.js").status_code == 200
        body = test_client.get("/v1/requests/cmpl-t/timeline").json()
        assert body["request"]["status"] == "finished" and len(body["steps"]) == 3 and len(body["frames"]) == 4
        missing = test_client.get("/v1/requests/cmpl-nope/timeline")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "request_id"


def test_cluster_route_shows_instances_and_outcomes():
    bus = FakeBus()
    bus.state = type(bus.state)(True, True, [heartbeat("local-0"), heartbeat("w1", status=WorkerStatus.DRAINING)],
                                heard_s={"local-0": 1.5, "w1": 0.25})
    test_client, _ = client(bus=bus)
    with test_client:
        assert test_client.post("/v1/completions", json={"model": MODEL, "prompt": "12+30=", "stream": True}).status_code == 200
        assert test_client.post("/v1/completions", json={"model": MODEL, "prompt": "12+30="}).status_code == 200
        body = test_client.get("/v1/cluster").json()
    assert [(i["instance_id"], i["tp"], i["status"]) for i in body["instances"]] == [
        ("local-0", 1, "READY"), ("w1", 1, "DRAINING")]
    assert body["tp_degrees"] == {"1": 2}
    # ages from when the heartbeats arrived, not from the workers' sent_at (0.0 in these heartbeats)
    assert [i["heartbeat_age_s"] for i in body["instances"]] == [1.5, 0.25]
    assert body["slo"]["finished"] == 2 and body["slo"]["attainment"] == 1.0 and body["load"]["in_flight"] == 0
    assert body["calibration"]["dls-tiny"]["calibrated"] is True  # the bundled model ships its calibration
    assert body["instances"][0]["last_threshold"] == 0.9  # from the streamed request's progress events
    assert len(body["recent_requests"]) == 2 and body["thresholds"]["steps"] > 0


def test_monitor_series_counts_failures_as_misses():
    now = [1000.0]
    monitor = ClusterMonitor(lambda: now[0])
    from shared.messages.events import FailureReason, RequestFailed, RequestFinished
    from shared.messages.intake import CompletionRequest
    from tests.unit.gateway.gateway_builders import usage

    request = CompletionRequest(request_id="r", prompt_token_ids=[1], gen_length=4, block_length=4, slo_ms=1000.0,
                                arrival_time=999.0)
    monitor.observe(request, RequestFinished(request_id="r", seq=2, text="4", token_ids=[1], usage=usage(1, 1)))
    now[0] = 1001.0
    monitor.observe(request, RequestFailed(request_id="r2", seq=2, reason=FailureReason.NO_INSTANCE))
    now[0] = 1015.0
    snapshot = monitor.snapshot([], {MODEL})
    assert snapshot["slo"]["attainment"] == 0.5
    assert [p["attainment"] for p in snapshot["slo"]["series"]] == [0.5]
    assert snapshot["recent_requests"][0]["reason"] == "NO_INSTANCE"


def test_dashboard_data_needs_the_api_key_when_keys_are_set():
    test_client, _ = client(api_keys=["sekret"])
    with test_client:
        assert test_client.get("/v1/cluster").status_code == 401
        assert test_client.get("/v1/requests/cmpl-x/timeline").status_code == 401
        assert test_client.get("/v1/cluster", headers={"Authorization": "Bearer sekret"}).status_code == 200
