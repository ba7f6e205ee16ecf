"""No orphan work: a retry joins the request it retries, and a request whose client left is cancelled.

**Keys.** A request can be joined under a key when its client says it may retry it:

- ``Idempotency-Key: <key>`` (the IETF httpapi draft's header, as Stripe's and OpenAI's own API take
  it): that key, scoped to the caller (its API key's hash, else its address);
- the OpenAI SDKs' retry counter ``x-stainless-retry-count`` (they retry timeouts, 408, 409, 429 and
  5xx twice by default, with the same body and no key): a key derived from the caller, the route and
  the body (SHA-256 of its JSON, fields sorted).

The first attempt registers its key with the ids of its requests (one per choice). A retry with a
registered key (an explicit key, or a retry count above 0) *joins* them: it is answered from their
events, or from Redis once they finished, and starts no work. The same key with another body is a
422 (the draft's status). A body sent afresh (retry count 0) is new work even when an identical one
runs, so a benchmark that sends one prompt many times is not folded into one request. Keys last
``DLS_GATEWAY_IDEMPOTENCY_TTL_S``; a request that failed drops its key, so a retry starts afresh.

**Clients leaving.** Every client answered under a key is counted (``attached``). One that
disconnects or gets a 504 detaches; once none is left the request waits ``DLS_GATEWAY_RETRY_GRACE_S``
for a retry to join, then, if none did, its key is dropped and it is cancelled everywhere
(``CancelRequest``: the scheduler stops stepping it and frees it on its instance). A request
without a key is cancelled as soon as its client leaves.

``InMemoryIdempotency`` (one process, tests) and ``RedisIdempotency`` (every gateway replica shares
the keys, so a retry that reaches another replica joins too) implement ``IdempotencyStore``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

IDEMPOTENCY_HEADER = "idempotency-key"
SDK_RETRY_HEADER = "x-stainless-retry-count"  # the OpenAI (Stainless) SDKs' attempt counter: 0 on the first
MAX_KEY_CHARS = 255


@dataclass(frozen=True)
class Claim:
    """What a key stands for."""

    request_ids: list[str]  # the requests (one per choice) answered under it
    fingerprint: str  # of the body that registered it
    arrival_time: float  # when they were accepted
    created: bool  # this call registered the key (new work); False: it stood for earlier requests
    num_joins: int = 0  # retries that joined them so far (this one included)


@dataclass(frozen=True)
class RetryKey:
    """A request's key, and whether the request may join the one registered under it."""

    key: str  # scoped to the caller
    fingerprint: str  # of the route and body
    join: bool  # a retry (explicit key, or the SDK's retry count above 0); False: a first attempt
    explicit: bool  # from an Idempotency-Key header (a different body under it is an error)


