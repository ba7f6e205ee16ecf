"""Every decision about a step, in one place: ``StepScheduler`` turns events into step commands.

The policy (``SchedulingLoop`` over a ``Policy``) decides admission, thresholds, placement and
migration. Around it, this module decides what a step *is* and when it goes:

- **batch composition**: an idle instance's next command carries every request on it whose next step
  is assigned (RUNNING or MIGRATING) and whose state is not being reloaded, at its threshold and
  stored state version, ``load_state`` where the instance does not hold its latest state; the
  instance a request left is told to drop its copy (``dispatch``);
- **overlap** (``StepConfig.overlap_min_tokens``): an instance whose requests simply go on gets its
  next command before the scheduling pass (``SchedulingLoop.continue_steps``); the pass and the
  continued requests' next thresholds (``SchedulingLoop.replan``) come after (``finish_results``);
- **pipelining** (``StepConfig.pipelining``, with overlap): while a step runs, the command for the
  step after it (``StepCommand.after_step_id``), at the thresholds chosen so far, where a pass could
  not place anything else on that instance: sent with the step, and as soon as the worker is known
  to have gone on by itself (the critical path), and again when ``replan`` changed a threshold or a
  request was placed there meanwhile (it joins the held step). So a pipelined step runs at the
  thresholds replanned after the step before last (two before, when the replanned command comes
  after the step it follows has ended). Not after a short answer's first step, whose threshold is
  provisional (``_waits_for_plan``): its second step waits for the pass that plans it;
- **catch-up**: a worker that went on by itself (``BatchOutcome.continued_step_id``) is mirrored in
  the view at the thresholds it ran; a lost or failed step is re-run once the driver has reloaded the
  request's stored state (``reloaded``: counters catch up with steps stored but never reported).

Two calls per batch of step results, as the live service needs them: ``on_results`` (the critical
path: record, release or continue, dispatch) and ``finish_results`` (after the fresh predictions:
the pass, replan, the held commands). Every other event is one call. Each returns ``StepDecisions``:
wire ``StepCommand``s to carry out in order, rejections, migrations, requests whose state must be
reloaded, instances drained and removed. No I/O, no clock: ``now`` is passed in. The scheduler
service translates NATS and Redis to these calls; the simulator makes the same calls on virtual time
and runs the commands on its engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.scheduler.core.decisions import BatchOutcome, Decisions, Preemption, Rejection, StepAssignment
from services.scheduler.core.loop import Continuation, SchedulingLoop
from services.scheduler.core.request import CacheMode, Prediction, Request, RequestStatus
from shared.messages.predictor import PredictionQuery
from shared.messages.steps import StepCommand, StepItem
from shared.pipelining import DEFAULT_HELD_REPEATS, held_step_after
from shared.profiles import LatencyProfile

_RUNNABLE = (RequestStatus.RUNNING, RequestStatus.MIGRATING)


@dataclass(frozen=True, slots=True)
class StepConfig:
    """How steps follow each other (the live defaults: ``DLS_SCHEDULER_OVERLAP_MIN_TOKENS``,
    ``DLS_SCHEDULER_PIPELINE_STEPS``, ``DLS_SCHEDULER_HELD_REPEATS``)."""

    overlap_min_tokens: int = 32  # overlap: continue instances whose requests have this many tokens to go; 0: off
    pipelining: bool = True  # send the step after the running one in advance (needs overlap)
    held_repeats: int = DEFAULT_HELD_REPEATS  # pipelining: steps a command may repeat with none newer in hand
    # the recompute tokens one step carries: None, each instance's profile's budget
    # (``LatencyProfile.recompute_token_budget``); 0, no cap
    recompute_tokens: int | None = None
    # a short answer's second step waits for the pass that plans it with its first prediction
    # (``_waits_for_plan``); off, it is held ahead at the first step's provisional threshold
    first_step_waits: bool = True

    @property
    def overlap(self) -> bool:
        return self.overlap_min_tokens > 0

    @property
    def pipelines(self) -> bool:
        return self.pipelining and self.overlap


@dataclass(slots=True)
class StepDecisions:
    """What one event decided, for the driver to carry out."""

    commands: list[StepCommand] = field(default_factory=list)  # in order; ``after_step_id`` ones are held
    rejections: list[Rejection] = field(default_factory=list)
    migrations: list[StepAssignment] = field(default_factory=list)
    reload_ids: list[str] = field(default_factory=list)  # read these back from the store, then ``reloaded``
    removed_ids: list[str] = field(default_factory=list)  # drained instances now out of the view
    preemptions: list[Preemption] = field(default_factory=list)  # requests that yielded their KV memory

    def extend(self, other: StepDecisions) -> StepDecisions:
        self.commands += other.commands
        self.rejections += other.rejections
        self.preemptions += other.preemptions
        self.migrations += other.migrations
        self.reload_ids += other.reload_ids
        self.removed_ids += other.removed_ids
        return self


@dataclass(slots=True)
class PendingResults:
    """Step results recorded by ``on_results`` whose scheduling pass is still owed (``finish_results``)."""

    instance_ids: list[str]  # instances whose results these were
    stepped_ids: list[str]  # requests that stepped and go on (ask for their predictions)
    continuation: Continuation | None = None  # overlap: what went on before the pass

    def merge(self, later: PendingResults) -> None:
        """Owe one pass for both (results handled one after the other before their pass ran: the pass
        re-plans all their requests at once, as for results that arrived together)."""
        self.instance_ids = list(dict.fromkeys(self.instance_ids + later.instance_ids))
        self.stepped_ids = list(dict.fromkeys(self.stepped_ids + later.stepped_ids))
        if self.continuation is not None and later.continuation is not None:
            self.continuation.merge(later.continuation)
        else:  # one of them owes a full pass (no continuation): the merged one does
            self.continuation = self.continuation or later.continuation
            if self.continuation is not None:
                self.continuation.needs_pass = True


@dataclass(slots=True)
class ResultsPass:
    decisions: StepDecisions  # to carry out now (the continued steps)
    pending: PendingResults
    ignored: list[tuple[str, int]] = field(default_factory=list)  # (instance id, step id): not the step in flight
    notes: list[str] = field(default_factory=list)  # what the driver may want to log


@dataclass(frozen=True, slots=True)
class StoredProgress:
    """A request's counters as the store holds them (what ``reloaded`` catches up with)."""

    version: int
    num_steps: int
    num_committed: int
    current_block: int


