"""Workload and cluster JSON files: decoding and validation, with errors that name the field.

Workload file::

    {"thresholds": [0.5, 0.6, 0.7, 0.8, 0.9],   # optional, candidate thresholds
     "safety_buffer": 0.2,                        # optional, planned rate = rate * (1 + buffer)
     "block_length": 32, "kv_cache": true,        # optional
     "slo_s": 6.0,                                # optional default SLO; else slo_factor (5) x
     "slo_factor": 5.0,                           #   the isolated TP-1 latency at the top threshold
     "tokens_per_step": {"0.5": 5.0, "0.9": 2.2}, # optional predictor table (threshold -> tokens)
     "classes": [{"name": "chat", "prompt_tokens": 140, "output_tokens": 264, "rate": 2.0,
                  "slo_s": 6.0,                                        # optional
                  "steps": {"0.9": {"recompute": 9, "cache": 115}}}]}  # optional per threshold

Cluster file::

    {"tp_degrees": [1, 2, 4],     # optional; default: the profile's degrees that fit on a node
     "nodes": [{"name": "node-0", "gpu_ids": [0, 1, 2, 3]}, ...],
     "placement": [{"node": "node-0", "tp": 4, "gpu_ids": [0, 1, 2, 3]}, ...]}   # running now
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from .spec import (
    DEFAULT_BLOCK_LENGTH,
    DEFAULT_SAFETY_BUFFER,
    DEFAULT_SLO_FACTOR,
    DEFAULT_THRESHOLDS,
    Cluster,
    Instance,
    Node,
    RequestClass,
    StepCounts,
    Workload,
)


class SpecError(ValueError):
    """A workload or cluster file is malformed; the message starts with the file and the field."""


NonNegativeFloat = Annotated[float, Meta(ge=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]
Threshold = Annotated[float, Meta(gt=0, le=1)]


class _StepsEntry(msgspec.Struct, forbid_unknown_fields=True):
    recompute: NonNegativeFloat  # full forward steps
    cache: NonNegativeFloat  # cache steps


class _ClassEntry(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1)]
    prompt_tokens: Annotated[int, Meta(ge=0)]
    output_tokens: Annotated[int, Meta(ge=1)]
    rate: NonNegativeFloat  # requests per second
    slo_s: PositiveFloat | None = None
    steps: dict[str, _StepsEntry] = {}  # threshold (as text) -> predicted steps


class _WorkloadFile(msgspec.Struct, forbid_unknown_fields=True):
    classes: Annotated[list[_ClassEntry], Meta(min_length=1)]
    thresholds: Annotated[list[Threshold], Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: list(DEFAULT_THRESHOLDS)
    )
    safety_buffer: NonNegativeFloat = DEFAULT_SAFETY_BUFFER
    block_length: Annotated[int, Meta(ge=1)] = DEFAULT_BLOCK_LENGTH
    kv_cache: bool = True
    slo_s: PositiveFloat | None = None
    slo_factor: PositiveFloat = DEFAULT_SLO_FACTOR
    tokens_per_step: dict[str, Annotated[float, Meta(ge=1)]] | None = None  # threshold -> tokens


class _NodeEntry(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1)]
    gpu_ids: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(min_length=1)]


class _InstanceEntry(msgspec.Struct, forbid_unknown_fields=True):
    node: str
    tp: Annotated[int, Meta(ge=1)]
    gpu_ids: list[Annotated[int, Meta(ge=0)]]


class _ClusterFile(msgspec.Struct, forbid_unknown_fields=True):
    nodes: Annotated[list[_NodeEntry], Meta(min_length=1)]
    tp_degrees: Annotated[list[Annotated[int, Meta(ge=1)]], Meta(min_length=1)] | None = None
    placement: list[_InstanceEntry] = []


# --- decoding ------------------------------------------------------------------------------------


def _decode(raw: bytes | dict, type_: type, source: str) -> Any:
    try:
        if isinstance(raw, dict):
            return msgspec.convert(raw, type_)
        return msgspec.json.decode(raw, type=type_)
    except msgspec.ValidationError as exc:
        raise SpecError(f"{source}: {_field_first(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise SpecError(f"{source}: not valid JSON ({exc})") from None


def _field_first(message: str) -> str:
    """msgspec's 'Expected `float` >= 0.0 - at `$.classes[2].rate`' -> 'classes[2].rate: expected ...'."""
    match = re.match(r"^(.*) - at `\$\.?(.*)`$", message)
    if not match:  # a top-level problem, e.g. an unknown field (the message names it)
        return message[:1].lower() + message[1:]
    problem, path = match.groups()
    return f"{path}: {problem[:1].lower()}{problem[1:]}"


