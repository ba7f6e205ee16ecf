"""The gateway's pure pieces: event ordering, worker leases, default SLOs, the model catalogue."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.gateway.models import (
    ModelCatalogue,
    ModelLoadError,
    UnknownModelError,
    load_served_model,
)
from services.gateway.sequencing import EventSequencer
from services.gateway.slo import REFERENCE_THRESHOLD, RETRY_S, DefaultSlo, SloEstimator
from services.gateway.workers import WorkerRegistry
from shared.generation import read_generation_limits
from shared.messages.base import CacheMode
from shared.messages.control import WorkerStatus
from shared.messages.events import (
    FailureReason,
    RequestAccepted,
    RequestFailed,
    RequestFinished,
    RequestProgress,
    Usage,
)
from shared.messages.predictor import PredictReply, PredictRequest, RemainingSteps, StepPrediction
from shared.profiles import LatencyProfile
from tests.unit.gateway.gateway_builders import MODEL, MODEL_DIR, heartbeat

RID = "cmpl-x"


def accepted() -> RequestAccepted:
    return RequestAccepted(request_id=RID, seq=1, prompt_tokens=3, deadline=10.0)


def step(n: int) -> RequestProgress:
    return RequestProgress(request_id=RID, seq=n + 1, num_steps=n, block_index=0, committed_positions=[n - 1],
                           committed_token_ids=[5], num_committed=n, gen_length=8, text_delta=str(n), threshold=0.9,
                           instance_id="a")


def finished(num_steps: int) -> RequestFinished:
    usage = Usage(prompt_tokens=3, completion_tokens=2, num_steps=num_steps, num_recompute_steps=1, thresholds=[],
                  instance_ids=["a"], num_migrations=0, latency_s=0.1, slo_met=True)
    return RequestFinished(request_id=RID, seq=num_steps + 2, text="12", token_ids=[5, 6], usage=usage)


def seqs(events) -> list[int]:
    return [event.seq for event in events]


# --- EventSequencer ------------------------------------------------------------------------------


def test_in_order_events_pass_at_once_and_duplicates_are_dropped():
    sequencer = EventSequencer(contiguous=True)
    assert seqs(sequencer.push(accepted())) == [1]
    assert seqs(sequencer.push(step(1))) == [2]
    assert sequencer.push(step(1)) == [] and sequencer.push(accepted()) == []
    assert seqs(sequencer.push(finished(1))) == [3]
    assert sequencer.done and sequencer.push(step(2)) == []


def test_a_stream_waits_for_the_gap_and_releases_in_seq_order():
    sequencer = EventSequencer(contiguous=True)
    assert sequencer.push(finished(2)) == []  # the final event overtook two progress events
    assert sequencer.push(step(2)) == [] and sequencer.holding
    assert seqs(sequencer.push(accepted())) == [1]
    assert seqs(sequencer.push(step(1))) == [2, 3, 4]
    assert sequencer.done and not sequencer.holding


def test_flush_gives_up_on_lost_events():
    sequencer = EventSequencer(contiguous=True)
    sequencer.push(accepted())
    sequencer.push(step(3))
    sequencer.push(finished(3))
    assert sequencer.holding
    assert seqs(sequencer.flush()) == [4, 5]  # steps 1 and 2 were lost
    assert sequencer.done and sequencer.push(step(1)) == []  # a straggler after the end


def test_non_streaming_requests_pass_their_designed_gap():
    sequencer = EventSequencer(contiguous=False)
    assert seqs(sequencer.push(accepted())) == [1]
    assert seqs(sequencer.push(finished(5))) == [7]
    assert sequencer.done


def test_failed_is_terminal_and_does_not_wait_for_a_gap():
    failed = RequestFailed(request_id=RID, seq=2, reason=FailureReason.INVALID)  # refused before acceptance
    for contiguous in (False, True):
        sequencer = EventSequencer(contiguous)
        assert sequencer.push(failed) == [failed] and sequencer.done
    sequencer = EventSequencer(contiguous=True)
    sequencer.push(accepted())
    sequencer.push(step(2))
    late = RequestFailed(request_id=RID, seq=4, reason=FailureReason.WORKER_ERROR)
    assert seqs(sequencer.push(late)) == [3, 4]  # what arrived goes out in order, then the failure


# --- WorkerRegistry ------------------------------------------------------------------------------


def test_leases_count_from_receipt_and_expire():
    registry = WorkerRegistry()
    registry.observe(heartbeat("w1", ttl_s=6.0, sent_at=-1000.0), now=100.0)  # skewed sender clock
    assert [hb.instance_id for hb in registry.ready(now=105.9)] == ["w1"]
    assert registry.ready(now=106.0) == [] and registry.live(now=106.0) == []


def test_ready_filters_status_and_model_and_stopping_ends_the_lease():
    registry = WorkerRegistry()
    registry.observe(heartbeat("w1", sent_at=1.0), now=0.0)
    registry.observe(heartbeat("w2", status=WorkerStatus.DRAINING, sent_at=1.0), now=0.0)
    registry.observe(heartbeat("w3", model="llada-8b", sent_at=1.0), now=0.0)
    assert [hb.instance_id for hb in registry.ready(1.0, MODEL)] == ["w1"]
    assert [hb.instance_id for hb in registry.live(1.0)] == ["w1", "w2", "w3"]
    registry.observe(heartbeat("w1", status=WorkerStatus.STOPPING, sent_at=2.0), now=2.0)
    assert registry.ready(2.0, MODEL) == []


def test_an_older_heartbeat_does_not_replace_a_newer_one():
    registry = WorkerRegistry()
    registry.observe(heartbeat("w1", status=WorkerStatus.DRAINING, sent_at=5.0), now=0.0)
    registry.observe(heartbeat("w1", status=WorkerStatus.READY, sent_at=4.0), now=0.1)
    assert registry.ready(1.0) == []


# --- SloEstimator --------------------------------------------------------------------------------


PROFILE = LatencyProfile.from_dict({"model": "m", "device": "d", "tp": {"1": {
    "recompute_ms": {"1": 20.0}, "cache_ms": {"1": 5.0}, "full_ms": {"1": 30.0}}}})


def test_default_slo_is_factor_times_isolated_latency_with_a_floor():
    estimator = SloEstimator(PROFILE, factor=5.0, floor_ms=0.0)
    # 2 recompute x 20 ms + 6 cache x 5 ms = 70 ms alone; 5x that.
    assert estimator.default_slo_ms((2.0, 6.0), 16, 8, CacheMode.DUAL) == pytest.approx(350.0)
    assert SloEstimator(PROFILE, 5.0, floor_ms=1000.0).default_slo_ms((2.0, 6.0), 16, 8, CacheMode.DUAL) == 1000.0


def test_default_slo_without_cache_uses_full_steps_and_blocks_bound_the_recompute_steps():
    estimator = SloEstimator(PROFILE, factor=1.0, floor_ms=0.0)
    assert estimator.default_slo_ms((3.0, 0.0), 16, 8, CacheMode.NONE) == pytest.approx(90.0)  # 3 x 30 ms
    # answers stop at their EOS block: the predicted 3 recompute steps stand on a 64-token canvas ...
    assert estimator.steps((3.0, 0.0), 64, 8, CacheMode.DUAL) == (3.0, 0.0)
    # ... kept within one block and every block of the canvas
    assert estimator.steps((3.0, 0.0), 16, 8, CacheMode.DUAL) == (2, 0.0)
    assert estimator.steps((0.2, 1.0), 64, 8, CacheMode.DUAL) == (1.0, 1.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_default_slo_asks_the_predictor_service_once_per_shape_and_falls_back_while_it_is_down():
    asked: list[PredictRequest] = []
    up = [True]

    async def ask(request: PredictRequest) -> PredictReply:
        asked.append(request)
        if not up[0]:
            raise TimeoutError("no predictor")
        steps = {t: RemainingSteps(recompute_steps=2.0, cache_steps=6.0) for t in request.thresholds}
        return PredictReply(predictions=[StepPrediction(request_id="x", made_at_step=0, threshold_to_steps=steps)])

    clock = FakeClock()
    slo = DefaultSlo(SloEstimator(PROFILE, 5.0, 0.0), ask, fallback_ms=9999.0, clock=clock)
    assert asyncio.run(slo.slo_ms(10, 16, 8, CacheMode.DUAL)) == pytest.approx(350.0)
    [request] = asked
    assert request.one_shot and request.thresholds == [REFERENCE_THRESHOLD] == [0.9]
    [query] = request.queries
    assert (query.prompt_length, query.gen_length, query.block_length, query.uses_cache, query.num_steps_done) \
        == (10, 16, 8, True, 0)
    assert asyncio.run(slo.slo_ms(10, 16, 8, CacheMode.DUAL)) == pytest.approx(350.0)
    assert len(asked) == 1  # the same shape: remembered
    up[0] = False
    assert asyncio.run(slo.slo_ms(11, 16, 8, CacheMode.DUAL)) == 9999.0  # a new shape, no answer: the fallback
    assert asyncio.run(slo.slo_ms(12, 16, 8, CacheMode.DUAL)) == 9999.0
    assert len(asked) == 2  # not asked again while it is down
    up[0] = True
    clock.now = RETRY_S + 1.0
    assert asyncio.run(slo.slo_ms(12, 16, 8, CacheMode.DUAL)) == pytest.approx(350.0)
    assert DefaultSlo(None, ask, 9999.0, clock).estimator is None
    assert asyncio.run(DefaultSlo(None, ask, 9999.0, clock).slo_ms(10, 16, 8, CacheMode.DUAL)) == 9999.0



# --- models --------------------------------------------------------------------------------------


def test_bundled_model_loads_with_its_limits_and_defaults():
    model = load_served_model(MODEL_DIR)
    assert (model.name, model.max_sequence_length) == (MODEL, 512)
    limits = read_generation_limits(MODEL_DIR)  # the model's training_info.json
    assert (model.default_gen_length, model.default_block_length) == (limits.gen_length, limits.block_length)
    assert model.limits.max_gen_length == limits.max_gen_length >= limits.gen_length
    codec = model.codec
    assert codec.encode("1+1=") and codec.decode(codec.encode("12") + [2] + codec.encode("3")) == "123"  # EOS: ""
    assert model.codec.render_canvas(model.codec.encode("1") + [model.codec.mask_token_id] * 2) == "1__"
    assert load_served_model(MODEL_DIR, default_gen_length=32).default_gen_length == 32


def test_catalogue_names_unknown_models():
    catalogue = ModelCatalogue([load_served_model(MODEL_DIR)])
    with pytest.raises(UnknownModelError, match="served: dls-tiny"):
        catalogue.get("llada-8b")


def test_unusable_model_directories_fail_naming_the_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_served_model(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps({"max_sequence_length": "long"}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"type": "char", "chars": "ab"}))
    with pytest.raises(ModelLoadError, match="max_sequence_length"):
        load_served_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({}))
    model = load_served_model(tmp_path)
    assert (model.max_sequence_length, model.default_gen_length, model.default_block_length) == (4096, 256, 32)
