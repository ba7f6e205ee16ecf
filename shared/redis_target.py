"""Where the request-state Redis is: one server, or a replicated one behind Redis Sentinel.

``DLS_REDIS_URL`` takes either form, so every service (and the workers a node agent starts, which
inherit the variable) reaches the same store the same way:

- ``redis://[[user]:password@]host:port/db`` (``rediss://`` for TLS): one server.
- ``redis+sentinel://[[user]:password@]host:port[,host:port...]/<master name>[/db]``: the Sentinels
  of a replicated Redis (a primary and its replicas). The client asks them for the current primary,
  and after a failover reconnects to the new one (redis-py's Sentinel client). The password is the
  data nodes' ``requirepass`` and is also sent to the Sentinels (give them the same one, or none).

Query options (either form): ``wait_replicas=N`` makes every state write wait until N replicas have it
(Redis ``WAIT``) before it counts as done, so a failover cannot lose a write that a service already
acted on (an intake acknowledged, a step's results published). A write that no replica confirms within
``wait_timeout_ms`` fails with ``ReplicationError`` (a connection error: callers retry it, and the
versioned writes make the retry find what the primary kept), never reported as done. Defaults: 1 and
5000 ms with Sentinels, 0 (no wait) for one server. Other query options go to redis-py as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_CONNECT_TIMEOUT_S = 2.0  # a Sentinel or data node that does not accept within this counts as down
DEFAULT_SENTINEL_PORT = 26379
SENTINEL_WAIT_REPLICAS = 1  # default wait_replicas with Sentinels
DEFAULT_WAIT_TIMEOUT_MS = 5000  # a failover's new primary needs its replicas back: about a second
_WAIT_OPTIONS = ("wait_replicas", "wait_timeout_ms")


class RedisUrlError(ValueError):
    """A ``DLS_REDIS_URL`` that cannot be used; the message says what is wrong (without the password)."""


@dataclass(frozen=True)
class RedisTarget:
    """A parsed ``DLS_REDIS_URL``."""

    url: str  # one server: the URL for redis-py, wait options removed; Sentinels: ""
    sentinels: tuple[tuple[str, int], ...] = ()  # (host, port) of each Sentinel; empty: one server
    master: str = ""  # the Sentinels' name of the primary
    db: int = 0
    username: str | None = None
    password: str | None = None
    wait_replicas: int = 0  # replicas each state write waits for (WAIT)
    wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS

    @property
    def replicated(self) -> bool:
        return bool(self.sentinels)


def parse_redis_url(url: str) -> RedisTarget:
    parts = urlsplit(url.strip())
    query = parse_qsl(parts.query, keep_blank_values=True)
    options = dict(query)
    rest = [(k, v) for k, v in query if k not in _WAIT_OPTIONS]
    sentinel = parts.scheme == SENTINEL_SCHEME
    wait_replicas = _int_option(options, "wait_replicas", SENTINEL_WAIT_REPLICAS if sentinel else 0)
    wait_timeout_ms = _int_option(options, "wait_timeout_ms", DEFAULT_WAIT_TIMEOUT_MS)
    if not sentinel:
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise RedisUrlError(f"DLS_REDIS_URL: scheme {parts.scheme!r} is not redis, rediss, unix or "
                                f"{SENTINEL_SCHEME}")
        return RedisTarget(urlunsplit(parts._replace(query=urlencode(rest))), wait_replicas=wait_replicas,
                           wait_timeout_ms=wait_timeout_ms)
    if rest:
        raise RedisUrlError(f"DLS_REDIS_URL: unknown {SENTINEL_SCHEME} option(s) {sorted(k for k, _ in rest)}; "
                            f"known: {list(_WAIT_OPTIONS)}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":") if userinfo else ("", "", "")
    sentinels = tuple(_host_port(h) for h in hosts.split(",") if h.strip())
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not 1 <= len(path) <= 2:
        raise RedisUrlError(f"DLS_REDIS_URL: a Sentinel URL is {SENTINEL_SCHEME}://[:password@]host:port[,host:port"
                            f"...]/<master name>[/db]")
    try:
        db = int(path[1]) if len(path) == 2 else 0
    except ValueError:
        raise RedisUrlError(f"DLS_REDIS_URL: database {path[1]!r} is not a number") from None
    return RedisTarget("", sentinels, unquote(path[0]), db, unquote(username) or None,
                       unquote(password) if userinfo and ":" in userinfo else None, wait_replicas, wait_timeout_ms)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.strip().rpartition(":")
    if not host:
        return text.strip(), DEFAULT_SENTINEL_PORT
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise RedisUrlError(f"DLS_REDIS_URL: Sentinel port {port!r} is not a number") from None


def _int_option(options: dict[str, str], name: str, default: int) -> int:
    if name not in options:
        return default
    try:
        value = int(options[name])
    except ValueError:
        raise RedisUrlError(f"DLS_REDIS_URL: {name}={options[name]!r} is not a whole number") from None
    if value < 0:
        raise RedisUrlError(f"DLS_REDIS_URL: {name} must not be negative")
    return value


def sentinel_client(target: RedisTarget, **kwargs):
    """A ``redis.asyncio.Redis`` on the primary the Sentinels of ``target`` name (``kwargs`` for it)."""
    from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection

    class PrimaryConnection(SentinelManagedConnection):
        """NOTE: redis-py (8.1) reconnects a connection that dropped in the middle of a command through
        ``connect_check_health``, which ``SentinelManagedConnection`` does not override: it would dial the
        dead primary again until the client's retries ran out (about 15 s), whatever the Sentinels say.
        Here every reconnect asks the Sentinels first, as its ``connect`` does."""

        _dialing = False  # inside connect_to (the address was just asked for)

        async def connect_to(self, address):
            self._dialing = True
            try:
                await super().connect_to(address)
            finally:
                self._dialing = False

        async def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True):
            if self.is_connected or self._dialing:
                return await super().connect_check_health(check_health, retry_socket_connect)
            return await self.connect()

    auth = {"username": target.username, "password": target.password}
    timeouts = {k: kwargs[k] for k in ("socket_timeout", "socket_connect_timeout") if k in kwargs}
    timeouts.setdefault("socket_connect_timeout", SENTINEL_CONNECT_TIMEOUT_S)
    sentinels = Sentinel(list(target.sentinels), sentinel_kwargs={**auth, **timeouts}, **timeouts)
    kwargs = {**timeouts, **kwargs}
    return sentinels.master_for(target.master, db=target.db, connection_class=PrimaryConnection, **auth, **kwargs)