def _read(path: str | Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read ({exc.strerror})") from None


# --- workload ------------------------------------------------------------------------------------


def load_workload(path: str | Path) -> Workload:
    return parse_workload(_read(path), source=str(path))


def parse_workload(raw: bytes | dict, source: str = "workload") -> Workload:
    data: _WorkloadFile = _decode(raw, _WorkloadFile, source)

    def fail(field: str, problem: str) -> SpecError:
        return SpecError(f"{source}: {field}: {problem}")

    thresholds = tuple(data.thresholds)
    if len(set(thresholds)) != len(thresholds):
        raise fail("thresholds", "has duplicates")
    names: set[str] = set()
    classes = []
    for i, entry in enumerate(data.classes):
        if entry.name in names:
            raise fail(f"classes[{i}].name", f"duplicate class name '{entry.name}'")
        names.add(entry.name)
        steps = {}
        for key, counts in entry.steps.items():
            threshold = _threshold_key(key, f"classes[{i}].steps.{key}", fail)
            if threshold not in thresholds:
                raise fail(f"classes[{i}].steps.{key}", f"threshold not in thresholds {list(thresholds)}")
            steps[threshold] = StepCounts(counts.recompute, counts.cache)
        classes.append(
            RequestClass(entry.name, entry.prompt_tokens, entry.output_tokens, entry.rate, entry.slo_s, steps)
        )
    tokens_per_step = None
    if data.tokens_per_step is not None:
        if not data.tokens_per_step:
            raise fail("tokens_per_step", "is empty")
        tokens_per_step = {
            _threshold_key(k, f"tokens_per_step.{k}", fail): v for k, v in data.tokens_per_step.items()
        }
    return Workload(
        classes=tuple(classes),
        thresholds=tuple(sorted(thresholds)),
        safety_buffer=data.safety_buffer,
        block_length=data.block_length,
        kv_cache=data.kv_cache,
        slo_s=data.slo_s,
        slo_factor=data.slo_factor,
        tokens_per_step=tokens_per_step,
    )


def _threshold_key(key: str, field: str, fail) -> float:
    try:
        value = float(key)
    except ValueError:
        raise fail(field, "key is not a threshold number") from None
    if not 0 < value <= 1:
        raise fail(field, "threshold must be in (0, 1]")
    return value


# --- cluster -------------------------------------------------------------------------------------


def load_cluster(path: str | Path, profile_tp_degrees: tuple[int, ...]) -> Cluster:
    return parse_cluster(_read(path), profile_tp_degrees, source=str(path))


def parse_cluster(raw: bytes | dict, profile_tp_degrees: tuple[int, ...], source: str = "cluster") -> Cluster:
    """Decode and validate; ``profile_tp_degrees`` are the degrees the latency profile knows."""
    data: _ClusterFile = _decode(raw, _ClusterFile, source)

    def fail(field: str, problem: str) -> SpecError:
        return SpecError(f"{source}: {field}: {problem}")

    nodes = _nodes(data.nodes, fail)
    largest_node = max(n.num_gpus for n in nodes)
    tp_degrees = _tp_degrees(data.tp_degrees, profile_tp_degrees, largest_node, fail)
    placement = _placement(data.placement, {n.name: n for n in nodes}, tp_degrees, fail)
    return Cluster(nodes=tuple(nodes), tp_degrees=tp_degrees, placement=placement)


def _nodes(entries: list[_NodeEntry], fail) -> list[Node]:
    nodes, names = [], set()
    for i, entry in enumerate(entries):
        if entry.name in names:
            raise fail(f"nodes[{i}].name", f"duplicate node name '{entry.name}'")
        names.add(entry.name)
        if len(set(entry.gpu_ids)) != len(entry.gpu_ids):
            raise fail(f"nodes[{i}].gpu_ids", "lists a GPU twice")
        nodes.append(Node(entry.name, tuple(sorted(entry.gpu_ids))))
    return nodes


def _tp_degrees(
    requested: list[int] | None, profile_tp_degrees: tuple[int, ...], largest_node: int, fail
) -> tuple[int, ...]:
    known = ", ".join(map(str, profile_tp_degrees))
    if requested is None:
        fitting = tuple(d for d in sorted(profile_tp_degrees) if d <= largest_node)
        if not fitting:
            raise fail("nodes", f"no node has enough GPUs for any TP degree of the profile ({known})")
        return fitting
    for i, d in enumerate(requested):
        if d not in profile_tp_degrees:
            raise fail(f"tp_degrees[{i}]", f"unknown TP degree {d} (the latency profile has {known})")
        if d > largest_node:
            raise fail(
                f"tp_degrees[{i}]",
                f"TP-{d} needs {d} GPUs on one node, but the largest node has {largest_node}",
            )
    degrees = tuple(sorted(set(requested)))
    if any(b % a for a, b in zip(degrees, degrees[1:], strict=False)):
        raise fail("tp_degrees", f"each degree must divide the next, got {list(degrees)}")
    return degrees


def _placement(
    entries: list[_InstanceEntry], name_to_node: dict[str, Node], tp_degrees: tuple[int, ...], fail
) -> tuple[Instance, ...]:
    used_by: dict[tuple[str, int], int] = {}  # (node, gpu id) -> placement index using it
    instances = []
    for i, entry in enumerate(entries):
        field = f"placement[{i}]"
        node = name_to_node.get(entry.node)
        if node is None:
            raise fail(f"{field}.node", f"no node named '{entry.node}'")
        if entry.tp not in tp_degrees:
            raise fail(
                f"{field}.tp", f"unknown TP degree {entry.tp} (allowed: {', '.join(map(str, tp_degrees))})"
            )
        if len(entry.gpu_ids) != entry.tp:
            raise fail(f"{field}.gpu_ids", f"{len(entry.gpu_ids)} GPUs listed for a TP-{entry.tp} instance")
        for gpu in entry.gpu_ids:
            if gpu not in node.gpu_ids:
                raise fail(
                    f"{field}.gpu_ids",
                    f"GPU {gpu} does not exist on node '{node.name}' "
                    f"(it has {node.num_gpus}: {list(node.gpu_ids)})",
                )
            if (node.name, gpu) in used_by:
                raise fail(
                    f"{field}.gpu_ids",
                    f"GPU {gpu} of node '{node.name}' is already used by "
                    f"placement[{used_by[(node.name, gpu)]}]",
                )
            used_by[(node.name, gpu)] = i
        instances.append(Instance(node.name, entry.tp, tuple(sorted(entry.gpu_ids))))
    return tuple(instances)
