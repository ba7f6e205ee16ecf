"""The driver side of the two-call contract, identical for the scheduler service and the simulator.

``SchedulingLoop`` records each event in the ClusterView, tells the policy, asks it to schedule, and
applies the decisions it returns. The caller sends the assignments to workers (service) or turns
them into future step events (simulator).
"""

from __future__ import annotations

from services.scheduler.core.base import Policy
from services.scheduler.core.decisions import Decisions, StepResult
from services.scheduler.core.request import Prediction, Request
from services.scheduler.core.view import ClusterView


class SchedulingLoop:
    def __init__(self, policy: Policy, view: ClusterView | None = None) -> None:
        self.policy = policy
        self.view = view if view is not None else ClusterView()

    def on_arrival(self, now: float, request: Request) -> Decisions:
        self.view.add_request(request)
        return self._schedule(now)

    def on_arrivals(self, now: float, requests: list[Request]) -> Decisions:
        """Several arrivals at the same instant: admitted in list order, one scheduling pass."""
        for request in requests:
            self.view.add_request(request)
        return self._schedule(now)

    def on_step_result(self, now: float, result: StepResult) -> Decisions:
        self.view.apply_step_result(now, result)
        self.policy.on_step_result(now, result)
        return self._schedule(now)

    def on_step_results(self, now: float, results: list[StepResult]) -> Decisions:
        """Several step results that arrived together: each recorded in order, one scheduling pass.

        Equivalent to ``on_step_result`` for a single result; for several, the policy re-plans all
        their requests at once (what the service does with the results that queued up while it was
        busy) instead of once per result.
        """
        for result in results:
            self.view.apply_step_result(now, result)
            self.policy.on_step_result(now, result)
        return self._schedule(now)

    def on_prediction(self, now: float, request_id: str, prediction: Prediction) -> None:
        """A prediction that arrived on its own; used when the request is next re-planned."""
        self.view.set_prediction(request_id, prediction)

    def tick(self, now: float) -> Decisions:
        """A scheduling pass with no new event (after instance changes, or periodically)."""
        return self._schedule(now)

    def _schedule(self, now: float) -> Decisions:
        read_up_to = self.view.log_positions()
        decisions = self.policy.schedule(now, self.view)
        self.view.apply(now, decisions)
        # the policy has read the logs up to there (not what apply just added): keeps them bounded
        self.view.trim_logs(read_up_to)
        return decisions
