"""A stand-in for the worker fleet, for tests and benchmarks: no model, seeded step outcomes.

It commits a threshold-dependent number of tokens per step (more at lower thresholds), inside the
current block, and reports block ends and completions like the real engine. Step timing is the
caller's business (the latency profile gives it).
"""

from __future__ import annotations

import numpy as np

from services.scheduler.core.decisions import BatchOutcome, StepOutcome
from services.scheduler.core.request import Prediction, Request, RequestStatus
from services.scheduler.core.view import ClusterView

# threshold -> mean tokens committed per step
DEFAULT_TOKENS_PER_STEP = {0.5: 6.0, 0.6: 5.0, 0.7: 4.2, 0.8: 3.6, 0.9: 3.2, 0.95: 2.6}


class FakeEngine:
    def __init__(
        self,
        rng: np.random.Generator,
        tokens_per_step: dict[float, float] | None = None,
        predict: bool = False,
    ) -> None:
        self.rng = rng
        self.tokens_per_step = tokens_per_step or DEFAULT_TOKENS_PER_STEP
        self.predict = predict  # attach a fresh (noisy) remaining-step prediction to every outcome

    def run_step(self, view: ClusterView, instance_id: str) -> BatchOutcome:
        """One batched step over every request whose next step is assigned to ``instance_id``."""
        inst = view.instances[instance_id]
        outcomes = []
        for rid in inst.resident_ids:
            request = view.requests[rid]
            if request.status in (RequestStatus.RUNNING, RequestStatus.MIGRATING):
                outcomes.append(self._outcome(request))
        return BatchOutcome(instance_id, tuple(outcomes))

    def predict_for(self, request: Request | _Progress) -> Prediction:
        """A noisy remaining-step prediction for every threshold the engine knows."""
        remaining = max(request.num_remaining_tokens, 0)
        recompute = request.max_remaining_recompute_steps
        steps = {}
        for threshold, rate in self.tokens_per_step.items():
            total = max(int(np.ceil(remaining / rate * self.rng.uniform(0.8, 1.2))), recompute)
            steps[threshold] = (recompute, total - recompute)
        return Prediction(steps, request.num_steps_done)

    def _outcome(self, request: Request) -> StepOutcome:
        block_end = min((request.current_block + 1) * request.block_len, request.gen_len)
        left_in_block = block_end - request.num_tokens_committed
        mean = self._rate(request.threshold or 0.9)
        num = int(min(max(1, self.rng.poisson(mean - 1) + 1), left_in_block))
        block_done = num == left_in_block
        finished = request.num_tokens_committed + num >= request.gen_len
        recompute = request.next_step_is_recompute
        if not self.predict or finished:
            return StepOutcome(request.request_id, num, block_done, finished, recompute)
        prediction = self.predict_for(_Progress(request, num))
        return StepOutcome(request.request_id, num, block_done, finished, recompute, prediction)

    def _rate(self, threshold: float) -> float:
        keys = sorted(self.tokens_per_step)
        nearest = min(keys, key=lambda t: abs(t - threshold))
        return self.tokens_per_step[nearest]


class _Progress:
    """What a request will look like after this step, for the prediction that travels with it."""

    def __init__(self, request: Request, num: int) -> None:
        self.num_remaining_tokens = request.num_remaining_tokens - num
        # the current block is started (or done) either way: only later blocks need a recompute
        self.max_remaining_recompute_steps = max(request.num_blocks - request.current_block - 1, 0)
        self.num_steps_done = request.num_steps_done + 1
