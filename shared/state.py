"""The Redis request-state schema and the ``StateStore`` port (in-memory and Redis implementations).

A request's state is one ``RequestRecord`` plus an append-only list of ``StepRecord``s (the timeline
viewer reads them; nothing on the step path does, so loading a request stays O(1) in its steps).

Versioned writes: ``create`` stores version 1; every ``save`` names the version it read (the
record's ``version``), and is applied only if that is still the stored version, which then becomes
``version + 1``. A stale write raises ``StaleStateError`` and changes nothing, so of two concurrent
writers exactly one wins; the loser reloads and decides again.

Completion: saving a record with a terminal status removes it from the in-flight index and gives
the record and its step list a TTL (``completed_ttl_s``), so finished requests stay readable for a
while (the gateway, the timeline) and then go.

Redis layout under ``prefix`` (default ``dls``)::

    <prefix>:req:<id>         hash  {version: int, record: msgpack RequestRecord}
    <prefix>:req:<id>:steps   list  msgpack StepRecord, in step order
    <prefix>:inflight         zset  request id scored by arrival time (non-terminal requests)

Writes are Lua scripts (atomic on one Redis). They touch the in-flight index too, so on a Redis
Cluster all keys would need one hash slot; the design runs a replicated (not sharded) Redis.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import msgspec
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.generation import Answer, answer_of
from shared.messages.base import CacheMode, ConfidenceStats, RequestStatus, StepKind
from shared.messages.events import TokenLogprobs
from shared.redis_target import parse_redis_url, sentinel_client

logger = logging.getLogger("dls.state")

DEFAULT_COMPLETED_TTL_S = 3600.0


class RequestRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A request's durable state. Change it with ``msgspec.structs.replace`` and ``save`` it."""

    def answer(self, eos_id: int | None) -> Answer:
        """The answer of a finished canvas: up to the first EOS, cut at ``max_tokens``, ended before a stop string."""
        return answer_of(self.canvas, eos_id, self.max_tokens, self.ignore_eos, self.stop_length)

    def token_logprobs(self, first: int, end: int) -> TokenLogprobs | None:
        """What the tokens at canvas positions ``first`` .. ``end`` - 1 were committed with, when the
        request asked for logprobs (None otherwise)."""
        if self.logprobs is None:
            return None
        probs = [*self.confidences, *[0.0] * self.gen_length][first:end]
        top_ids: list[list[int]] = []
        top_probs: list[list[float]] = []
        if self.logprobs:
            top_ids = [*self.top_token_ids, *[[]] * self.gen_length][first:end]
            top_probs = [*self.top_probs, *[[]] * self.gen_length][first:end]
        return TokenLogprobs(probs=probs, top_token_ids=top_ids, top_probs=top_probs)

    request_id: str  # the request
    version: int = 0  # stored version this copy was read at (0: never stored)
    status: RequestStatus = RequestStatus.QUEUED  # lifecycle state (the scheduler owns transitions)
    prompt_token_ids: list[int]  # the tokenized prompt
    canvas: list[int]  # generation canvas: committed token ids, mask_token_id where not committed yet
    mask_token_id: int  # the id that marks an uncommitted canvas position
    gen_length: int  # canvas length
    max_tokens: int | None = None  # the answer's cap (None: the canvas); see shared.generation
    ignore_eos: bool = False  # decode the whole canvas instead of stopping at the block holding EOS
    block_length: int  # semi-autoregressive block length
    cache_mode: CacheMode = CacheMode.DUAL  # approximate KV cache
    current_block: int = 0  # the block being decoded (== number of blocks done)
    num_steps: int = 0  # denoising steps done
    num_committed: int = 0  # committed canvas positions
    threshold_history: list[float] = []  # threshold of every step, in order
    arrival_time: float  # unix time (s) the gateway accepted it
    deadline: float  # unix time (s) it should finish by (arrival + SLO)
    slo_ms: float  # latency SLO in milliseconds
    priority: int = 0  # larger is more important
    min_threshold: float = 0.0  # quality floor
    max_threshold: float = 1.0  # threshold ceiling
    seed: int | None = None  # sampling seed (None: the request id keys the noise)
    temperature: float = 0.0  # sampling temperature; 0: greedy
    top_p: float = 1.0  # nucleus sampling mass; 1: no cut
    top_k: int = 0  # sample among the k most likely tokens; 0: all
    logprobs: int | None = None  # None: no log probabilities asked for; k: with k alternatives per token
    stop: list[str] = []  # stop strings
    stop_length: int | None = None  # answer tokens, once a stop string ended the answer
    confidences: list[float] = []  # canvas position -> probability of the token committed there (0.0: none yet)
    top_token_ids: list[list[int]] = []  # canvas position -> its most likely tokens (logprobs > 0 only)
    top_probs: list[list[float]] = []  # canvas position -> their probabilities
    stream: bool = False  # the client wants a progress event per step
    last_instance_id: str | None = None  # instance that ran the last step (holds a local copy and KV cache)
    instance_history: list[str] = []  # instances it ran on, in order of first visit
    num_recompute_steps: int = 0  # of num_steps, the full forwards
    num_migrations: int = 0  # steps that ran on another instance than the step before
    model: str = ""  # the model name it was asked for (the gateway's answer echoes it)
    finish_reason: str = ""  # "stop" (EOS) or "length" once finished
    finished_at: float | None = None  # unix time (s) it reached a terminal status
    detail: str = ""  # why it was rejected or cancelled
    trace_context: str = ""  # W3C traceparent of its admission span: the parent of its spans ("" when not traced)
    owner: str = ""  # hash of the API key that created it (never the key); "": created without keys

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal


class StepRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One step of one request, for the timeline viewer and the predictor's retraining on served steps."""

    step_index: int  # 1-based: the request's num_steps after this step
    instance_id: str  # instance that ran it
    kind: StepKind  # recompute or cache step
    block_index: int  # block it decoded
    threshold: float  # threshold it ran at
    committed_positions: list[int] = []  # canvas indices it committed
    batch_size: int = 1  # requests in the same forward
    loaded_state: bool = False  # the worker loaded the state from Redis first (migration or restart)
    queued: int = 0  # requests queued at the scheduler (placed nowhere) when it composed the step
    started_at: float  # unix time (s) the forward started
    duration_s: float  # step time on the worker
    confidence: ConfidenceStats | None = None  # still-masked confidences after the step
    # NOTE: kept so the predictor service can rebuild each step's features from what is stored and
    # retrain on served steps (``services/predictor/core/served.py``)
    predicted_end: int | None = None  # where the engine expects the answer's EOS after the step; None: not known


class StateError(RuntimeError):
    """Base class of the state store's errors."""


class RequestExistsError(StateError):
    """``create`` for a request id that is already stored (a redelivered intake message, usually)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id!r} is already stored")
        self.request_id = request_id


class RequestNotFoundError(StateError):
    """A write for a request that is not stored (never created, or expired after completion)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id!r} is not stored")
        self.request_id = request_id


class StaleStateError(StateError):
    """A versioned write whose version is no longer the stored one: someone else wrote first."""

    def __init__(self, request_id: str, expected_version: int, actual_version: int) -> None:
        super().__init__(
            f"stale write to request {request_id!r}: written at version {expected_version}, "
            f"stored version is {actual_version}; reload and retry"
        )
        self.request_id = request_id
        self.expected_version = expected_version
        self.actual_version = actual_version


@dataclass
class SaveResult:
    """Outcome of ``save_many``: each record was saved, stale, or missing; saved ones in input order."""

    saved: list[RequestRecord] = field(default_factory=list)  # new versions of the applied writes
    stale: list[StaleStateError] = field(default_factory=list)  # writes that lost a race
    missing_ids: list[str] = field(default_factory=list)  # requests no longer stored

    @property
    def ok(self) -> bool:
        return not self.stale and not self.missing_ids


