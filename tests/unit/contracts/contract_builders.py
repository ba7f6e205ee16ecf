"""Builders for the contract tests: example values of any wire struct, and request records."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import msgspec
import msgspec.inspect as mi

import shared.messages
from shared.messages.base import CacheMode
from shared.state import RequestRecord, RequestStatus

MASK = 126


def message_modules() -> list[Any]:
    """Every module of ``shared.messages``."""
    return [importlib.import_module(f"shared.messages.{m.name}") for m in pkgutil.iter_modules(shared.messages.__path__)]


def wire_structs() -> list[type[msgspec.Struct]]:
    """Every Struct class defined in ``shared.messages`` (bases included), by module and name."""
    found = {}
    for module in message_modules():
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, msgspec.Struct) and value.__module__ == module.__name__:
                found[f"{module.__name__}.{value.__name__}"] = value
    return [found[k] for k in sorted(found)]


def example(type_: type[msgspec.Struct]) -> msgspec.Struct:
    """An instance of ``type_`` with every field set to a non-default value."""
    return _value(mi.type_info(type_))


def _value(info: mi.Type) -> Any:
    if isinstance(info, mi.StructType):
        return info.cls(**{f.name: _value(f.type) for f in info.fields})
    if isinstance(info, mi.UnionType):
        return _value(next(t for t in info.types if not isinstance(t, mi.NoneType)))
    if isinstance(info, mi.EnumType):
        return list(info.cls)[-1]  # the last member is rarely the default
    if isinstance(info, mi.ListType):
        return [_value(info.item_type), _value(info.item_type)]
    if isinstance(info, mi.TupleType):
        return tuple(_value(t) for t in info.item_types)
    if isinstance(info, mi.VarTupleType):
        return (_value(info.item_type),)
    if isinstance(info, mi.DictType):
        return {_value(info.key_type): _value(info.value_type)}
    scalars = {mi.BoolType: True, mi.IntType: 7, mi.FloatType: 0.625, mi.StrType: "x-1", mi.NoneType: None,
               mi.BytesType: b"\x00\x01"}
    for kind, value in scalars.items():
        if isinstance(info, kind):
            return value
    raise TypeError(f"no example for {info!r}: teach contract_builders._value this type")


def make_record(request_id: str = "r1", arrival_time: float = 1000.0, gen_length: int = 8,
                status: RequestStatus = RequestStatus.QUEUED, **overrides: Any) -> RequestRecord:
    """A fresh request record (nothing committed yet)."""
    fields = dict(
        request_id=request_id, status=status, prompt_token_ids=[5, 6, 7], canvas=[MASK] * gen_length,
        mask_token_id=MASK, gen_length=gen_length, block_length=4, cache_mode=CacheMode.DUAL,
        arrival_time=arrival_time, deadline=arrival_time + 2.0, slo_ms=2000.0,
    )
    fields.update(overrides)
    return RequestRecord(**fields)
