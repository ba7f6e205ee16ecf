"""Shadow decoding: answers served below the highest threshold decoded again at the highest, at the
lowest priority; where their agreement falls below what the quality curve promised, the candidates
tighten (core.quality_watch, and the scheduler service that samples, decodes and judges)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest

from services.scheduler.core.quality_watch import QualityWatch, promised_agreement
from services.scheduler.core.request import Request
from services.scheduler.service import SHADOW_PRIORITY, SchedulerService, ServedQuality
from shared.messages.base import RequestStatus
from shared.settings import SchedulerSettings
from shared.state import InMemoryStateStore, RequestRecord

CURVE = {"0.5": 0.6, "0.6": 0.9, "0.7": 0.99, "0.8": 1.0, "0.9": 1.0}


def test_a_labelled_curve_promises_the_agreement_its_accuracy_drop_allows():
    promised = promised_agreement(CURVE, "labelled", (0.7, 0.8, 0.9))
    assert promised == pytest.approx({0.7: 0.99, 0.8: 1.0, 0.9: 1.0})
    assert promised_agreement({"0.7": 0.95, "0.9": 1.0}, "agreement", (0.7, 0.9)) == {0.7: 0.95, 0.9: 1.0}


def test_the_floor_rises_above_a_threshold_whose_answers_disagree_too_often():
    watch = QualityWatch((0.7, 0.8, 0.9), {0.7: 0.99, 0.8: 1.0}, min_samples=10, tolerance=0.02)
    assert watch.snap(0.75) == 0.7 and watch.snap(0.5) == 0.7 and watch.snap(0.9) == 0.9
    for i in range(9):
        watch.observe(0.7, agreed=i > 2)  # 6 of 9: too few samples to judge
    assert watch.floor() == 0.0
    watch.observe(0.7, agreed=True)
    assert watch.agreement(0.7) == pytest.approx(0.7) and watch.broken() == [0.7] and watch.floor() == 0.8
    for _ in range(10):
        watch.observe(0.8, agreed=True)
    assert watch.floor() == 0.8  # 0.8 keeps its promise
    assert watch.wants(0.7, draw=0.005) and not watch.wants(0.7, draw=0.5) and not watch.wants(0.9, draw=0.0)
    assert watch.wants(0.7, 0.005, shadow_steps=2, steps=100) and not watch.wants(0.7, 0.005, shadow_steps=3, steps=100)
    assert watch.wants(0.7, 0.005, 0, 1000, reserved_steps=20) and not watch.wants(0.7, 0.005, 0, 1000, 21)


def test_a_threshold_keeping_its_promise_within_the_tolerance_stays():
    watch = QualityWatch((0.7, 0.9), {0.7: 0.95}, min_samples=20, tolerance=0.02)
    for i in range(20):
        watch.observe(0.7, agreed=i != 0)  # 95%: as promised
    assert watch.floor() == 0.0


def _record(request_id: str, canvas: list[int], **fields) -> RequestRecord:
    return RequestRecord(request_id=request_id, prompt_token_ids=[5, 6, 7], canvas=canvas, mask_token_id=1,
                         gen_length=len(canvas), block_length=4, arrival_time=0.0, deadline=10.0, slo_ms=10_000.0,
                         **fields)


def _finished(request_id: str, threshold: float, num_steps: int = 3):
    return SimpleNamespace(request_id=request_id, threshold=threshold, block_done=True, finished=True,
                           num_steps=num_steps, num_answer_tokens=4)


def test_the_service_decodes_a_sample_again_at_the_lowest_priority_and_tightens_on_disagreement():
    async def scenario():
        store = InMemoryStateStore()
        settings = SchedulerSettings(thresholds=[0.7, 0.8, 0.9], shadow_rate=1.0, shadow_min_samples=2,
                                     shadow_step_budget=1.0)
        quality = ServedQuality({"accuracy": CURVE}, "quality.json")
        service = SchedulerService(settings, nc=None, js=None, store=store, clock=lambda: 5.0)
        assert service.quality_watch is not None  # the bundled model's curve: its watch
        from services.scheduler.service import load_policy, quality_watch

        service.core.loop.policy = load_policy(settings, quality)
        service.quality_watch = quality_watch(settings, quality, service.loop.policy)
        assert service.quality_watch.top == 0.9 and service.loop.policy.grid.values == (0.7, 0.8, 0.9)
        service._request_steps = 1_000  # steps served before: room in the shadows' step budget
        for n in range(2):
            rid = f"r{n}"
            await store.create(_record(rid, [9, 9, 2, 1]))
            await store.save(msgspec.structs.replace(await store.load(rid), status=RequestStatus.FINISHED))
            service.live[rid] = SimpleNamespace(deadline=10.0, threshold_sum=0.0, num_threshold_steps=0,
                                                last_threshold=None, lowest_threshold=1.0, first_output_at=None,
                                                last_output_at=None, model="m", arrival_time=0.0,
                                                first_prediction=None, trace_context="")
            service._observe_output = lambda *a: None
            service._observe_finish = lambda *a: None
            service._after_dispatch = lambda work: None
            service._observe_results(SimpleNamespace(results=[_finished(rid, 0.7)]), now=5.0)
            await asyncio.gather(*service._tasks)
            shadow_id = f"shadow-{rid}"
            assert shadow_id in service._shadows
            request: Request = service.view.requests[shadow_id]
            assert request.priority == SHADOW_PRIORITY and request.min_threshold == request.max_threshold == 0.9
            shadow = await store.load(shadow_id)  # decoded again: another answer than the served one
            await store.save(msgspec.structs.replace(shadow, canvas=[8, 8, 2, 1], status=RequestStatus.FINISHED))
            service._observe_results(SimpleNamespace(results=[_finished(shadow_id, 0.9)]), now=6.0)
            await asyncio.gather(*service._tasks)
            assert shadow_id not in service._shadows
        assert service.quality_watch.agreement(0.7) == 0.0
        assert service.loop.policy.grid.quality_floor == 0.8  # 0.7 withdrawn: 0% against the 99% promised
        assert service.loop.policy.grid.request_range(Request("x", 0.0, 3, 4, 10.0, block_len=4)) == (1, 2)

    asyncio.run(scenario())
