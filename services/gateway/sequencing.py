"""Putting a request's events back in order (pure: no NATS, no clock).

Events of one request come from several publishers (the scheduler's accept and final event, the
progress of whichever worker ran each step), so they can arrive twice (a retried publish) or out of
order (two connections). ``seq`` orders them (``shared.messages.events``): accepted 1, progress of
step n is n + 1, the final event num_steps + 2.

A streaming request gets a progress event for every step, so its seqs are contiguous and a gap means
an event still on its way: later events wait for it, until the caller gives up waiting (``flush``,
after a short grace) because the missing one was lost. A ``RequestFailed`` does not wait: it carries
no text, and a request refused before acceptance has no seq 1 at all. A non-streaming request has a
gap between accept and final event by design, so events pass in arrival order, less duplicates and
stragglers.
"""

from __future__ import annotations

from shared.messages.events import RequestEvent, RequestFailed, RequestFinished

TERMINAL_EVENTS = (RequestFinished, RequestFailed)


def is_terminal(event: RequestEvent) -> bool:
    return isinstance(event, TERMINAL_EVENTS)


class EventSequencer:
    """Dedupes and reorders one request's events by ``seq``; ends after the terminal event.

    ``push`` an arriving event and get the events now due, in order; ``flush`` when the gap before
    the held events has lasted too long. Nothing is released after a terminal event (``done``).
    """

    def __init__(self, contiguous: bool) -> None:
        self.contiguous = contiguous  # seqs have no gaps by design (streaming requests)
        self.next_seq = 1  # the seq due next; anything below it is a duplicate or a straggler
        self.done = False  # the terminal event was released
        self._held: dict[int, RequestEvent] = {}  # seq -> event waiting for the gap before it

    @property
    def holding(self) -> bool:
        """Events wait behind a gap (the caller should ``flush`` if nothing arrives soon)."""
        return bool(self._held)

    def push(self, event: RequestEvent) -> list[RequestEvent]:
        if self.done or event.seq < self.next_seq or event.seq in self._held:
            return []
        if not self.contiguous:
            self.next_seq = event.seq
        self._held[event.seq] = event
        if isinstance(event, RequestFailed):
            return self.flush()  # a failure carries no text: waiting for missing progress only delays it
        return self._release()

    def flush(self) -> list[RequestEvent]:
        """Give up on the missing events: release everything held, in order."""
        out: list[RequestEvent] = []
        while self._held and not self.done:
            self.next_seq = min(self._held)
            out.extend(self._release())
        return out

    def _release(self) -> list[RequestEvent]:
        out: list[RequestEvent] = []
        while self.next_seq in self._held:
            event = self._held.pop(self.next_seq)
            out.append(event)
            self.next_seq += 1
            if is_terminal(event):
                self.done = True
                self._held.clear()
                break
        return out
