"""The scheduler's commands for the step after the running one, held at the worker (pipelining).

A conditional command (``StepCommand.after_step_id``, sent while that step runs) is held and run the
moment the step ends if the batch is unchanged: no round trip between the two steps (the results'
``continued_step_id`` says so). Where none had come by then (``awaits_held``), the first one for that
step that comes and passes the rule runs on arrival (the scheduler judges the same, and expects its
results). With none in hand, a step repeats where its command allows (``repeats``). The rule itself
(which command runs, rebased how) is ``shared.pipelining``, shared with the simulator; this module
keeps the worker's side of it: which steps are open, the chain, the command awaited.
"""

from __future__ import annotations

import msgspec

from shared.messages.steps import StepCommand, StepResults
from shared.pipelining import held_step, next_step

# a step command and the NATS headers it came with (the trace context of its span)
Held = tuple[StepCommand, dict | None]


class HeldCommands:
    """The held-command state machine of one worker: no NATS, no asyncio; the service asks it what to
    run and runs it."""

    def __init__(self) -> None:
        self._open_steps: set[int] = set()  # steps commanded (or continued into) whose results are not out yet
        self._next: dict[int, Held] = {}  # open step id -> the command for the step after it
        # the chain: the step ids from the last command the scheduler sent that ran, through the
        # repeats run after it, to the latest (a late held command for one of them applies to the latest)
        self._chain = (0, 0)
        self._commanded: set[int] = set()  # plain commands received, not started yet
        # the last step, if it ended with no conditional command in hand (its results say awaits_held):
        # (its command, its results); the first one for it that comes and passes the rule runs then
        self._awaiting: tuple[StepCommand, StepResults] | None = None
        self.num_continued = 0  # steps run from a held conditional command
        self.num_late_next = 0  # conditional commands that came after their step had ended (and did not run)
        self.num_late_held = 0  # steps run from a conditional command that came after its step had ended
        self.num_repeated = 0  # steps run as a held command's repeat (``StepCommand.repeats``), none in hand

    def commanded(self, command: StepCommand) -> None:
        """A plain command with items came: the scheduler decided the next step itself. It opens its step
        and a chain; until it runs, the running step does not repeat."""
        self._awaiting = None
        self._open(command.step_id)
        self._commanded.add(command.step_id)

    def starting(self, command: StepCommand) -> None:
        """``command``'s steps begin (a plain command no longer waits to run)."""
        self._commanded.discard(command.step_id)

    def hold(self, command: StepCommand, headers: dict | None, *, stopping: bool) -> StepCommand | None:
        """Keep a conditional command until the step it follows ends; one for an earlier step of the
        running chain (the worker repeated since) until the chain's step ends. One that comes after
        that step ended with none in hand runs now if it passes the rule (the scheduler, judging the
        same on the results, expects it): returned, to be started at once. Any other late one is
        dropped (its step's results have gone out saying the worker did not go on)."""
        after = command.after_step_id
        first, latest = self._chain
        if after in self._open_steps:
            self._next[after] = (command, headers)
        elif first <= after < latest and latest in self._open_steps:
            self._next[latest] = (command, headers)  # rebased onto it when it ends
        elif self._awaiting is not None and first <= after <= self._awaiting[0].step_id == latest:
            return self._late(command, stopping)
        else:
            self.num_late_next += 1
        return None

    def _late(self, held: StepCommand, stopping: bool) -> StepCommand | None:
        """A conditional command that came after its step ended with none in hand: run it if it passes
        the rule; else a later one for the same step may still (the scheduler sent them in order)."""
        step, results = self._awaiting
        nxt = held_step(step, held, results.results, len(results.failures))
        if nxt is None or stopping:  # stopping: the scheduler hears it leave
            self.num_late_next += 1
            return None
        self._awaiting = None
        self.num_late_held += 1
        self._open(nxt.step_id)
        return nxt

    def step_ended(self, command: StepCommand, results: StepResults, *, ready: bool,
                   listening: bool) -> tuple[StepResults, Held | None]:
        """``command``'s step ended with ``results``: the results to publish (saying whether the worker
        goes on, ``continued_step_id``, or awaits a held command, ``awaits_held``) and the step it goes
        on with. ``ready``: the worker takes steps (not draining or stopping); ``listening``: it hears
        its commands (only then does a step repeat by itself)."""
        nxt = self._take_next(command, results, ready, listening)
        if nxt is not None:
            self.num_continued += 1
            return msgspec.structs.replace(results, continued_step_id=nxt[0].step_id), nxt
        if self._awaiting is not None and self._awaiting[0] is command:
            return msgspec.structs.replace(results, awaits_held=True), None
        return results, None

    def _take_next(self, command: StepCommand, results: StepResults, ready: bool, listening: bool) -> Held | None:
        """The held command for the step after ``command``'s, if nothing about the batch changed
        (``shared.pipelining.next_step``); with none in hand, the step once more where its command
        allows (``repeats``), else it awaits one (``hold``)."""
        held = self._next.pop(command.step_id, None)
        self._open_steps.discard(command.step_id)  # a conditional command arriving from here on is late
        if not ready:
            return None
        if held is None and (self._commanded or not listening):
            nxt = None  # the scheduler sent the next step itself, or cannot be heard: no repeat
        else:
            nxt = next_step(command, held[0] if held is not None else None, results.results, len(results.failures))
        if nxt is None:
            if held is None and command.items:
                self._awaiting = (command, results)
            return None
        if held is None:  # a repeat: the chain goes on
            self.num_repeated += 1
            self._open_steps.add(nxt.step_id)
            self._chain = (self._chain[0], nxt.step_id)
            return nxt, None
        self._open(nxt.step_id)
        return nxt, held[1]

    def failed(self) -> None:
        """A step failed unexpectedly: nothing held goes on after it."""
        self._open_steps.clear()
        self._next.clear()
        self._awaiting = None

    def _open(self, step_id: int) -> None:
        """``step_id`` runs (or will) and starts a chain."""
        self._open_steps.add(step_id)
        self._chain = (step_id, step_id)
