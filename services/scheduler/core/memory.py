"""KV memory as a scheduled resource: which running requests make room for a queued one, and which
queued requests no instance could ever hold.

Memory is counted in context tokens (prompt plus canvas: what a request's KV cache holds from its
first step to its last). Each instance has ``mem_limit_tokens`` (the worker's KV budget as its
heartbeat reports it; in the simulator, the profile's bytes per token against the GPUs' budget) and
``mem_free`` in the ``InstanceTable``; placement (Algorithm 3) and the baselines only choose an
instance whose free memory fits the request, so nothing is placed beyond a budget. Under pressure a
queued request waits. ``Preemptor`` decides when a request already on an instance yields its memory
instead (preemption by recompute: its KV cache is dropped, its state stays in the store, and it
resumes from there with a recompute step, on whichever instance placement chooses):

- only for a queue head that memory alone keeps out (some live instance has a free batch slot, none
  has the memory), and only READY requests yield (never one whose step is running);
- a victim of lower priority always may; one of the same priority only when the head's deadline is
  earlier and the victim can wait for the head to finish and still meet its own deadline (its slack
  exceeds the head's estimated time plus ``slack_margin_s``): so a preemption never trades one
  request's SLO for another's;
- lowest priority first, then the most slack; on the instance that needs the fewest victims;
- a request yields at most ``max_per_request`` times (no ping-pong), and goes back to the end of its
  priority's queue.

``unplaceable`` names queued requests larger than every live instance's whole memory: the loop
rejects them (``NO_INSTANCE``) instead of letting them wait for ever.

Both go by model (``view.serves``): a queued request is compared with, and makes room only on, live
instances of its model, so its victims are requests of that model; a request whose model has no live
instance waits (as every request does while no instance is live), and one larger than every live
instance of its model is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.scheduler.core.decisions import Preemption
from services.scheduler.core.request import CacheMode, Request, RequestStatus
from services.scheduler.core.view import ClusterView, StepCost, serves

MAX_HEADS = 8  # queued requests looked at per pass


@dataclass(frozen=True, slots=True)
class PreemptionConfig:
    enabled: bool = True
    max_per_request: int = 1  # times one request may yield its memory
    slack_margin_s: float = 0.5  # a same-priority victim keeps at least this much slack after waiting
    max_per_pass: int = 4  # preemptions one scheduling pass may decide


def remaining_seconds(request: Request, alpha_s: float, beta_s: float) -> float:
    """Time to finish at step latencies ``alpha_s`` (recompute) and ``beta_s`` (cache): from its latest
    prediction at its threshold (or the fastest one predicted), else one token per step."""
    prediction = request.prediction
    if prediction is not None and prediction.threshold_to_steps:
        steps = prediction.threshold_to_steps
        key = request.threshold if request.threshold in steps else min(steps)
        recompute, cache = steps[key]
        done = max(request.num_steps_done - prediction.made_at_step, 0)
        cache = max(cache - done, 0)
    else:
        recompute = request.max_remaining_recompute_steps
        cache = max(request.num_remaining_tokens - recompute, 0)
    if request.cache_mode == CacheMode.NONE:
        return (recompute + cache) * alpha_s
    return recompute * alpha_s + cache * beta_s


class Preemptor:
    """Chooses the requests that yield their KV memory to queued ones (module docstring)."""

    def __init__(self, config: PreemptionConfig | None = None) -> None:
        self.config = config or PreemptionConfig()
        self._arrivals_seen = 0  # arrival log position up to which requests were checked
        self._instances_seen = -1  # ClusterView.num_instance_changes when the whole queue was last checked

    def unplaceable(self, view: ClusterView) -> list[tuple[Request, int]]:
        """Queued requests whose context exceeds the memory of every live instance of their model, with
        that largest memory (none while no instance of their model is live: one may yet join). Looks at the arrivals since the last call,
        and at the whole queue when the instances changed."""
        table = view.table
        n = table.num_rows
        new_ids, self._arrivals_seen = view.arrival_log.since(self._arrivals_seen)
        if not n or not table.alive[:n].any() or not view.num_queued:
            return []
        if view.num_instance_changes != self._instances_seen:
            self._instances_seen = view.num_instance_changes
            candidates = view.iter_queued()
        else:
            candidates = (r for rid in new_ids if (r := view.requests.get(rid)) is not None
                          and r.status == RequestStatus.QUEUED)
        model_to_largest: dict[str, int] = {}  # model -> its live instances' largest memory (0: none live)
        out = []
        for r in candidates:
            if r.model not in model_to_largest:
                alive = table.alive[:n]
                rows = table.serving_rows(r.model)
                alive = alive if rows is None else alive & rows
                model_to_largest[r.model] = int(table.mem_limit[:n][alive].max()) if alive.any() else 0
            largest = model_to_largest[r.model]
            if largest and r.context_tokens > largest:  # none live of its model: it waits, one may yet join
                out.append((r, largest))
        return out

    def choose(self, now: float, view: ClusterView) -> list[Preemption]:
        config = self.config
        if not config.enabled or not view.num_queued:
            return []
        table = view.table
        n = table.num_rows
        alive = table.alive[:n].copy()
        batch = table.batch[:n].copy()
        mem_free = table.mem_free[:n].copy()
        if not (alive & (batch < table.max_batch[:n])).any():
            return []  # batch slots bind, not memory
        chosen: list[Preemption] = []
        taken: set[str] = set()
        for head_index, head in enumerate(view.iter_queued()):
            if head_index >= MAX_HEADS or len(chosen) >= config.max_per_pass:
                break
            tokens = head.context_tokens
            slot = alive & (batch < table.max_batch[:n])
            if not slot.any():
                break  # no slot left anywhere this pass
            rows = table.serving_rows(head.model)
            if rows is not None:  # only instances of its model take it, or yield memory to it
                slot = slot & rows
            fits = slot & (mem_free >= tokens)
            if fits.any():  # placeable: count it there (the fastest-emptiest guess) and look further
                row = int(np.flatnonzero(fits)[np.argmax(mem_free[fits])])
                mem_free[row] -= tokens
                batch[row] += 1
                continue
            if not slot.any():
                continue  # no slot left for its model this pass
            best = self._victims_for(now, view, head, mem_free, batch, alive, taken)
            if best is None:
                continue
            row, victims = best
            for victim in victims:
                chosen.append(Preemption(victim.request_id, view.row_to_instance_id[row], head.request_id))
                taken.add(victim.request_id)
                mem_free[row] += victim.context_tokens
                batch[row] -= 1
            mem_free[row] -= tokens
            batch[row] += 1
        return chosen

    def _victims_for(self, now: float, view: ClusterView, head: Request, mem_free: np.ndarray, batch: np.ndarray,
                     alive: np.ndarray, taken: set[str]) -> tuple[int, list[Request]] | None:
        """The instance row and the fewest requests on it whose memory makes room for ``head``."""
        table = view.table
        best: tuple[int, list[Request]] | None = None
        for inst in view.instances.values():
            row = inst.row
            if not alive[row] or not serves(inst.model, head.model) or int(table.mem_limit[row]) < head.context_tokens:
                continue
            at = min(max(int(batch[row]), 1), int(table.max_batch[row]))  # the batch the head would run in
            head_s = remaining_seconds(head, float(table.lat_by_batch[StepCost.RECOMPUTE, row, at]),
                                       float(table.lat_by_batch[StepCost.CACHE, row, at]))
            alpha = float(table.lat_now[StepCost.RECOMPUTE, row])
            beta = float(table.lat_now[StepCost.CACHE, row])
            candidates = []
            for rid in inst.resident_ids:
                r = view.requests[rid]
                if rid in taken or r.status != RequestStatus.READY or r.reloading:
                    continue
                slack = r.budget(now) - remaining_seconds(r, alpha, beta)
                if self._may_yield(r, head, now, slack, head_s):
                    candidates.append((r.priority, -slack, r.seq, r))
            candidates.sort(key=lambda c: c[:3])
            need = head.context_tokens - int(mem_free[row])
            victims, freed = [], 0
            for *_, r in candidates:
                if freed >= need and batch[row] - len(victims) < table.max_batch[row]:
                    break
                victims.append(r)
                freed += r.context_tokens
            if freed < need or batch[row] - len(victims) >= table.max_batch[row]:
                continue
            if best is None or len(victims) < len(best[1]):
                best = (row, victims)
        return best

    def _may_yield(self, victim: Request, head: Request, now: float, victim_slack_s: float, head_s: float) -> bool:
        if victim.num_preemptions >= self.config.max_per_request:
            return False
        if victim.priority != head.priority:
            return victim.priority < head.priority
        return head.deadline < victim.deadline and victim_slack_s - head_s > self.config.slack_margin_s
