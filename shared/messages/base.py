"""The two base classes of every wire struct, and the enums more than one boundary (or core) uses.

``Message``: a top-level message on a subject. Tagged with its class name (field ``message``), so a
subscriber can decode a union of message types and dispatch by type, and a message decoded as the
wrong type fails loudly instead of half-matching.
``Part``: a struct nested inside a message (untagged, so lists of them stay small).

Both are frozen (a message is a fact, not a workspace), keyword-only (field order may change), and
omit default values when encoded. NOTE: msgspec does not inherit ``kw_only``, so every subclass
repeats ``kw_only=True``. Unknown fields are ignored on decode, so a field added with a
default does not break an older reader (rolling upgrades).
"""

from __future__ import annotations

from enum import IntEnum, StrEnum

import msgspec

TAG_FIELD = "message"


class Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag=True, tag_field=TAG_FIELD):
    """A top-level wire message (tagged with its class name)."""


class Part(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A struct nested inside a message."""


class CacheMode(StrEnum):
    """Approximate KV cache of a request (DESIGN section 4): the one definition, used by the wire,
    the engine (``services.worker.engine.engine``) and the scheduler core alike."""

    NONE = "none"  # every step is a full forward
    PREFIX = "prefix"  # recompute at each block start; cache steps run block + suffix
    DUAL = "dual"  # recompute at each block start; cache steps run only the block


class StepKind(IntEnum):
    """What a denoising step computed (the engine reports it per request, the wire carries it)."""

    RECOMPUTE = 0  # full forward over prompt plus canvas (refreshes the cache when caching)
    CACHE = 1  # block (dual) or block plus suffix (prefix) against the cache


class RequestStatus(IntEnum):
    """Where a request is in its life. Terminal states are >= FINISHED.

    The one definition: the scheduler core (which owns the transitions), the Redis record
    (``shared.state.RequestRecord.status``) and the gateway all use it.
    """

    QUEUED = 0  # admitted, on no instance yet (or evicted from a removed one)
    READY = 1  # resident on an instance between steps; its next step is not assigned yet
    RUNNING = 2  # its next step is assigned to (or running on) the instance it lives on
    MIGRATING = 3  # its next step is assigned to another instance; the state moves before it runs
    FINISHED = 4
    REJECTED = 5
    CANCELLED = 6

    @property
    def is_terminal(self) -> bool:
        return self >= RequestStatus.FINISHED


class ConfidenceStats(Part, kw_only=True):
    """Confidences of the current block's positions still masked after a step (1.0 when none).

    Mirrors ``services.worker.engine.request.ConfidenceStats``; ``as_tuple`` is the predictor's order.
    """

    min: float  # lowest confidence
    q25: float  # 25th percentile
    median: float  # 50th percentile
    mean: float  # arithmetic mean
    q75: float  # 75th percentile

    @property
    def as_tuple(self) -> tuple[float, float, float, float, float]:
        return (self.min, self.q25, self.median, self.mean, self.q75)