@runtime_checkable
class StateStore(Protocol):
    """Where request state lives. Async; every write is versioned (see the module docstring)."""

    async def create(self, record: RequestRecord) -> RequestRecord:
        """Store a new request at version 1 and return it; ``RequestExistsError`` if the id is stored."""
        ...

    async def load(self, request_id: str) -> RequestRecord | None:
        """The stored record, or None."""
        ...

    async def load_many(self, request_ids: Sequence[str]) -> list[RequestRecord | None]:
        """Records of many requests in one round trip, in the order asked (None where not stored)."""
        ...

    async def save(self, record: RequestRecord, new_steps: Sequence[StepRecord] = ()) -> RequestRecord:
        """Write ``record`` if ``record.version`` is the stored version, appending ``new_steps`` atomically.

        Returns the record at its new version. ``StaleStateError`` if another write came first,
        ``RequestNotFoundError`` if the request is not stored; in both cases nothing changes.
        """
        ...

    async def save_many(
        self, records: Sequence[RequestRecord], new_steps: Mapping[str, Sequence[StepRecord]] | None = None
    ) -> SaveResult:
        """``save`` for many requests in one round trip; each write succeeds or fails on its own.

        ``new_steps``: request id -> step records to append with that request's write.
        """
        ...

    async def append_steps(self, request_id: str, steps: Sequence[StepRecord]) -> int:
        """Append step records (no version check: the list is append-only); returns its new length."""
        ...

    async def load_steps(self, request_id: str) -> list[StepRecord]:
        """Every step record of the request, in order (empty when none or not stored)."""
        ...

    async def list_in_flight(self) -> list[str]:
        """Ids of stored non-terminal requests, by arrival time (what a restarted scheduler resumes)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


_record_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(RequestRecord)
_step_decoder = msgspec.msgpack.Decoder(StepRecord)


def _decode_record(data: bytes, request_id: str) -> RequestRecord:
    try:
        return _record_decoder.decode(data)
    except (msgspec.MsgspecError, ValueError) as exc:
        raise StateError(f"stored state of request {request_id!r} does not decode: {exc}") from exc


def _decode_step(data: bytes, request_id: str) -> StepRecord:
    try:
        return _step_decoder.decode(data)
    except (msgspec.MsgspecError, ValueError) as exc:
        raise StateError(f"a stored step record of request {request_id!r} does not decode: {exc}") from exc


# --- in-process ----------------------------------------------------------------------------------


@dataclass
class _Entry:
    data: bytes  # the encoded record (bytes, as on Redis: callers never share lists with the store)
    version: int  # stored version
    arrival_time: float  # the in-flight order
    is_terminal: bool  # excluded from the in-flight listing
    steps: list[bytes] = field(default_factory=list)  # encoded step records
    expires_at: float | None = None  # clock time it disappears (terminal requests)


class InMemoryStateStore:
    """The in-process ``StateStore`` (tests, simulator): the Redis semantics, with the clock injected.

    Records are kept encoded, as on Redis, so a caller mutating a loaded record's lists cannot change
    the store. Methods do not await between reading and writing, so each is atomic under asyncio as a
    Lua script is on Redis.
    """

    def __init__(self, completed_ttl_s: float = DEFAULT_COMPLETED_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.completed_ttl_s = completed_ttl_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}  # request id -> its state

    async def create(self, record: RequestRecord) -> RequestRecord:
        if self._entry(record.request_id) is not None:
            raise RequestExistsError(record.request_id)
        stored = msgspec.structs.replace(record, version=1)
        self._entries[record.request_id] = self._new_entry(stored)
        return stored

    async def load(self, request_id: str) -> RequestRecord | None:
        entry = self._entry(request_id)
        return None if entry is None else _decode_record(entry.data, request_id)

    async def load_many(self, request_ids: Sequence[str]) -> list[RequestRecord | None]:
        return [await self.load(request_id) for request_id in request_ids]

    async def save(self, record: RequestRecord, new_steps: Sequence[StepRecord] = ()) -> RequestRecord:
        entry = self._entry(record.request_id)
        if entry is None:
            raise RequestNotFoundError(record.request_id)
        if entry.version != record.version:
            raise StaleStateError(record.request_id, record.version, entry.version)
        written = msgspec.structs.replace(record, version=record.version + 1)
        steps = [*entry.steps, *(_record_encoder.encode(step) for step in new_steps)]
        self._entries[record.request_id] = self._new_entry(written, steps, keep_expiry=entry.expires_at)
        return written

    async def save_many(
        self, records: Sequence[RequestRecord], new_steps: Mapping[str, Sequence[StepRecord]] | None = None
    ) -> SaveResult:
        result = SaveResult()
        for record in records:
            try:
                result.saved.append(await self.save(record, (new_steps or {}).get(record.request_id, ())))
            except StaleStateError as exc:
                result.stale.append(exc)
            except RequestNotFoundError:
                result.missing_ids.append(record.request_id)
        return result

    async def append_steps(self, request_id: str, steps: Sequence[StepRecord]) -> int:
        entry = self._entry(request_id)
        if entry is None:
            raise RequestNotFoundError(request_id)
        entry.steps.extend(_record_encoder.encode(step) for step in steps)
        return len(entry.steps)

    async def load_steps(self, request_id: str) -> list[StepRecord]:
        entry = self._entry(request_id)
        return [] if entry is None else [_decode_step(item, request_id) for item in entry.steps]

    async def list_in_flight(self) -> list[str]:
        live = [(entry.arrival_time, rid) for rid in list(self._entries)
                if (entry := self._entry(rid)) is not None and not entry.is_terminal]
        return [rid for _, rid in sorted(live)]

    async def close(self) -> None:
        return None

    def _entry(self, request_id: str) -> _Entry | None:
        entry = self._entries.get(request_id)
        if entry is not None and entry.expires_at is not None and self._clock() >= entry.expires_at:
            del self._entries[request_id]  # expired, as Redis would have dropped it
            return None
        return entry

    def _new_entry(self, record: RequestRecord, steps: list[bytes] | None = None,
                   keep_expiry: float | None = None) -> _Entry:
        expires_at = self._clock() + self.completed_ttl_s if record.is_terminal else keep_expiry
        return _Entry(_record_encoder.encode(record), record.version, record.arrival_time, record.is_terminal,
                      steps or [], expires_at)


# --- Redis ---------------------------------------------------------------------------------------

# KEYS: record hash, in-flight zset. ARGV: record bytes, request id, arrival time, terminal (0/1), ttl ms.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'version', 1, 'record', ARGV[1])
if ARGV[4] == '1' then
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
else
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
end
return 1
"""

