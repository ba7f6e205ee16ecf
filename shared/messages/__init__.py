"""Wire messages, one module per boundary (DESIGN section 3), and their codec.

| module | boundary | subject (see ``shared.subjects``) |
|---|---|---|
| ``intake`` | gateway -> scheduler | ``requests`` (JetStream), ``cancel`` |
| ``steps`` | scheduler <-> worker | ``step.<instance>``, ``results`` |
| ``events`` | scheduler/worker -> gateway | ``events.<request id>`` |
| ``predictor`` | scheduler <-> predictor | ``predict`` (request/reply) |
| ``control`` | workers, scheduler, reconfigurator, node agents, operators | ``heartbeat``, ``stats``, ``plans``, ``plans.ack``, ``reconfig.apply`` |

Structs only, a comment per field, enums for kinds, no logic beyond tiny properties.
"""

from shared.messages.base import CacheMode, ConfidenceStats, Message, Part, RequestStatus, StepKind
from shared.messages.codec import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    CodecError,
    MessageError,
    PayloadTooLargeError,
    decode,
    encode,
)

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "CacheMode",
    "CodecError",
    "ConfidenceStats",
    "Message",
    "MessageError",
    "Part",
    "PayloadTooLargeError",
    "RequestStatus",
    "StepKind",
    "decode",
    "encode",
]
