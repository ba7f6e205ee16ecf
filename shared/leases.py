"""Worker leases, the one implementation every reader of heartbeats uses (pure: the caller passes the time).

A ``WorkerHeartbeat`` grants its instance a lease of ``ttl_s`` seconds counted from when the heartbeat
*arrived*, on the receiver's clock. The sender's ``sent_at`` is never used for expiry: hosts' clocks
differ, and a worker whose clock is a minute behind (or ahead) must be neither dropped while it beats
nor kept after it stops. What the receiver's clock may do (the services pass ``time.time``; a test or
the simulator passes its own) only has to be consistent with itself.

Order: heartbeats of one process carry ``seq`` (1, 2, ...) and the process's ``started_at``. A heartbeat
that is not newer than the last one taken from the same process (``seq`` not above it) is ignored, so a
late or duplicated message can neither bring back a status the worker has left (READY after DRAINING)
nor end a lease by a stale STOPPING. A heartbeat with another ``started_at`` comes from a new process
under the same instance id (the node agent restarted it): it replaces the lease (``RESTARTED``) unless
it is older than the current process (a late heartbeat of the process before it). Both processes run
on the same node, so their ``started_at`` come from the same clock. Senders that do not count
(``seq`` 0) are ordered by ``sent_at`` within a process.

A worker that stays alive but whose step never returns keeps its lease (its heartbeats come from
another task); ``step_stuck`` is the test for it, on the worker's own report of how long its step has
been computing (a duration on its monotonic clock, so skew does not enter either).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

from shared.messages.control import WorkerHeartbeat, WorkerStatus

ENDED_MEMORY_TTLS = 10  # an ended lease's last heartbeat is remembered for this many of its TTLs


class Observed(Enum):
    """What a heartbeat did to the table."""

    JOINED = "joined"  # a lease for an instance the table did not hold
    RENEWED = "renewed"  # the same process: lease extended, heartbeat replaced
    RESTARTED = "restarted"  # a new process under a held instance id (its old one's work is lost)
    ENDED = "ended"  # STOPPING: the lease given up (the instance is gone)
    IGNORED = "ignored"  # older than what the table holds, or a STOPPING of an instance it does not hold


@dataclass(frozen=True)
class Lease:
    """An instance's latest heartbeat and how long it lasts."""

    heartbeat: WorkerHeartbeat  # the latest heartbeat taken
    received_at: float  # when it arrived (receiver's clock)
    expires_at: float  # received_at + heartbeat.ttl_s

    @property
    def instance_id(self) -> str:
        return self.heartbeat.instance_id


def is_newer(beat: WorkerHeartbeat, held: WorkerHeartbeat) -> bool:
    """Does ``beat`` come after ``held`` (same instance)? See the module docstring."""
    if beat.started_at != held.started_at:
        return beat.started_at > held.started_at
    if beat.seq and held.seq:
        return beat.seq > held.seq
    return beat.sent_at > held.sent_at


def step_stuck(beat: WorkerHeartbeat, limit_s: float) -> bool:
    """The worker reports a step that has been computing for longer than ``limit_s``."""
    return beat.step_running_s > limit_s


class LeaseTable:
    """The live leases, by instance id. ``observe`` each heartbeat as it arrives, ``expire`` periodically."""

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}  # instance id -> its lease
        # instance id -> the STOPPING heartbeat that ended its lease (so a late READY of that process
        # does not bring it back); kept for ENDED_MEMORY_TTLS lease lengths
        self._ended: dict[str, Lease] = {}

    def observe(self, beat: WorkerHeartbeat, now: float) -> Observed:
        held = self._leases.get(beat.instance_id)
        last = held or self._ended.get(beat.instance_id)
        if last is not None and not is_newer(beat, last.heartbeat):
            return Observed.IGNORED
        self._ended.pop(beat.instance_id, None)
        if beat.status == WorkerStatus.STOPPING:
            if held is None:
                return Observed.IGNORED
            del self._leases[beat.instance_id]
            self._ended[beat.instance_id] = Lease(beat, now, now + ENDED_MEMORY_TTLS * beat.ttl_s)
            return Observed.ENDED
        self._leases[beat.instance_id] = Lease(beat, now, now + beat.ttl_s)
        if held is None:
            return Observed.JOINED
        return Observed.RESTARTED if beat.started_at != held.heartbeat.started_at else Observed.RENEWED

    def expire(self, now: float) -> list[Lease]:
        """Remove and return the leases that ran out at ``now`` (by instance id)."""
        for instance_id in [i for i, ended in self._ended.items() if ended.expires_at <= now]:
            del self._ended[instance_id]
        gone = sorted(i for i, lease in self._leases.items() if lease.expires_at <= now)
        return [self._leases.pop(i) for i in gone]

    def live(self, now: float) -> list[WorkerHeartbeat]:
        """Heartbeats of the instances whose lease has not run out, by instance id (expires the rest)."""
        self.expire(now)
        return [self._leases[i].heartbeat for i in sorted(self._leases)]

    def get(self, instance_id: str) -> Lease | None:
        return self._leases.get(instance_id)

    def drop(self, instance_id: str) -> Lease | None:
        """Forget an instance (its lease ends now)."""
        return self._leases.pop(instance_id, None)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease]:
        return iter([self._leases[i] for i in sorted(self._leases)])
