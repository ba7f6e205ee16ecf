"""ASGI middleware at the very edge: API keys and the request body limit.

Both run before FastAPI parses anything, so an unauthenticated client gets 401 even for a malformed
body, and an oversized body is refused without being parsed. Pure ASGI (not ``BaseHTTPMiddleware``),
so streamed answers and client-disconnect notices pass through untouched.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, Sequence

from services.gateway.errors import ApiError
from services.gateway.security import STATE_KEY, key_hash

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/healthz", "/readyz", "/dashboard"})  # open even when keys are set
# page shells and their scripts hold no data: the pages ask for a key and send it on every /v1 call
OPEN_PREFIXES = ("/static/dashboard/", "/requests/")


def is_open(path: str) -> bool:
    """Paths served without a key: health checks and the dashboard's data-free page shells."""
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


async def send_error(send: Send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on every path but ``is_open`` ones when keys are configured
    (401 otherwise). The caller's identity (``security.key_hash`` of its key, never the key) goes into
    the ASGI scope's state for the routes (request ownership, rate limits)."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]
        self._hashes = {key.encode(): key_hash(key) for key in api_keys}  # key -> its identity

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.api_keys and not is_open(scope["path"]):
            error = self._check(_header(scope, b"authorization"))
            if isinstance(error, ApiError):
                await send_error(send, error)
                return
            scope.setdefault("state", {})[STATE_KEY] = self._hashes[error]
        await self.app(scope, receive, send)

    def _check(self, authorization: str | None) -> ApiError | bytes:
        """The accepted key that ``authorization`` carries, or the 401 to answer."""
        headers = {"WWW-Authenticate": "Bearer"}
        if not authorization:
            return ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", None, "missing_api_key",
                            headers=headers)
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return ApiError(401, "Authorization header must be 'Bearer <key>'", None, "invalid_api_key",
                            headers=headers)
        candidate = key.strip().encode()
        # Compare with every key (constant time each), so timing does not tell which keys exist.
        matches = [secrets.compare_digest(candidate, accepted) for accepted in self.api_keys]
        if not any(matches):
            return ApiError(401, "incorrect API key", None, "invalid_api_key", headers=headers)
        return self.api_keys[matches.index(True)]


class BodyLimitMiddleware:
    """Refuses request bodies over ``max_bytes`` (400, before parsing); replays accepted ones to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_error(send, self._too_large(int(declared)))
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await send_error(send, self._too_large(size))
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _too_large(self, size: int) -> ApiError:
        return ApiError(400, f"request body of {size} bytes or more is over the limit of {self.max_bytes} bytes",
                        None, "body_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out ``body`` once, then the client's own messages (its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
