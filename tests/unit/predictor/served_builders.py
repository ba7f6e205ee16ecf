"""Builders for the tests of retraining on served requests: the fake engine's requests as a worker stores
them (a ``RequestRecord`` and a ``StepRecord`` per step), beside the trace rows collection writes."""

from __future__ import annotations

import dataclasses

from services.predictor.core.served import LabelledState, states_from_steps
from services.predictor.traces import CollectConfig, collect_traces
from services.worker.engine.request import RequestState, StepResult
from shared.messages.base import CacheMode
from shared.messages.base import CacheMode as WireCacheMode
from shared.messages.base import ConfidenceStats as WireConfidence
from shared.state import RequestRecord, RequestStatus, StepRecord
from shared.tasks import Split, TaskGenerator
from tests.unit.predictor.pred_builders import FakeEngine


class RecordingEngine(FakeEngine):
    """The fake engine, keeping what a worker stores of every step (``services/worker/service/service.py``), and
    naming an expected end (``predicted_end``) of its own, so that feature is carried too."""

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[str, RequestState] = {}  # request id -> its engine state
        self.rid_to_steps: dict[str, list[StepRecord]] = {}  # request id -> its step records, in order

    def new_request(self, request_id, prompt_ids, gen_length=None, block_length=None, cache_mode=CacheMode.DUAL):
        state = super().new_request(request_id, prompt_ids, gen_length, block_length, cache_mode)
        self.states[request_id] = state
        return state

    def step(self, batch: list[tuple[RequestState, float]]) -> list[StepResult]:
        results = [dataclasses.replace(r, predicted_end=_expected_end(state))
                   for (state, _), r in zip(batch, super().step(batch), strict=True)]
        for (state, tau), r in zip(batch, results, strict=True):
            self.rid_to_steps.setdefault(state.request_id, []).append(StepRecord(
                step_index=r.num_steps, instance_id="w0", kind=r.kind, block_index=r.block_index, threshold=tau,
                committed_positions=list(r.committed_positions), batch_size=len(batch), started_at=0.0,
                duration_s=0.0, predicted_end=r.predicted_end,
                confidence=WireConfidence(min=r.confidence.min, q25=r.confidence.q25, median=r.confidence.median,
                                          mean=r.confidence.mean, q75=r.confidence.q75)))
        return results

    def record(self, request_id: str) -> RequestRecord:
        """The request's record as the worker leaves it after its last step."""
        state = self.states[request_id]
        return RequestRecord(
            request_id=request_id, status=RequestStatus.FINISHED if state.finished else RequestStatus.RUNNING,
            prompt_token_ids=list(state.prompt_ids), canvas=list(state.canvas), mask_token_id=self.mask_id,
            gen_length=state.gen_length, block_length=state.block_length, cache_mode=WireCacheMode(state.cache_mode),
            num_steps=state.num_steps, threshold_history=[s.threshold for s in self.rid_to_steps[request_id]],
            arrival_time=0.0, deadline=60.0, slo_ms=60_000.0,
        )


def _expected_end(state: RequestState) -> int:
    """A made-up end: the first or the second block, by the prompt."""
    return min(state.gen_length - 1, state.block_length * (len(state.prompt_ids) % 2) + 3)


def served_run(num_requests: int = 40, seed: int = 5, **config) -> tuple[RecordingEngine, list[dict]]:
    """The engine after running ``num_requests`` held-out problems, and the trace rows collection wrote."""
    engine = RecordingEngine()
    problems = TaskGenerator(seed).problems(num_requests, 8, split=Split.HELD_OUT)
    rows = collect_traces(engine, problems, seed, CollectConfig(batch_size=16, **config))
    return engine, rows


def served_states(num_requests: int = 40, seed: int = 5, **config) -> list[list[LabelledState]]:
    """Each request's labelled states rebuilt from what was stored, in the order they finished."""
    engine, rows = served_run(num_requests, seed, **config)
    finish_order = dict.fromkeys(r["request_id"] for r in rows)  # collection writes a request's rows at its finish
    return [states_from_steps(engine.record(rid), engine.rid_to_steps[rid]) for rid in finish_order]
