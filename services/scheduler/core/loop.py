"""The driver side of the policies' two-call contract.

``SchedulingLoop`` records each event in the ClusterView, tells the policy, asks it to schedule, and
applies the decisions it returns. ``StepScheduler`` (``steps.py``) drives it and turns the
assignments into step commands, for the scheduler service and the simulator alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.scheduler.core.base import Policy
from services.scheduler.core.decisions import (
    BatchOutcome,
    Decisions,
    Preemption,
    Rejection,
    RejectReason,
    StepAssignment,
)
from services.scheduler.core.memory import Preemptor
from services.scheduler.core.request import Prediction, Request, RequestStatus
from services.scheduler.core.view import ClusterView


@dataclass(slots=True)
class Continuation:
    """What ``continue_steps`` did: the assignments that keep instances stepping (dispatch them now),
    the requests they carry (``replan`` them once dispatched), and whether a scheduling pass is
    still owed (requests left READY, or a queue)."""

    decisions: Decisions = field(default_factory=Decisions)
    continued_ids: list[str] = field(default_factory=list)
    needs_pass: bool = False

    def merge(self, later: Continuation) -> None:
        """Both continuations, their replanning owed by one pass."""
        self.decisions.assignments += later.decisions.assignments
        self.continued_ids = list(dict.fromkeys(self.continued_ids + later.continued_ids))
        self.needs_pass = self.needs_pass or later.needs_pass


class SchedulingLoop:
    def __init__(self, policy: Policy, view: ClusterView | None = None, preemptor: Preemptor | None = None) -> None:
        """``preemptor``: who yields KV memory to queued requests (``memory.py``; default: its defaults,
        the same for every policy)."""
        self.policy = policy
        self.view = view if view is not None else ClusterView()
        self.preemptor = preemptor if preemptor is not None else Preemptor()

    def on_arrival(self, now: float, request: Request) -> Decisions:
        self.view.add_request(request)
        return self._schedule(now)

    def on_arrivals(self, now: float, requests: list[Request]) -> Decisions:
        """Several arrivals at the same instant: admitted in list order, one scheduling pass."""
        for request in requests:
            self.view.add_request(request)
        return self._schedule(now)

    def on_step_result(self, now: float, result: BatchOutcome) -> Decisions:
        self.record(now, [result])
        return self._schedule(now)

    def on_step_results(self, now: float, results: list[BatchOutcome]) -> Decisions:
        """Several step results that arrived together: each recorded in order, one scheduling pass.

        Equivalent to ``on_step_result`` for a single result; for several, the policy re-plans all
        their requests at once (what the service does with the results that queued up while it was
        busy) instead of once per result.
        """
        self.record(now, results)
        return self._schedule(now)

    def record(self, now: float, results: list[BatchOutcome]) -> None:
        """Step results into the view and the policy, no scheduling pass yet (their requests are READY)."""
        for result in results:
            self.view.apply_step_result(now, result)
            self.policy.on_step_result(now, result)

    def continue_steps(
        self,
        now: float,
        instance_ids: Sequence[str],
        min_remaining_tokens: int,
        running: Mapping[str, Sequence[tuple[str, float]]] | None = None,
    ) -> Continuation:
        """Overlap: after ``record``, keep each of these instances stepping with the same requests at
        their current thresholds, before any scheduling pass, where nothing a pass decides at this
        point could differ but the thresholds.

        An instance continues when it is alive, every request on it came back READY from its step
        and has at least ``min_remaining_tokens`` tokens to go, none starts a block next (with a cache
        that is a recompute step, where migration is decided; with none, the pass still gets every
        block start) or waits for its state to be reloaded, and the queue is empty or the instance is
        full. Its requests' thresholds for the step after are then computed by ``replan`` while this
        one runs (one step late: what overlap trades for the pass's latency). Instances that do not
        continue, and everything else, wait for the next ``tick``.

        ``running`` (instance id -> (request id, threshold) pairs): instances that already went on by
        themselves (pipelining: a worker ran the step it had been sent in advance), so they continue
        with those requests at those thresholds whatever the checks above would say.
        """
        out = Continuation()
        running = running or {}
        for instance_id, pairs in running.items():
            for rid, threshold in pairs:
                r = self.view.requests.get(rid)
                if r is not None and r.status == RequestStatus.READY and r.instance_id == instance_id:
                    out.decisions.assignments.append(
                        StepAssignment(rid, instance_id, threshold, recompute=r.next_step_is_recompute))
                    out.continued_ids.append(rid)
        if min_remaining_tokens > 0:
            for instance_id in instance_ids:
                if instance_id not in running:
                    self._continue_instance(instance_id, min_remaining_tokens, out)
        self.view.apply(now, out.decisions)
        out.needs_pass = bool(self.view.ready_ids) or self.view.num_queued > 0
        return out

    def _continue_instance(self, instance_id: str, min_remaining_tokens: int, out: Continuation) -> None:
        inst = self.view.instances.get(instance_id)
        queued = self.view.num_queued > 0
        if inst is None or not inst.alive or not inst.resident_ids or (queued and inst.batch < inst.max_batch):
            return
        residents = [self.view.requests[rid] for rid in inst.resident_ids]
        if all(
            r.status == RequestStatus.READY and r.threshold is not None and r.num_block_steps > 0
            and not r.reloading and r.num_remaining_tokens >= min_remaining_tokens
            for r in residents
        ):
            for r in residents:
                out.decisions.assignments.append(
                    StepAssignment(r.request_id, inst.instance_id, r.threshold, recompute=r.next_step_is_recompute))
                out.continued_ids.append(r.request_id)

    def replan(self, now: float, request_ids: list[str]) -> None:
        """Next-step thresholds for requests ``continue_steps`` kept running (policies that choose
        thresholds implement ``replan``; for the others a threshold never changes between passes)."""
        replan = getattr(self.policy, "replan", None)
        if replan is not None:
            replan(now, self.view, request_ids)

    def would_stay(self, instance_id: str, request_ids: list[str]) -> set[str]:
        """Requests on ``instance_id`` that the policy would keep there at a block start (pipelining
        may run their next block's first step without a pass); none for policies that cannot say."""
        would_stay = getattr(self.policy, "would_stay", None)
        return would_stay(self.view, instance_id, request_ids) if would_stay is not None else set()

    def provisional(self, request: Request) -> bool:
        """Whether the policy holds ``request``'s threshold only until its next pass re-plans it (the
        first step's, chosen before any prediction; ``StepScheduler`` then holds no command ahead of a
        short request's step). False for policies that cannot say (their thresholds never change
        between passes)."""
        provisional = getattr(self.policy, "provisional", None)
        return bool(provisional(request)) if provisional is not None else False

    def yielding(self, now: float, instance_id: str, requests: list[Request]) -> set[str]:
        """Of the requests a step on ``instance_id`` would carry, those the policy leaves out of it
        (DiLaServe: late requests beyond one per step while others can still make their deadlines);
        none for policies that cannot say."""
        yielding = getattr(self.policy, "yielding", None)
        return yielding(now, self.view, instance_id, requests) if yielding is not None and requests else set()

    def on_prediction(self, now: float, request_id: str, prediction: Prediction) -> None:
        """A prediction that arrived on its own; used when the request is next re-planned."""
        self.view.set_prediction(request_id, prediction)

    def tick(self, now: float) -> Decisions:
        """A scheduling pass with no new event (after instance changes, or periodically)."""
        return self._schedule(now)

    def preempt(self, request_id: str, for_request_id: str = "") -> Preemption:
        """A request yields its memory (``ClusterView.preempt``); the driver drops its cache."""
        request = self.view.requests[request_id]
        instance_id = request.instance_id or ""
        return Preemption(request_id, instance_id, for_request_id, self.view.preempt(request_id))

    def _make_room(self, now: float) -> Decisions:
        """Before the policy's pass: queued requests no instance could ever hold are rejected, and
        running ones yield memory to queued ones where the preemptor says so (``memory.py``)."""
        out = Decisions()
        for request, largest in self.preemptor.unplaceable(self.view):
            out.rejections.append(Rejection(request.request_id, RejectReason.NO_INSTANCE,
                                            f"its prompt and canvas take {request.context_tokens} tokens of KV cache; "
                                            f"the largest instance holds {largest}"))
        if out.rejections:
            self.view.apply(now, out)
        for p in self.preemptor.choose(now, self.view):
            out.preemptions.append(self.preempt(p.request_id, p.for_request_id))
        return out

    def _schedule(self, now: float) -> Decisions:
        read_up_to = self.view.log_positions()
        room = self._make_room(now)
        decisions = self.policy.schedule(now, self.view)
        self.view.apply(now, decisions)
        # the policy has read the logs up to there (not what apply just added): keeps them bounded
        self.view.trim_logs(read_up_to)
        if room:
            decisions.rejections[:0] = room.rejections
            decisions.preemptions[:0] = room.preemptions
        return decisions