# KEYS: record hash, steps list, in-flight zset.
# ARGV: expected version, record bytes (at expected + 1), request id, terminal (0/1), ttl ms, steps...
# Returns {0, new version} | {1, stored version} (stale) | {2, -1} (not stored).
_SAVE = """
local current = redis.call('HGET', KEYS[1], 'version')
if not current then return {2, -1} end
if tonumber(current) ~= tonumber(ARGV[1]) then return {1, tonumber(current)} end
local new_version = tonumber(ARGV[1]) + 1
redis.call('HSET', KEYS[1], 'version', new_version, 'record', ARGV[2])
for i = 6, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
if ARGV[4] == '1' then
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  redis.call('PEXPIRE', KEYS[2], ARGV[5])
  redis.call('ZREM', KEYS[3], ARGV[3])
end
return {0, new_version}
"""

# save_many: the _SAVE of several records in one call (one command for Redis to parse, one reply).
# KEYS: in-flight zset, then per record its hash and its steps list.
# ARGV: ttl ms, then per record: expected version, record bytes (at expected + 1), request id,
# terminal (0/1), number of steps n, then its n steps.
# Returns {code, version} per record, flattened, as _SAVE would: 0 saved, 1 stale, 2 not stored.
_SAVE_MANY = """
local out = {}
local a = 2
for i = 1, (#KEYS - 1) / 2 do
  local hkey, skey = KEYS[2 * i], KEYS[2 * i + 1]
  local expected, n = tonumber(ARGV[a]), tonumber(ARGV[a + 4])
  local current = redis.call('HGET', hkey, 'version')
  if not current then
    out[#out + 1] = 2; out[#out + 1] = -1
  elseif tonumber(current) ~= expected then
    out[#out + 1] = 1; out[#out + 1] = tonumber(current)
  else
    redis.call('HSET', hkey, 'version', expected + 1, 'record', ARGV[a + 1])
    if n > 0 then redis.call('RPUSH', skey, unpack(ARGV, a + 5, a + 4 + n)) end
    if ARGV[a + 3] == '1' then
      redis.call('PEXPIRE', hkey, ARGV[1])
      redis.call('PEXPIRE', skey, ARGV[1])
      redis.call('ZREM', KEYS[1], ARGV[a + 2])
    end
    out[#out + 1] = 0; out[#out + 1] = expected + 1
  end
  a = a + 5 + n
end
return out
"""

