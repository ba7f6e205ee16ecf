"""Round trips of every wire message, payload limits, malformed input, and the style rules of the schema."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import msgspec
import pytest

from shared.messages import MessageError, PayloadTooLargeError, decode, encode
from shared.messages.base import ConfidenceStats, Message, Part, StepKind
from shared.messages.control import ReconfigPlan
from shared.messages.events import RequestEvent, RequestFailed, RequestFinished, RequestProgress, Usage
from shared.messages.intake import CancelRequest, CompletionRequest
from shared.messages.steps import RequestStepResult, StepCommand, StepItem, StepResults
from shared.state import RequestRecord, StepRecord
from tests.unit.contracts.contract_builders import example, message_modules, wire_structs

CONCRETE = [t for t in wire_structs() if t not in (Message, Part)]


def test_discovery_finds_every_boundary():
    modules = {t.__module__.rsplit(".", 1)[-1] for t in CONCRETE}
    assert {"intake", "steps", "events", "predictor", "control"} <= modules
    assert len(CONCRETE) >= 20


@pytest.mark.parametrize("struct_type", CONCRETE + [RequestRecord, StepRecord], ids=lambda t: t.__name__)
def test_every_struct_round_trips(struct_type):
    value = example(struct_type)
    assert decode(struct_type, encode(value)) == value


@pytest.mark.parametrize("struct_type", [t for t in CONCRETE if issubclass(t, Message)], ids=lambda t: t.__name__)
def test_top_level_messages_are_tagged_with_their_class_name(struct_type):
    assert msgspec.msgpack.decode(encode(example(struct_type)))["message"] == struct_type.__name__


def test_defaults_are_omitted_and_restored():
    cancel = CancelRequest(request_id="r1")
    assert msgspec.msgpack.decode(encode(cancel)) == {"message": "CancelRequest", "request_id": "r1"}
    assert decode(CancelRequest, encode(cancel)) == cancel


def test_event_union_dispatches_by_type():
    usage = Usage(prompt_tokens=3, completion_tokens=5, num_steps=4, num_recompute_steps=2, thresholds=[0.9] * 4,
                  instance_ids=["w0", "w1"], num_migrations=1, latency_s=1.5, slo_met=True)
    finished = RequestFinished(request_id="r1", seq=3, text="42", token_ids=[52, 50], usage=usage)
    decoded = decode(RequestEvent, encode(finished))
    assert isinstance(decoded, RequestFinished) and decoded.usage.num_cache_steps == 2


def test_decoding_as_the_wrong_message_type_is_a_message_error():
    data = encode(CancelRequest(request_id="r1"))
    with pytest.raises(MessageError, match="CompletionRequest"):
        decode(CompletionRequest, data)


def test_unknown_fields_are_ignored_for_rolling_upgrades():
    newer = msgspec.msgpack.encode({"message": "CancelRequest", "request_id": "r1", "added_later": [1, 2]})
    assert decode(CancelRequest, newer) == CancelRequest(request_id="r1")


def test_a_realistic_step_round_trip():
    command = StepCommand(instance_id="w0", step_id=11, issued_at=5.0, items=[
        StepItem(request_id="r1", threshold=0.9, state_version=3),
        StepItem(request_id="r2", threshold=0.5, state_version=8, load_state=True),
    ], drop_request_ids=["r0"])
    result = RequestStepResult(
        request_id="r1", kind=StepKind.CACHE, block_index=1, committed_positions=[5, 6], committed_token_ids=[9, 9],
        block_done=False, finished=False, num_steps=4, num_masked=2, confidence=ConfidenceStats(min=0.2, q25=0.3, median=0.4,
                                                                                mean=0.4, q75=0.5),
        threshold=0.9, state_version=4)
    results = StepResults(instance_id="w0", step_id=11, results=[result], started_at=5.01, duration_s=0.02)
    assert decode(StepCommand, encode(command)) == command
    back = decode(StepResults, encode(results))
    assert back == results and back.batch_size == 1 and back.results[0].confidence.as_tuple[0] == 0.2


def test_oversize_payload_names_type_and_size():
    command = StepCommand(instance_id="w0", step_id=1, issued_at=0.0,
                          items=[StepItem(request_id=f"request-{i}", threshold=0.9, state_version=i)
                                 for i in range(30_000)])
    with pytest.raises(PayloadTooLargeError, match=r"StepCommand encodes to \d+ bytes, above the 1048576-byte"):
        encode(command)


def test_payload_limit_is_configurable():
    progress = example(RequestProgress)
    size = len(encode(progress))
    assert decode(RequestProgress, encode(progress, max_payload_bytes=size), max_payload_bytes=size) == progress
    with pytest.raises(PayloadTooLargeError, match=f"RequestProgress encodes to {size} bytes"):
        encode(progress, max_payload_bytes=size - 1)
    with pytest.raises(PayloadTooLargeError, match="RequestProgress"):
        decode(RequestProgress, encode(progress), max_payload_bytes=size - 1)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x00", b"not msgpack at all \xff\xfe", b"\x92\x01\x02",
                                  msgspec.msgpack.encode({"message": "RequestFailed", "seq": 1})],
                         ids=["empty", "reserved-byte", "int", "garbage", "array", "missing-fields"])
def test_malformed_bytes_are_a_message_error(data):
    with pytest.raises(MessageError, match="RequestFailed"):
        decode(RequestFailed, data)


def test_truncated_message_is_a_message_error():
    data = encode(example(ReconfigPlan))
    with pytest.raises(MessageError, match=r"malformed ReconfigPlan \(\d+ bytes\)"):
        decode(ReconfigPlan, data[: len(data) // 2])


def test_not_bytes_is_a_message_error():
    with pytest.raises(MessageError, match="expected bytes"):
        decode(CancelRequest, "a string")  # type: ignore[arg-type]


def test_wrong_field_type_is_a_message_error():
    data = msgspec.msgpack.encode({"message": "CancelRequest", "request_id": 5})
    with pytest.raises(MessageError, match="request_id"):
        decode(CancelRequest, data)


# --- the schema's style rules (STYLE items 5 and 6) ------------------------------------------------


def _struct_field_lines(path: Path) -> list[tuple[str, str, str]]:
    """(class, field, source line) of every annotated field of every class in ``path``."""
    source = path.read_text()
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    out.append((node.name, item.target.id, lines[item.end_lineno - 1]))
    return out


SCHEMA_FILES = [Path(inspect.getfile(m)) for m in message_modules()] + [Path(inspect.getfile(RequestRecord))]


@pytest.mark.parametrize("path", SCHEMA_FILES, ids=lambda p: p.name)
def test_every_field_has_a_comment(path):
    missing = [f"{cls}.{name}" for cls, name, line in _struct_field_lines(path) if "#" not in line]
    assert not missing, f"fields without a comment in {path.name}: {missing}"


@pytest.mark.parametrize("path", SCHEMA_FILES, ids=lambda p: p.name)
def test_schema_modules_import_no_service_code_and_no_torch(path):
    imports = [line for line in path.read_text().splitlines() if line.startswith(("import ", "from "))]
    assert not [line for line in imports if line.split()[1].split(".")[0] in ("services", "torch", "sim")]


# --- never a crash on hostile bytes ------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_VALID = encode(example(StepResults))


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_decode_or_raise_message_error(data):
    try:
        decode(StepResults, data)
    except MessageError:
        pass


@settings(max_examples=300, deadline=None)
@given(position=st.integers(0, len(_VALID) - 1), byte=st.integers(0, 255))
def test_corrupted_messages_decode_or_raise_message_error(position, byte):
    corrupted = _VALID[:position] + bytes([byte]) + _VALID[position + 1:]
    try:
        decode(RequestEvent | StepResults, corrupted)
    except MessageError:
        pass
