"""Which workers are alive, from their heartbeats (pure: the caller passes the time).

A heartbeat is a lease for ``ttl_s`` seconds. The lease is counted from when the gateway *received*
the heartbeat, not from the worker's ``sent_at``, so clock skew between hosts cannot expire (or
prolong) it; a worker reporting STOPPING gives its lease up at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.messages.control import WorkerHeartbeat, WorkerStatus


@dataclass(frozen=True)
class Lease:
    heartbeat: WorkerHeartbeat  # the latest heartbeat of the instance
    expires_at: float  # receipt time + ttl_s, on the caller's clock


class WorkerRegistry:
    """The latest heartbeat per instance, for as long as its lease lasts."""

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}  # instance id -> its lease

    def observe(self, heartbeat: WorkerHeartbeat, now: float) -> None:
        current = self._leases.get(heartbeat.instance_id)
        if current is not None and heartbeat.sent_at < current.heartbeat.sent_at:
            return  # an older heartbeat overtaken by a newer one
        if heartbeat.status == WorkerStatus.STOPPING:
            self._leases.pop(heartbeat.instance_id, None)
            return
        self._leases[heartbeat.instance_id] = Lease(heartbeat, now + heartbeat.ttl_s)

    def live(self, now: float) -> list[WorkerHeartbeat]:
        """Heartbeats of instances whose lease has not run out, by instance id."""
        for instance_id in [i for i, lease in self._leases.items() if lease.expires_at <= now]:
            del self._leases[instance_id]
        return [self._leases[i].heartbeat for i in sorted(self._leases)]

    def ready(self, now: float, model: str | None = None) -> list[WorkerHeartbeat]:
        """Live instances taking steps (status READY), serving ``model`` when given."""
        return [hb for hb in self.live(now)
                if hb.status == WorkerStatus.READY and (model is None or hb.model == model)]
