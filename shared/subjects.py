"""Every NATS subject and stream name, built by one helper under one configurable prefix.

| subject | carries | pattern |
|---|---|---|
| ``<p>.requests`` | ``CompletionRequest`` | JetStream stream ``<P>_REQUESTS``, work-queue retention |
| ``<p>.requests.<shard>`` | ``CompletionRequest`` | the same stream, with several scheduler shards |
| ``<p>.cancel`` | ``CancelRequest`` | publish/subscribe |
| ``<p>.step.<instance id>`` | ``StepCommand`` | publish/subscribe, one subject per instance |
| ``<p>.results`` (``.<shard>``) | ``StepResults`` | publish/subscribe (per scheduler shard when sharded) |
| ``<p>.events.<request id>`` | ``RequestEvent`` | publish/subscribe, one subject per request |
| ``<p>.predict`` | ``PredictRequest`` -> ``PredictReply`` | request/reply (queue group) |
| ``<p>.heartbeat`` | ``WorkerHeartbeat`` | publish/subscribe |
| ``<p>.stats`` | ``WorkloadStats`` | publish/subscribe |
| ``<p>.plans`` | ``ReconfigPlan`` | publish/subscribe |
| ``<p>.plans.ack`` | ``PlanAck`` | publish/subscribe |
| ``<p>.reconfig.apply`` | ``ApplyConfiguration`` -> ``ApplyConfigurationReply`` | request/reply (operator) |
"""

from __future__ import annotations

import re
import zlib

DEFAULT_PREFIX = "dls"


def shard_of(key: str, shards: int) -> int:
    """The scheduler shard that owns a request or instance id: a stable hash (CRC-32) modulo
    ``shards`` (every service computes the same one; 0 when there is one shard)."""
    return zlib.crc32(key.encode()) % shards if shards > 1 else 0

# A subject token: no whitespace or control characters, no dot (token separator), no wildcards.
_BAD_TOKEN_CHARS = re.compile(r"[\s.*>\x00-\x1f\x7f]")


class SubjectError(ValueError):
    """An id or prefix that cannot be part of a NATS subject."""


def check_id(value: str, what: str = "id") -> str:
    """``value`` if it is a valid single subject token, else ``SubjectError`` naming it."""
    if not isinstance(value, str) or not value:
        raise SubjectError(f"{what} {value!r} must be a non-empty string")
    bad = _BAD_TOKEN_CHARS.search(value)
    if bad:
        raise SubjectError(
            f"{what} {value!r} cannot be used in a NATS subject: it contains {bad.group()!r} "
            "(no spaces, dots or wildcards allowed)"
        )
    return value


class Subjects:
    """Subject names under ``prefix`` (one or more dot-separated tokens, default ``dls``)."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        for token in prefix.split("."):
            check_id(token, "subject prefix token")
        self.prefix = prefix

    def _subject(self, *tokens: str) -> str:
        return ".".join((self.prefix, *tokens))

    # --- intake (JetStream) -------------------------------------------------------------------

    @property
    def intake_stream(self) -> str:
        """JetStream stream name (stream names may not contain dots)."""
        return f"{self.prefix.replace('.', '_')}_requests".upper()

    @property
    def intake(self) -> str:
        return self._subject("requests")

    @property
    def intake_shards(self) -> str:
        """Wildcard over the sharded intake subjects (the stream takes them too)."""
        return self._subject("requests", "*")

    def intake_for(self, shard: int, shards: int) -> str:
        """Where a request for ``shard`` goes: the plain intake with one shard."""
        return self.intake if shards <= 1 else self._subject("requests", str(shard))

    @property
    def cancel(self) -> str:
        return self._subject("cancel")

    # --- steps ----------------------------------------------------------------------------------

    def step(self, instance_id: str) -> str:
        return self._subject("step", check_id(instance_id, "instance id"))

    @property
    def step_all(self) -> str:
        """Wildcard over every instance's step subject (monitoring)."""
        return self._subject("step", "*")

    @property
    def results(self) -> str:
        return self._subject("results")

    def results_for(self, shard: int, shards: int) -> str:
        """Where an instance of ``shard`` sends its step results: the plain subject with one shard."""
        return self.results if shards <= 1 else self._subject("results", str(shard))

    # --- events -------------------------------------------------------------------------------

    def events(self, request_id: str) -> str:
        return self._subject("events", check_id(request_id, "request id"))

    @property
    def events_all(self) -> str:
        """Wildcard over every request's events (a gateway replica that demultiplexes itself)."""
        return self._subject("events", "*")

    # --- predictor, control ---------------------------------------------------------------------

    @property
    def predict(self) -> str:
        return self._subject("predict")

    @property
    def heartbeat(self) -> str:
        return self._subject("heartbeat")

    @property
    def stats(self) -> str:
        return self._subject("stats")

    @property
    def plans(self) -> str:
        return self._subject("plans")

    @property
    def plans_ack(self) -> str:
        return self._subject("plans", "ack")

    @property
    def reconfig_apply(self) -> str:
        """Operator request/reply: publish a plan to a given number of instances per TP degree."""
        return self._subject("reconfig", "apply")

    def __repr__(self) -> str:
        return f"Subjects(prefix={self.prefix!r})"
