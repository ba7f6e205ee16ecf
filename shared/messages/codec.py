"""Encoding and decoding of wire messages: msgpack via msgspec, with a payload limit.

NATS rejects payloads above its ``max_payload`` (1 MB by default), and a message that large means
state is travelling where ids should (DESIGN section 3). ``encode`` refuses anything above the limit
with an error naming the message type and size; ``decode`` turns malformed bytes into
``MessageError`` so a service loop can log and drop them instead of crashing.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import msgspec

DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024  # NATS's default max_payload

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


class CodecError(ValueError):
    """Base class of the codec's errors."""


class MessageError(CodecError):
    """Bytes that do not decode to the expected message type (malformed, truncated, wrong type)."""


class PayloadTooLargeError(CodecError):
    """A message whose encoding exceeds the payload limit."""


def encode(msg: msgspec.Struct, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> bytes:
    """The msgpack bytes of ``msg``; ``PayloadTooLargeError`` above ``max_payload_bytes``."""
    data = _encoder.encode(msg)
    if len(data) > max_payload_bytes:
        raise PayloadTooLargeError(
            f"{type(msg).__name__} encodes to {len(data)} bytes, above the {max_payload_bytes}-byte payload "
            "limit; send ids and deltas on NATS and keep request state in Redis"
        )
    return data


def decode(type_: type[T] | Any, data: bytes | bytearray | memoryview,
           max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> T:
    """Decode ``data`` as ``type_`` (a message class or a union of them); ``MessageError`` if it is not one."""
    name = _type_name(type_)
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MessageError(f"cannot decode {name}: expected bytes, got {type(data).__name__}")
    if len(data) > max_payload_bytes:
        raise PayloadTooLargeError(f"{name}: {len(data)} bytes received, above the {max_payload_bytes}-byte limit")
    try:
        return _decoder(type_).decode(data)
    except (msgspec.MsgspecError, ValueError) as exc:  # ValueError: e.g. invalid UTF-8 in a string
        raise MessageError(f"malformed {name} ({len(data)} bytes): {exc}") from exc


@functools.lru_cache(maxsize=256)
def _decoder(type_: Any) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(type_)


def _type_name(type_: Any) -> str:
    return getattr(type_, "__name__", None) or str(type_).replace("shared.messages.", "")