# KEYS: record hash, steps list. ARGV: steps... Returns the list length, or -1 if not stored.
_APPEND = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
for i = 1, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
return redis.call('LLEN', KEYS[2])
"""


REDIS_RETRIES = 8  # a call is retried this often on a dropped connection (about 15 s with the back-off)
REDIS_BACKOFF_CAP_S = 4.0  # longest pause between two retries
REDIS_BACKOFF_BASE_S = 0.05  # first pause; doubles per retry


def redis_client(url: str, **kwargs):
    """A ``redis.asyncio.Redis`` on ``url`` (one server, or the primary named by Sentinels:
    ``shared.redis_target``) that rides out a restart or a failover: calls that hit a dropped connection
    (``ConnectionError``, ``TimeoutError``; a Sentinel client also on a primary that became a replica)
    reconnect, to the current primary, and retry with exponential back-off."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff

    target = parse_redis_url(url)
    retry = Retry(ExponentialBackoff(cap=REDIS_BACKOFF_CAP_S, base=REDIS_BACKOFF_BASE_S), REDIS_RETRIES)
    kwargs.setdefault("health_check_interval", 10)
    if not target.replicated:
        return aioredis.from_url(target.url, decode_responses=False, retry=retry, **kwargs)
    return sentinel_client(target, retry=retry, decode_responses=False, **kwargs)


class ReplicationError(RedisConnectionError):
    """A write the primary applied but no replica confirmed within the wait: not durable, so not done.
    A connection error: ``shared.retry.retry_transient`` and the services' retries treat it as one."""


