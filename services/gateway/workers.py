"""Which workers are alive, from their heartbeats (pure: the caller passes the time).

The leases are ``shared.leases.LeaseTable``'s (counted from receipt, not from the worker's clock;
late heartbeats ignored; STOPPING ends a lease at once); this adds the gateway's question: which live
instances take steps for a model.
"""

from __future__ import annotations

from shared.leases import LeaseTable
from shared.messages.control import WorkerHeartbeat, WorkerStatus


class WorkerRegistry(LeaseTable):
    """The latest heartbeat per instance, for as long as its lease lasts."""

    def ready(self, now: float, model: str | None = None) -> list[WorkerHeartbeat]:
        """Live instances taking steps (status READY), serving ``model`` when given."""
        return [hb for hb in self.live(now)
                if hb.status == WorkerStatus.READY and (model is None or hb.model == model)]
