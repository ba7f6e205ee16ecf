"""Labelled states: a finished request's states between steps, each with the steps that actually followed.

One definition of the predictor's training rows, used twice: ``dls collect-traces`` labels the requests
it runs with the engine (``services/predictor/traces.py`` writes them as CSV rows), and the predictor
service labels the requests the cluster served from what the workers stored (``states_from_steps``:
the request's ``RequestRecord`` and one ``StepRecord`` per step, ``shared/state.py``), so it can score
and retrain on its own traffic (``core/retraining.py``).

The threshold feature is the one used for *all* remaining steps, so a state is labelled only where
every step after it ran at one threshold: after a request's last threshold change, every state; before
it, none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.predictor.core.predictor import PredictionQuery
from shared.features import confidence_values
from shared.messages.base import CacheMode, RequestStatus, StepKind
from shared.state import RequestRecord, StepRecord


@dataclass(frozen=True, slots=True)
class LabelledState:
    """A request between steps, the threshold every later step ran at, and the steps that followed."""

    query: PredictionQuery  # the state (``num_steps_done`` steps run; 0: arrival)
    threshold: float  # the threshold of every remaining step
    remaining_steps: int  # steps that followed (>= 1)
    remaining_recompute: int  # of which recompute steps (full forwards)
    switched: bool  # an earlier step ran at another threshold
    previous_threshold: float  # the threshold of the step before (NaN at arrival)

    @property
    def features(self) -> list[float]:
        return self.query.features(self.threshold)


def labelled_states(queries: Sequence[PredictionQuery], thresholds: Sequence[float],
                    recompute: Sequence[bool]) -> list[LabelledState]:
    """The states of a finished request whose remaining steps all ran at one threshold.

    ``thresholds[j]`` and ``recompute[j]``: the threshold and kind of step ``j + 1``; ``queries``: the state
    before each step, in step order (``queries[i].num_steps_done == i``; one per step at most)."""
    num_steps = len(thresholds)
    out = []
    for query in queries:
        done = query.num_steps_done
        future = thresholds[done:]
        if not future or any(t != future[0] for t in future):
            continue
        out.append(LabelledState(
            query, float(future[0]), num_steps - done, sum(1 for r in recompute[done:] if r),
            any(t != future[0] for t in thresholds[:done]), float(thresholds[done - 1]) if done else math.nan,
        ))
    return out


class UnusableSteps(ValueError):
    """A request whose stored steps do not describe its whole run (not finished, steps missing or doubled)."""


def states_from_steps(record: RequestRecord, steps: Sequence[StepRecord]) -> list[LabelledState]:
    """The labelled states of a finished request from its stored record and step records (what the
    workers wrote, ``services/worker/service/service.py``): the queries the engine's ``PredictionQuery.after_step``
    gives, rebuilt from each step's committed positions, block, confidences and ``predicted_end``."""
    steps = sorted(steps, key=lambda s: s.step_index)
    _check(record, steps)
    uses_cache = record.cache_mode != CacheMode.NONE
    prompt_length = len(record.prompt_token_ids)
    queries = [PredictionQuery.arriving(record.request_id, record.gen_length, prompt_length, record.block_length,
                                        uses_cache)]
    committed: set[int] = set()  # canvas positions committed so far
    for step in steps[:-1]:  # the state after the last step is a finished request: nothing to predict
        committed.update(step.committed_positions)
        start = step.block_index * record.block_length
        end = min(start + record.block_length, record.gen_length)
        queries.append(PredictionQuery(
            record.request_id, step.step_index, record.gen_length, prompt_length, record.block_length,
            len(committed), sum(1 for p in committed if start <= p < end), end - start,
            None if step.confidence is None else tuple(confidence_values(step.confidence)), uses_cache,
            block_index=step.block_index, predicted_end=step.predicted_end,
        ))
    return labelled_states(queries, [s.threshold for s in steps], [s.kind == StepKind.RECOMPUTE for s in steps])


def _check(record: RequestRecord, steps: Sequence[StepRecord]) -> None:
    if record.status != RequestStatus.FINISHED:
        raise UnusableSteps(f"request {record.request_id} is {record.status.name.lower()}, not finished")
    indices = [s.step_index for s in steps]
    if indices != list(range(1, record.num_steps + 1)):
        raise UnusableSteps(f"request {record.request_id}: {record.num_steps} steps run, step records "
                            f"{indices[:3]}...{indices[-3:]} ({len(indices)}) do not match")