@dataclass(slots=True)
class InstanceSteps:
    """An instance as the step loop uses it."""

    busy_step_id: int | None = None  # the command in flight
    busy_since: float = 0.0  # when it was sent (or continued into)
    settling: bool = False  # its results are in, their pass is owed: it takes no command yet
    in_flight_ids: list[str] = field(default_factory=list)  # the requests of that command
    drop_ids: list[str] = field(default_factory=list)  # to drop with the next command
    # pipelining: held commands sent for the step after the one in flight: step id -> ((request id,
    # threshold, may start a block) items, drop_finished, the command), in the order sent; and the
    # latest one's id (0: none)
    next_sent: dict[int, tuple[list[tuple[str, float, bool]], bool, StepCommand]] = field(default_factory=dict)
    next_step_id: int = 0
    # repeats: the thresholds of the held command the running step came from, and how many more times
    # its worker may run it with no newer command in hand; the held commands sent since that command
    # ran stay in ``next_sent`` while the worker repeats (a late one applies to the chain's latest step)
    chain_thresholds: dict[str, float] = field(default_factory=dict)
    repeats_left: int = 0


class StepScheduler:
    """The scheduling core: events in, ``StepDecisions`` out (module docstring)."""

    def __init__(self, loop: SchedulingLoop, config: StepConfig | None = None, first_step_id: int = 0) -> None:
        """``first_step_id``: step ids count up from here (the service starts at its clock in
        microseconds, so a restarted scheduler never reuses an id a worker may still answer)."""
        self.loop = loop
        self.view = loop.view
        self.config = config or StepConfig()
        self._step_seq = first_step_id
        self._instances: dict[str, InstanceSteps] = {}  # instance id -> its step state
        self._dirty: dict[str, None] = {}  # instances that may have a command to send (ordered set)
        self._resend: dict[str, None] = {}  # busy ones among them whose held command may have changed
        self.counters = {"continued_steps": 0, "pipelined_steps": 0, "late_held_steps": 0, "migrations": 0,
                         "failed_steps": 0, "lost_steps": 0, "recovered_steps": 0, "preemptions": 0,
                         "kv_refused_steps": 0, "repeated_steps": 0, "recomputes_deferred": 0,
                         "late_yields": 0}
        self._budgets: dict[str, int] = {}  # instance id -> its profile's recompute token budget

    # --- events ----------------------------------------------------------------------------------

    def on_arrivals(self, now: float, requests: list[Request]) -> StepDecisions:
        return self._carry(now, self.loop.on_arrivals(now, requests))

    def tick(self, now: float) -> StepDecisions:
        return self._carry(now, self.loop.tick(now))

    def on_prediction(self, now: float, request_id: str, prediction: Prediction) -> None:
        self.loop.on_prediction(now, request_id, prediction)

    def add_instance(self, now: float, instance_id: str, tp: int, profile: LatencyProfile, *, node_id: str = "",
                     max_batch: int | None = None, mem_limit_tokens: int | None = None,
                     model: str = "") -> StepDecisions:
        """``mem_limit_tokens``: the KV tokens it holds (its worker's budget); None: the view's default.
        ``model``: the model it serves (only that model's requests run there: ``view.serves``)."""
        self.view.add_instance(instance_id, tp, profile, node_id=node_id, max_batch=max_batch,
                               mem_limit_tokens=mem_limit_tokens, model=model)
        self._instances[instance_id] = InstanceSteps()
        return self.tick(now)

    def drain_instance(self, now: float, instance_id: str) -> StepDecisions:
        """Take no new work there; its requests move away at their next step; removed once empty."""
        inst = self.view.instances.get(instance_id)
        if inst is None or not inst.alive:
            return StepDecisions()
        self.view.drain_instance(instance_id)
        return self.tick(now).extend(self._check_drained(now, instance_id))

    def fail_instance(self, now: float, instance_id: str) -> StepDecisions:
        """An instance gone (lease expired, restarted, step timed out): its requests go back to the
        queue; those whose step was running there are reloaded before they run again."""
        self._instances.pop(instance_id, None)
        self._dirty.pop(instance_id, None)
        if instance_id not in self.view.instances:
            return StepDecisions()
        lost = self.view.fail_instance(instance_id)
        self.counters["lost_steps"] += len(lost)
        return StepDecisions(reload_ids=lost).extend(self.tick(now))

    def cancel(self, now: float, request_id: str, detail: str) -> StepDecisions:
        """A request cancelled: it leaves the view; its holder drops its copy."""
        request = self.view.requests.get(request_id)
        if request is None:
            return StepDecisions()
        holder = self._instances.get(request.holder_id or "")
        if holder is not None:
            holder.drop_ids.append(request_id)
            self._dirty[request.holder_id] = None
        self.view.cancel_request(request_id, now, detail=detail)
        return self.tick(now)

    def reloaded(self, now: float, request_id: str, stored: StoredProgress | None) -> StepDecisions:
        """A lost or failed request's stored state, read back (None: gone, or finished while its
        result was lost): it runs again from there, or the view forgets it."""
        request = self.view.requests.get(request_id)
        if request is None:
            return StepDecisions()
        if stored is None:
            if request.status in (RequestStatus.QUEUED, RequestStatus.READY):
                self.view.cancel_request(request_id, now, detail="finished while its result was lost")
        else:
            self.counters["recovered_steps"] += self.view.reloaded(
                request_id, stored.version, stored.num_steps, stored.num_committed, stored.current_block)
            if request.instance_id is not None:  # placed while it waited: runnable now
                self._dirty[request.instance_id] = None
        return self.tick(now)

    def overdue(self, now: float, timeout_s: float) -> list[str]:
        """Instances whose step has been in flight longer than ``timeout_s`` (lost on the way)."""
        return [iid for iid, st in self._instances.items()
                if st.busy_step_id is not None and not st.settling and now - st.busy_since > timeout_s]

    def busy(self, instance_id: str) -> bool:
        st = self._instances.get(instance_id)
        return st is not None and st.busy_step_id is not None

    # --- step results ----------------------------------------------------------------------------

    def on_results(self, now: float, results: list[BatchOutcome]) -> ResultsPass:
        """Step results that arrived together, on the critical path: recorded (finished requests
        leave; failed ones wait for their reload), each instance released, or kept busy with the step
        its worker went on to by itself; with overlap, instances whose requests simply go on continue
        now. The pass is owed: ``finish_results``."""
        out = ResultsPass(StepDecisions(), PendingResults([], []))
        accepted = []
        for result in results:
            st = self._instances.get(result.instance_id)
            if st is None or st.busy_step_id != result.step_id or st.settling:
                out.ignored.append((result.instance_id, result.step_id))
            else:
                accepted.append(result)
        if not accepted:
            return out
        self.loop.record(now, accepted)
        running = {}  # instance id -> (request id, threshold) pairs its worker went on with
        for result in accepted:
            out.decisions.reload_ids += self._requeue_failed(result)
            pairs = self._release(now, result, out.notes)
            if pairs is not None:
                running[result.instance_id] = pairs
            out.pending.instance_ids.append(result.instance_id)
            out.pending.stepped_ids += [o.request_id for o in result.outcomes
                                        if not o.finished and o.request_id in self.view.requests]
        if self.config.overlap or running:
            cont = self.loop.continue_steps(now, out.pending.instance_ids, self.config.overlap_min_tokens, running)
            continued = dict.fromkeys(a.instance_id for a in cont.decisions.assignments)
            self.counters["continued_steps"] += len(continued)
            for iid in continued:
                self._settle(iid)
            out.pending.continuation = cont
            out.decisions.extend(self._carry(now, cont.decisions))
        return out

    def finish_results(self, now: float, pending: PendingResults,
                       predictions: Mapping[str, Prediction] | None = None) -> StepDecisions:
        """The scheduling pass owed to ``on_results``, with the fresh predictions; then, with overlap,
        the continued requests' thresholds for the step after (``replan``) and their held commands."""
        for rid, prediction in (predictions or {}).items():
            self.loop.on_prediction(now, rid, prediction)
        for iid in pending.instance_ids:
            self._settle(iid)
        cont = pending.continuation
        if cont is None or cont.needs_pass or self.view.ready_ids:
            out = self.tick(now)
        else:  # no pass, but a freed instance may hold requests a pass assigned it while it was busy
            out = StepDecisions(commands=self._dispatch(now))
        if cont is not None and cont.continued_ids:
            self.loop.replan(now, cont.continued_ids)
            if self.config.pipelines:  # the step after the continued ones, at the thresholds replan chose
                for iid in dict.fromkeys(a.instance_id for a in cont.decisions.assignments):
                    out.commands += self._send_next(now, iid)
        for iid in pending.instance_ids:
            out.extend(self._check_drained(now, iid))
        return out

    def queries(self, request_ids: list[str]) -> list[PredictionQuery]:
        """The predictor's queries for these requests between steps (the service's and the simulator's)."""
        queries = []
        for rid in request_ids:
            r = self.view.requests.get(rid)
            if r is None:
                continue
            block_index, block_size, block_committed = r.last_block
            queries.append(PredictionQuery(
                request_id=rid, num_steps_done=r.num_steps_done, gen_length=r.gen_len, prompt_length=r.prompt_len,
                block_length=r.block_len, num_committed=r.num_tokens_committed, block_committed=block_committed,
                block_size=block_size, block_index=block_index, confidence=r.confidence,
                uses_cache=r.cache_mode != CacheMode.NONE, threshold=r.threshold, predicted_end=r.predicted_end,
                model=r.model,  # its own model's predictor answers ("": the predictor's first)
            ))
        return queries

    # --- helpers ---------------------------------------------------------------------------------

    def _requeue_failed(self, result: BatchOutcome) -> list[str]:
        """Failed requests wait for their reload; those the worker's KV budget refused go back to the
        queue (a preemption: placed again where memory allows)."""
        failed = [rid for rid in result.failed_ids if rid in self.view.requests]
        for rid in failed:
            self.view.requeue_request(rid)
        self.counters["failed_steps"] += len(failed)
        refused = [rid for rid in result.kv_full_ids if rid in self.view.requests]
        for rid in refused:
            self._drop_preempted(self.loop.preempt(rid))
        self.counters["kv_refused_steps"] += len(refused)
        return failed

    def _drop_preempted(self, preemption: Preemption) -> None:
        """A request that yielded its memory: its holder drops its copy and KV cache with its next
        command; the instance it left may take queued work."""
        self.counters["preemptions"] += 1
        holder = self._instances.get(preemption.holder_id or "")
        if holder is not None and preemption.request_id not in holder.drop_ids:
            holder.drop_ids.append(preemption.request_id)
            self._dirty[preemption.holder_id] = None
        if preemption.instance_id in self.view.instances:
            self._dirty[preemption.instance_id] = None

    def _release(self, now: float, result: BatchOutcome, notes: list[str]) -> list[tuple[str, float]] | None:
        """Free the instance after its step, or keep it busy with the held command its worker ran (or
        runs on arrival: ``_late_held``); returns that command's (request id, threshold) pairs, None
        when the worker does not go on."""
        st = self._instances[result.instance_id]
        sent = st.next_sent
        continued_id = result.continued_step_id or self._late_held(st, sent, result)
        finished = {o.request_id for o in result.outcomes if o.finished}  # left out of the step after
        if continued_id and continued_id not in sent and continued_id == result.step_id + 1 and st.repeats_left > 0:
            # the worker ran the step again (none in hand): the held commands sent still apply
            st.repeats_left -= 1
            pairs = [(rid, st.chain_thresholds[rid]) for rid in st.in_flight_ids if rid not in finished]
            st.busy_step_id, st.busy_since = continued_id, now
            st.in_flight_ids = [rid for rid, _ in pairs]
            self.counters["repeated_steps"] += 1
            return pairs
        st.next_sent, st.next_step_id = {}, 0
        st.chain_thresholds, st.repeats_left = {}, 0
        if not continued_id:
            # freed once its pass is done (finish_results), or now if overlap continues it: a command
            # sent before the pass would carry only the requests placed there earlier, and the rest
            # would wait a step (an instance's requests taking turns in two half batches)
            st.settling = True
            return None
        items, _, command = sent.get(continued_id, (None, True, None))
        if command is not None and command.drop_request_ids:  # the worker dropped them as it went on
            st.drop_ids = [rid for rid in st.drop_ids if rid not in command.drop_request_ids]
        if items is None:  # only across a scheduler restart: go by the step's own requests
            notes.append(f"instance {result.instance_id} went on to step {continued_id}, which this "
                         "scheduler did not send")
            items = [(rid, float(r.threshold), False) for rid in st.in_flight_ids
                     if (r := self.view.requests.get(rid)) is not None and r.threshold is not None]
        # a held command sent for an earlier step of the chain drops what finished in it (``rebase``)
        here = set(st.in_flight_ids) | {it.request_id for it in command.items if it.load_state} if command else None
        pairs = [(rid, threshold) for rid, threshold, _ in items
                 if rid not in finished and (here is None or rid in here)]
        if command is not None and command.repeats > 0:
            st.chain_thresholds, st.repeats_left = dict(pairs), command.repeats
        st.busy_step_id, st.busy_since = continued_id, now
        st.in_flight_ids = [rid for rid, _ in pairs]
        self.counters["pipelined_steps" if result.continued_step_id else "late_held_steps"] += 1
        return pairs

    def _late_held(self, st: InstanceSteps, sent: dict, result: BatchOutcome) -> int:
        """The held command the worker runs when it arrives, after the step it follows ended with none
        in hand (``awaits_held``): the first sent that passes the rule on these results (0: none)."""
        if not result.awaits_held:
            return 0
        num_failed = len(result.failed_ids) + len(result.kv_full_ids)
        for _, _, command in sent.values():
            if held_step_after(len(st.in_flight_ids), command, result.outcomes, num_failed,
                               rebase=command.after_step_id != result.step_id) is not None:
                return command.step_id
        return 0

    def _settle(self, instance_id: str) -> None:
        """An instance whose results are in is free for its next command."""
        st = self._instances.get(instance_id)
        if st is not None and st.settling:
            st.settling, st.busy_step_id, st.in_flight_ids = False, None, []
            self._dirty[instance_id] = None

    def _carry(self, now: float, decisions: Decisions) -> StepDecisions:
        """A policy's decisions as step decisions: the preemptions' drops and the migrations noted, then
        every command due."""
        out = StepDecisions(rejections=list(decisions.rejections), preemptions=list(decisions.preemptions))
        for preemption in decisions.preemptions:
            self._drop_preempted(preemption)
        for a in decisions.assignments:
            self._dirty[a.instance_id] = None
            self._resend[a.instance_id] = None
            if a.is_migration:
                out.migrations.append(a)
                self.counters["migrations"] += 1
        out.commands = self._dispatch(now)
        for a in out.migrations:  # a draining instance may have lost its last request
            if a.from_instance_id:
                out.extend(self._check_drained(now, a.from_instance_id))
        return out

    def _dispatch(self, now: float) -> list[StepCommand]:
        """A command for every idle instance with runnable requests; drop-only commands for idle
        instances that requests left; after them, the held command for the step after the running one
        on busy instances that requests were placed on or continued on since it was sent."""
        commands, held = [], []
        dirty, self._dirty = self._dirty, {}
        resend, self._resend = self._resend, {}
        for iid in dirty:
            st = self._instances.setdefault(iid, InstanceSteps()) if iid in self.view.instances else None
            if st is None or st.busy_step_id is not None:
                if st is not None:
                    self._dirty[iid] = None  # busy: looked at again when it is released
                    if iid in resend:
                        held += self._send_next(now, iid)
                continue
            items = self._batch(now, iid)
            if items or st.drop_ids:
                commands += self._send(now, iid, st, items)
        return commands + held

    def recompute_budget(self, instance_id: str) -> int:
        """The recompute tokens a step on this instance carries at most (0: no cap)."""
        if self.config.recompute_tokens is not None:
            return self.config.recompute_tokens
        inst = self.view.instances.get(instance_id)
        if inst is None:
            return 0
        budget = self._budgets.get(instance_id)
        if budget is None:
            budget = self._budgets[instance_id] = inst.profile.recompute_token_budget(inst.tp)
        return budget

    def _over_budget(self, now: float, instance_id: str, starting: list[Request], spent: int = 0) -> set[str]:
        """Of these requests, whose next steps would start blocks with a recompute, those that wait
        for a later step under the instance's recompute budget: in order of deadline, those that can
        no longer make theirs last (fewer seconds left than their block starts take at batch 1), the
        first ones whose contexts fit beside the ``spent`` tokens go (at least one, where nothing was spent);
        the rest are served in turn by the next steps, instead of all at once in one compute-bound
        step whose latency grows with them and whose throughput does not."""
        budget = self.recompute_budget(instance_id)
        if budget <= 0 or spent + sum(r.context_tokens for r in starting) <= budget:
            return set()
        waiting = set()
        inst = self.view.instances[instance_id]
        full = inst.profile.alpha(inst.tp, 1)  # each block start left takes at least this

        def hopeless(r: Request) -> bool:
            return r.deadline < now + full * max(r.max_remaining_recompute_steps, 1)

        for r in sorted(starting, key=lambda r: (hopeless(r), r.deadline, r.request_id)):
            if spent and spent + r.context_tokens > budget:
                waiting.add(r.request_id)
            else:
                spent += r.context_tokens
        return waiting

    @staticmethod
    def _starts_block(r: Request) -> bool:
        """Its next step is a block-start recompute (with a cache: without one every step is full)."""
        return r.cache_mode != CacheMode.NONE and r.num_block_steps == 0

    def _runnable(self, instance_id: str) -> list[Request]:
        """The requests on the instance whose next step is assigned and whose state is in place."""
        return [r for rid in self.view.instances[instance_id].resident_ids
                if (r := self.view.requests[rid]).status in _RUNNABLE and not r.reloading]

    def _batch(self, now: float, instance_id: str) -> list[StepItem]:
        """Batch composition: the requests on the instance whose next step is assigned, less those the
        policy leaves out (``SchedulingLoop.yielding``: late ones, while others can make their
        deadlines) and the block starts over its recompute budget (``_over_budget``); both go in a
        later step."""
        items = []
        runnable = self._runnable(instance_id)
        yielding = self.loop.yielding(now, instance_id, runnable)
        if yielding:
            self.counters["late_yields"] += len(yielding)
            runnable = [r for r in runnable if r.request_id not in yielding]
        later = self._over_budget(now, instance_id, [r for r in runnable if self._starts_block(r)])
        if later:
            self.counters["recomputes_deferred"] += len(later)
        for r in runnable:
            rid = r.request_id
            if rid in later:
                continue
            items.append(StepItem(request_id=rid, threshold=float(r.threshold), state_version=r.state_version,
                                  load_state=r.holder_id != instance_id))
            old = self._instances.get(r.holder_id) if r.holder_id not in (None, instance_id) else None
            if old is not None and rid not in old.drop_ids:
                old.drop_ids.append(rid)
                self._dirty[r.holder_id] = None
        return items

    def _send(self, now: float, instance_id: str, st: InstanceSteps, items: list[StepItem]) -> list[StepCommand]:
        self._step_seq += 1
        step_id = self._step_seq
        repeats = self.config.held_repeats if items and self.config.pipelines else 0
        self._step_seq += repeats  # the repeats' step ids
        command = StepCommand(instance_id=instance_id, step_id=step_id, items=items, repeats=repeats,
                              drop_request_ids=st.drop_ids, issued_at=now, num_queued=self.view.num_queued)
        st.drop_ids = []
        if not items:
            return [command]
        st.busy_step_id, st.busy_since = step_id, now
        st.in_flight_ids = [it.request_id for it in items]
        st.next_step_id, st.next_sent = 0, {}
        st.chain_thresholds = {it.request_id: it.threshold for it in items}
        st.repeats_left = repeats
        return [command, *self._send_next(now, instance_id)]

    def _send_next(self, now: float, instance_id: str) -> list[StepCommand]:
        """Pipelining: the command for the step after the one in flight, at the requests' current
        thresholds. The worker runs it the moment its step ends if the batch is unchanged: a request
        that completed its block goes on only if the policy would keep it here at its block start
        (``may_start_block``, asked now); one that finished is left out when the queue is empty
        (``drop_finished``: no one waits for its slot), else the worker waits for a pass. Requests
        placed there while the step runs, new to the instance (no holder), join it: loaded from the
        store, as the pass's command would load them, so an arrival costs the instance no round
        trip. Sent only where a pass could not place anything else there: every request on the
        instance is in the step or joins it, and the queue is empty or the instance full. Sent
        again when its batch or thresholds changed (a later held command replaces the earlier). It may
        run again ``StepConfig.held_repeats`` times; where none can be sent and the running step may
        repeat, a held command of no items says to wait for the pass instead."""
        st = self._instances.get(instance_id)
        if st is None or st.busy_step_id is None or st.settling or not self.config.pipelines:
            return []
        pairs = self._held_pairs(now, instance_id, st)
        if pairs is None:
            latest = st.next_sent[st.next_step_id][2] if st.next_step_id else None
            if not st.repeats_left or (latest is not None and (latest.after_step_id == st.busy_step_id
                                                               or not latest.items)):
                return []  # nothing may go on by itself, or what was sent for this step stands
            pairs = []  # no repeat, nor a command sent for an earlier step of the chain: wait for the pass
        drop_finished = self.view.num_queued == 0
        if st.next_step_id and st.next_sent[st.next_step_id][:2] == (pairs, drop_finished):
            return []  # the held command is already this one
        self._step_seq += 1
        step_id = self._step_seq
        repeats = self.config.held_repeats if pairs else 0
        self._step_seq += repeats  # the repeats' step ids
        # the step in flight writes one version on top of the one it started from; joiners start
        # from their stored version
        num_stepping = len(st.in_flight_ids)
        items = []
        for i, (rid, threshold, may_start) in enumerate(pairs):
            r = self.view.requests[rid]
            items.append(StepItem(request_id=rid, threshold=threshold, may_start_block=may_start,
                                  state_version=r.state_version + (i < num_stepping), load_state=i >= num_stepping,
                                  context_tokens=r.context_tokens if r.cache_mode != CacheMode.NONE else 0))
        # requests that left the instance go with it (kept here until it is known to have run: a held
        # command that does not run leaves them to the next command)
        command = StepCommand(instance_id=instance_id, step_id=step_id, items=items, issued_at=now,
                              after_step_id=st.busy_step_id, drop_finished=drop_finished, repeats=repeats,
                              drop_request_ids=list(st.drop_ids) if items else [], num_queued=self.view.num_queued,
                              recompute_tokens=self._held_room(instance_id, pairs, num_stepping) if pairs else 0)
        st.next_step_id = step_id
        st.next_sent[step_id] = (pairs, drop_finished, command)
        return [command]

    def _held_pairs(self, now: float, instance_id: str, st: InstanceSteps) -> list[tuple[str, float, bool]] | None:
        """The held command's (request id, threshold, may start a block) items for the step after the
        running one, or None where a pass could place something else there (``_send_next``) or a
        request of the step waits for its plan (``_waits_for_plan``)."""
        inst = self.view.instances.get(instance_id)
        if inst is None or not inst.alive or (self.view.num_queued > 0 and inst.batch < inst.max_batch):
            return None
        in_flight = set(st.in_flight_ids)
        # requests the policy leaves out of the next step stay out of the held one too (those of the
        # running step go on in it: one step, which the pass after it corrects)
        yielding = self.loop.yielding(now, instance_id, self._runnable(instance_id)) - in_flight
        joining = [rid for rid in inst.resident_ids if rid not in in_flight and rid not in yielding]
        if len(inst.resident_ids) - len(joining) - len(yielding) != len(st.in_flight_ids):
            return None  # a request of the step left the instance: the pass decides what comes next
        stays = self.loop.would_stay(instance_id, st.in_flight_ids)
        pairs = []
        for rid in st.in_flight_ids:
            r = self.view.requests.get(rid)
            if (r is None or r.reloading or r.instance_id != instance_id or r.status != RequestStatus.RUNNING
                    or r.threshold is None or self._waits_for_plan(r)):
                return None
            pairs.append((rid, float(r.threshold), rid in stays))
        joiners = []
        for rid in joining:
            r = self.view.requests[rid]
            if r.status not in _RUNNABLE or r.reloading or r.holder_id is not None or r.threshold is None:
                return None
            pairs.append((rid, float(r.threshold), False))
            joiners.append(r)
        if self._over_budget(now, instance_id, [r for r in joiners if self._starts_block(r)]):
            return None  # the joiners' recomputes alone exceed the budget: the pass composes the step
        return pairs

    def _held_room(self, instance_id: str, pairs: list[tuple[str, float, bool]], num_stepping: int) -> int:
        """The held command's ``recompute_tokens``: the instance's recompute budget less the block
        starts of the requests joining it (at least 1: a cap; 0, none). Whether the requests of the
        running step that complete their blocks fit is the worker's to judge, which knows which did
        (``shared.pipelining``)."""
        budget = self.recompute_budget(instance_id)
        if not budget:
            return 0
        joining = [self.view.requests[rid] for rid, _, _ in pairs[num_stepping:]]
        return max(budget - sum(r.context_tokens for r in joining if self._starts_block(r)), 1)

    def _waits_for_plan(self, request: Request) -> bool:
        """A request whose step runs at a provisional threshold (its first, before any prediction:
        ``SchedulingLoop.provisional``) with fewer tokens to go than overlap continues (a short answer,
        whose blocks take a few steps): its next step waits for the pass that plans it with its first
        prediction instead of going on at the stale threshold, which would be most of its block. A
        longer one goes on (one stale step among many: overlap's own trade for the pass's latency)."""
        return (self.config.first_step_waits and request.num_remaining_tokens < self.config.overlap_min_tokens
                and self.loop.provisional(request))

    def _check_drained(self, now: float, instance_id: str) -> StepDecisions:
        """A draining instance with no request left and no step in flight leaves the view."""
        inst = self.view.instances.get(instance_id)
        st = self._instances.get(instance_id)
        if inst is None or inst.alive or inst.batch or (st is not None and st.busy_step_id is not None):
            return StepDecisions()
        self.view.remove_instance(instance_id)
        out = StepDecisions(removed_ids=[instance_id])
        if st is not None and st.drop_ids:
            out.commands += self._send(now, instance_id, st, [])
        return out