def fingerprint(route: str, body: dict) -> str:
    """SHA-256 of the route and the body's JSON (fields sorted): equal for equal requests."""
    text = json.dumps({"route": route, "body": body}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def retry_key(headers, identity: str, route: str, body: dict) -> RetryKey | None:
    """The key a request is registered (or joins) under, from its headers; None when its client does
    not retry (no key, no retry counter). ``ValueError`` for an unusable header."""
    print_ = fingerprint(route, body)
    explicit = headers.get(IDEMPOTENCY_HEADER)
    if explicit is not None:
        if not explicit or len(explicit) > MAX_KEY_CHARS:
            raise ValueError(f"Idempotency-Key must be 1 to {MAX_KEY_CHARS} characters")
        return RetryKey(_scoped(identity, "key", explicit), print_, join=True, explicit=True)
    count = headers.get(SDK_RETRY_HEADER)
    if count is None:
        return None
    try:
        retries = int(count)
    except ValueError:
        retries = 0
    return RetryKey(_scoped(identity, "body", print_), print_, join=retries > 0, explicit=False)


def _scoped(identity: str, kind: str, key: str) -> str:
    return hashlib.sha256(f"{identity}|{kind}|{key}".encode()).hexdigest()


class IdempotencyStore(Protocol):
    """Keys -> the requests answered under them, with the number of clients attached."""

    async def claim(self, key: str, fingerprint: str, request_ids: Sequence[str], arrival_time: float,
                    ttl_s: float, attach: bool) -> Claim:
        """Register ``key`` for ``request_ids`` (one client attached) unless it is registered; then, with
        ``attach``, count one more client on it. Returns what the key stands for."""
        ...

    async def detach(self, key: str) -> tuple[int, int]:
        """One client fewer; the clients left (-1: the key is gone) and the joins so far."""
        ...

    async def drop_if_unattached(self, key: str, num_joins: int) -> bool:
        """Delete the key if no client is attached and no retry joined since ``num_joins`` were counted
        (the caller then cancels its requests); True if so."""
        ...

    async def drop(self, key: str) -> None:
        """Delete the key (its requests failed: a retry starts afresh)."""
        ...


class InMemoryIdempotency:
    """``IdempotencyStore`` in this process (tests, one gateway)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[str, tuple[Claim, int, float]] = {}  # key -> (claim, clients attached, expiry)

    async def claim(self, key: str, fingerprint: str, request_ids: Sequence[str], arrival_time: float,
                    ttl_s: float, attach: bool) -> Claim:
        entry = self._live(key)
        if entry is None:
            claim = Claim(list(request_ids), fingerprint, arrival_time, created=True)
            self._entries[key] = (claim, 1, self._clock() + ttl_s)
            return claim
        claim, attached, expiry = entry
        joins = claim.num_joins + int(attach)
        stored = Claim(claim.request_ids, claim.fingerprint, claim.arrival_time, False, joins)
        self._entries[key] = (stored, attached + int(attach), expiry)
        return stored

    async def detach(self, key: str) -> tuple[int, int]:
        entry = self._live(key)
        if entry is None:
            return -1, 0
        claim, attached, expiry = entry
        self._entries[key] = (claim, max(attached - 1, 0), expiry)
        return max(attached - 1, 0), claim.num_joins

    async def drop_if_unattached(self, key: str, num_joins: int) -> bool:
        entry = self._live(key)
        if entry is None or entry[1] > 0 or entry[0].num_joins != num_joins:
            return False
        del self._entries[key]
        return True

    async def drop(self, key: str) -> None:
        self._entries.pop(key, None)

    def _live(self, key: str):
        entry = self._entries.get(key)
        if entry is not None and self._clock() >= entry[2]:
            del self._entries[key]
            return None
        return entry


# KEYS: the key's hash. ARGV: request ids (JSON), fingerprint, arrival time, ttl ms, attach (0/1).
# Returns {created (0/1), request ids (JSON), fingerprint, arrival time, joins}.
_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if ARGV[5] == '1' then
    redis.call('HINCRBY', KEYS[1], 'attached', 1)
    redis.call('HINCRBY', KEYS[1], 'joins', 1)
  end
  local v = redis.call('HMGET', KEYS[1], 'ids', 'fingerprint', 'arrival', 'joins')
  return {0, v[1], v[2], v[3], v[4]}
end
redis.call('HSET', KEYS[1], 'ids', ARGV[1], 'fingerprint', ARGV[2], 'arrival', ARGV[3], 'attached', 1, 'joins', 0)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {1, ARGV[1], ARGV[2], ARGV[3], '0'}
"""

# Returns {clients left (-1: no key), joins}.
_DETACH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0} end
local left = redis.call('HINCRBY', KEYS[1], 'attached', -1)
if left < 0 then redis.call('HSET', KEYS[1], 'attached', 0); left = 0 end
return {left, tonumber(redis.call('HGET', KEYS[1], 'joins'))}
"""

# ARGV: the joins counted when the last client left.
_DROP_IF_UNATTACHED = """
local v = redis.call('HMGET', KEYS[1], 'attached', 'joins')
if not v[1] or tonumber(v[1]) > 0 or tonumber(v[2]) ~= tonumber(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""


class RedisIdempotency:
    """``IdempotencyStore`` in Redis (``<prefix>:idem:<key>`` hashes), shared by the gateway replicas."""

    def __init__(self, client, prefix: str) -> None:
        """``client``: a ``redis.asyncio.Redis`` (bytes or str replies)."""
        self._redis = client
        self.prefix = prefix
        self._claim = client.register_script(_CLAIM)
        self._detach = client.register_script(_DETACH)
        self._drop_if_unattached = client.register_script(_DROP_IF_UNATTACHED)

    def _key(self, key: str) -> str:
        return f"{self.prefix}:idem:{key}"

    async def claim(self, key: str, fingerprint: str, request_ids: Sequence[str], arrival_time: float,
                    ttl_s: float, attach: bool) -> Claim:
        created, ids, stored_print, arrival, joins = await self._claim(
            keys=[self._key(key)],
            args=[json.dumps(list(request_ids)), fingerprint, repr(arrival_time), max(int(ttl_s * 1000), 1),
                  int(attach)])
        return Claim(json.loads(_text(ids)), _text(stored_print), float(_text(arrival)), bool(int(created)),
                     int(_text(joins)))

    async def detach(self, key: str) -> tuple[int, int]:
        left, joins = await self._detach(keys=[self._key(key)])
        return int(left), int(joins)

    async def drop_if_unattached(self, key: str, num_joins: int) -> bool:
        return bool(int(await self._drop_if_unattached(keys=[self._key(key)], args=[num_joins])))

    async def drop(self, key: str) -> None:
        await self._redis.delete(self._key(key))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