class RedisStateStore:
    """The ``StateStore`` on Redis (``redis.asyncio``); batch calls are one pipelined round trip."""

    def __init__(self, client, prefix: str = "dls", completed_ttl_s: float = DEFAULT_COMPLETED_TTL_S,
                 wait_replicas: int = 0, wait_timeout_ms: int = 5000) -> None:
        """``client``: a ``redis.asyncio.Redis`` with ``decode_responses=False`` (records are bytes);
        ``wait_replicas``: every write waits (Redis ``WAIT``, up to ``wait_timeout_ms``) until that many
        replicas hold it, so a failover to one of them cannot lose it; ``ReplicationError`` if they do not."""
        self._redis = client
        self.prefix = prefix
        self.completed_ttl_s = completed_ttl_s
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.num_unreplicated = 0  # writes whose WAIT timed out short of wait_replicas (ReplicationError)
        self._create = client.register_script(_CREATE)
        self._save = client.register_script(_SAVE)
        self._append = client.register_script(_APPEND)
        self._save_many = client.register_script(_SAVE_MANY)

    @classmethod
    def from_url(cls, url: str, prefix: str = "dls",
                 completed_ttl_s: float = DEFAULT_COMPLETED_TTL_S) -> RedisStateStore:
        target = parse_redis_url(url)
        return cls(redis_client(url), prefix, completed_ttl_s, target.wait_replicas, target.wait_timeout_ms)

    # keys

    def record_key(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}"

    def steps_key(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}:steps"

    @property
    def in_flight_key(self) -> str:
        return f"{self.prefix}:inflight"

    # the port

    async def create(self, record: RequestRecord) -> RequestRecord:
        stored = msgspec.structs.replace(record, version=1)
        created = await self._write(
            self._create, keys=[self.record_key(record.request_id), self.in_flight_key],
            args=[_record_encoder.encode(stored), record.request_id, repr(record.arrival_time),
                  int(stored.is_terminal), self._ttl_ms],
        )
        if not created:
            raise RequestExistsError(record.request_id)
        return stored

    async def load(self, request_id: str) -> RequestRecord | None:
        data = await self._redis.hget(self.record_key(request_id), "record")
        return None if data is None else _decode_record(data, request_id)

    async def load_many(self, request_ids: Sequence[str]) -> list[RequestRecord | None]:
        if not request_ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.hget(self.record_key(request_id), "record")
        replies = await pipe.execute()
        return [None if data is None else _decode_record(data, rid)
                for rid, data in zip(request_ids, replies, strict=True)]

    async def save(self, record: RequestRecord, new_steps: Sequence[StepRecord] = ()) -> RequestRecord:
        reply = await self._write(self._save, **self._save_call(record, new_steps))
        return self._saved(record, reply)

    async def save_many(
        self, records: Sequence[RequestRecord], new_steps: Mapping[str, Sequence[StepRecord]] | None = None
    ) -> SaveResult:
        result = SaveResult()
        if not records:
            return result
        # one script call for the batch (a pipeline of per-record script calls costs a SCRIPT EXISTS
        # round trip on top, and Redis parses one command per record); each record is still its own
        # versioned write, with the outcome _SAVE would give it
        keys: list[str] = [self.in_flight_key]
        args: list = [self._ttl_ms]
        encode = _record_encoder.encode
        for record in records:
            rid = record.request_id
            written = msgspec.structs.replace(record, version=record.version + 1)
            steps = (new_steps or {}).get(rid, ())
            keys += (self.record_key(rid), self.steps_key(rid))
            args += (record.version, encode(written), rid, int(written.is_terminal), len(steps))
            args += [encode(step) for step in steps]
        flat = await self._write(self._save_many, keys=keys, args=args)
        replies = [flat[i:i + 2] for i in range(0, len(flat), 2)]
        for record, reply in zip(records, replies, strict=True):
            try:
                result.saved.append(self._saved(record, reply))
            except StaleStateError as exc:
                result.stale.append(exc)
            except RequestNotFoundError:
                result.missing_ids.append(record.request_id)
        return result

    async def append_steps(self, request_id: str, steps: Sequence[StepRecord]) -> int:
        length = await self._write(
            self._append, keys=[self.record_key(request_id), self.steps_key(request_id)],
            args=[_record_encoder.encode(step) for step in steps],
        )
        if length < 0:
            raise RequestNotFoundError(request_id)
        return int(length)

    async def load_steps(self, request_id: str) -> list[StepRecord]:
        items = await self._redis.lrange(self.steps_key(request_id), 0, -1)
        return [_decode_step(item, request_id) for item in items]

    async def list_in_flight(self) -> list[str]:
        return [rid.decode() for rid in await self._redis.zrange(self.in_flight_key, 0, -1)]

    async def close(self) -> None:
        await self._redis.aclose()

    # helpers

    async def _write(self, script, keys: list, args: list):
        """Run a write script; with ``wait_replicas``, in one round trip with a ``WAIT`` after it (WAIT
        counts the writes of its own connection, hence the pipeline)."""
        if not self.wait_replicas:
            return await script(keys=keys, args=args)
        from redis.exceptions import NoScriptError

        for attempt in range(2):
            pipe = self._redis.pipeline(transaction=False)
            pipe.evalsha(script.sha, len(keys), *keys, *args)
            pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            try:
                reply, num_replicas = await pipe.execute()
            except NoScriptError:  # a new primary (failover) or a restarted server: load it, go again
                if attempt:
                    raise
                await self._redis.script_load(script.script)
                continue
            if int(num_replicas) < self.wait_replicas:
                # applied on the primary, but a failover now could lose it: not done (the caller retries,
                # and its versioned retry finds whatever the primary kept)
                self.num_unreplicated += 1
                raise ReplicationError(f"a state write reached {num_replicas} of {self.wait_replicas} replica(s) "
                                       f"within {self.wait_timeout_ms} ms")
            return reply
        raise AssertionError("unreachable")

    @property
    def _ttl_ms(self) -> int:
        return max(int(self.completed_ttl_s * 1000), 1)

    def _save_call(self, record: RequestRecord, new_steps: Sequence[StepRecord]) -> dict:
        written = msgspec.structs.replace(record, version=record.version + 1)
        rid = record.request_id
        return {
            "keys": [self.record_key(rid), self.steps_key(rid), self.in_flight_key],
            "args": [record.version, _record_encoder.encode(written), rid, int(written.is_terminal), self._ttl_ms,
                     *(_record_encoder.encode(step) for step in new_steps)],
        }

    @staticmethod
    def _saved(record: RequestRecord, reply: list) -> RequestRecord:
        code, version = int(reply[0]), int(reply[1])
        if code == 2:
            raise RequestNotFoundError(record.request_id)
        if code == 1:
            raise StaleStateError(record.request_id, record.version, version)
        return msgspec.structs.replace(record, version=version)
