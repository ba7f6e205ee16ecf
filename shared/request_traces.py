"""Production request traces: arrival times and token counts from the public trace layouts, and their
replay at a chosen load. The simulator (``sim.workload``) and the load generator (``loadgen``, which
builds its requests through ``sim.workload``) both read traces here.

Layouts (``LAYOUTS``; found from the file's first line unless given):

- ``burstgpt``: CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``
  (BurstGPT_1/2), or with ``Session ID,Elapsed time`` after ``Timestamp`` (BurstGPT_3); columns are
  found by name. ``Timestamp`` in seconds; ``Response tokens`` 0 marks a failed request.
- ``azure``: CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``, the Azure LLM inference traces of 2023
  (conversation and code; Patel et al., Splitwise, ISCA 2024), timestamps as
  ``2023-11-16 18:15:46.6805900`` (any number of fractional digits).
- ``mooncake``: JSONL, one object per line with ``timestamp`` (milliseconds), ``input_length`` and
  ``output_length`` (Mooncake's traces; other keys such as ``hash_ids`` are ignored).

Every reader returns rows sorted by arrival, in seconds from the first request, with the prompt and
output token counts. A row that cannot be read raises :class:`TraceError` naming the file, the line
and the field. Rows with 0 output tokens are failed requests (BurstGPT's convention, applied to
every layout) and are dropped unless ``keep_failures``.

Replay (:meth:`RequestTrace.replay`): the *window* is the first rows of the trace (a request cap, or
the rows a duration cap holds at the replayed rate). Its *native rate* is 1 / (its mean gap between
arrivals) = (n - 1) / (last - first arrival). Given a target rate, every timestamp is divided by
``scale = target / native``, so the window's mean rate is the target and its shape (bursts, quiet
spells, the order of gaps) is the trace's; given ``time_scale``, that factor is the scale and the
replayed rate is ``native x time_scale``.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

LAYOUTS = ("burstgpt", "azure", "mooncake")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
EXPECTED = (f"BurstGPT CSV ({', '.join(BURSTGPT_COLUMNS)}), Azure CSV ({', '.join(AZURE_COLUMNS)}) "
            f"or Mooncake JSONL ({', '.join(MOONCAKE_KEYS)})")


class TraceError(ValueError):
    """A trace that cannot be read or replayed; the message names the file, the line and the field."""


class TraceRow(NamedTuple):
    arrival_s: float  # seconds from the trace's first request
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TraceReplay:
    """A window of a trace on the replay clock."""

    times: tuple[float, ...]  # arrival seconds, from 0, after scaling
    rows: tuple[TraceRow, ...]  # the window's rows (native times), one per arrival
    native_rps: float  # the window's mean rate at the trace's own timestamps
    scale: float  # replay seconds = native seconds / scale

    @property
    def rate_rps(self) -> float:
        """The replayed mean rate: native x scale."""
        return self.native_rps * self.scale


@dataclass(frozen=True)
class RequestTrace:
    path: str
    layout: str  # one of LAYOUTS
    rows: tuple[TraceRow, ...]  # by arrival, seconds from the first request

    def replay(self, *, rate_rps: float | None = None, time_scale: float | None = None,
               num_requests: int | None = None, duration_s: float | None = None) -> TraceReplay:
        """The first rows, scaled to ``rate_rps`` (mean over the window) or by ``time_scale`` (give one).

        ``num_requests`` caps the window; ``duration_s`` keeps the arrivals before that many replay
        seconds (at a target rate the window's k rows span (k - 1) / rate, so it is a count cap too).
        """
        if (rate_rps is None) == (time_scale is None):
            raise TraceError(f"{self.path}: replay needs a target rate or a time scale (one of them)")
        if rate_rps is not None and not (rate_rps > 0 and math.isfinite(rate_rps)):
            raise TraceError(f"{self.path}: target rate must be positive, got {rate_rps}")
        if time_scale is not None and not (time_scale > 0 and math.isfinite(time_scale)):
            raise TraceError(f"{self.path}: time scale must be positive, got {time_scale}")
        count = len(self.rows) if num_requests is None else min(num_requests, len(self.rows))
        if duration_s is not None:
            if rate_rps is not None:
                count = min(count, math.ceil(duration_s * rate_rps))  # (k - 1) / rate < duration
            else:
                count = sum(1 for r in self.rows[:count] if r.arrival_s / time_scale < duration_s)
        rows = self.rows[:count]
        native = native_rate(rows, self.path)
        scale = time_scale if time_scale is not None else rate_rps / native
        return TraceReplay(tuple(r.arrival_s / scale for r in rows), rows, native, scale)


def native_rate(rows: Sequence[TraceRow], path: str = "trace") -> float:
    """Mean arrival rate of ``rows`` at their own timestamps: (n - 1) / (last - first)."""
    if len(rows) < 2:
        raise TraceError(f"{path}: a rate needs at least two requests, the window holds {len(rows)}")
    span = rows[-1].arrival_s - rows[0].arrival_s
    if span <= 0:
        raise TraceError(f"{path}: all {len(rows)} requests of the window arrive at the same instant")
    return (len(rows) - 1) / span


def read_trace(path: str | Path | None, *, layout: str | None = None, models: Collection[str] = (),
               keep_failures: bool = False) -> RequestTrace:
    """Read a trace in any of ``LAYOUTS`` (``layout``: None detects it from the first line).

    ``models`` keeps only BurstGPT rows of those models (an error for layouts without a model column);
    ``keep_failures`` keeps rows with 0 output tokens.
    """
    if path is None:
        raise TraceError("arrival 'trace' needs a trace file (--trace)")
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise TraceError(f"file not found: {path}") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, not a trace file") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not a text file ({exc.reason} at byte {exc.start})") from None
    layout = layout or detect_layout(text, path)
    if layout not in LAYOUTS:
        raise TraceError(f"{path}: unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    if models and layout != "burstgpt":
        raise TraceError(f"{path}: the {layout} layout has no Model column to filter on")
    if layout == "burstgpt":
        raw = _read_burstgpt(text, path, models)
    elif layout == "azure":
        raw = _read_azure(text, path)
    else:
        raw = _read_mooncake(text, path)
    kept = [r for r in raw if r.output_tokens > 0 or keep_failures]
    if not kept:
        of_models = f" of model(s) {', '.join(models)}" if models else ""
        raise TraceError(f"{path}: no {'' if keep_failures else 'successful '}requests{of_models}")
    kept.sort()
    first = kept[0].arrival_s
    return RequestTrace(str(path), layout, tuple(TraceRow(r.arrival_s - first, r.prompt_tokens, r.output_tokens)
                                                 for r in kept))


def detect_layout(text: str, path: Path | str = "trace") -> str:
    """The layout a trace's first non-blank line announces."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if first.startswith("{"):
        return "mooncake"
    header = set(next(csv.reader([first]), []))
    if set(AZURE_COLUMNS) <= header:
        return "azure"
    if set(BURSTGPT_COLUMNS) <= header:
        return "burstgpt"
    shown = first if len(first) <= 80 else first[:77] + "..."
    raise TraceError(f"{path}:1: unknown trace layout (first line {shown!r}); expected {EXPECTED}")


def _csv_rows(text: str, path: Path, columns: tuple[str, ...]):
    """(line number, row dict) for each data row; the header must hold ``columns``."""
    reader = csv.DictReader(text.splitlines())
    missing = set(columns) - set(reader.fieldnames or [])
    if missing:
        raise TraceError(f"{path}:1: missing column(s) {', '.join(sorted(missing))}")
    for row in reader:  # (DictReader skips blank lines)
        if None in row or any(row.get(c) is None for c in columns):
            raise TraceError(f"{path}:{reader.line_num}: expected {len(reader.fieldnames)} fields "
                             f"({', '.join(reader.fieldnames)})")
        yield reader.line_num, row


def _count(value, path: Path, line: int, field: str) -> int:
    try:
        number = int(str(value).strip())
    except (TypeError, ValueError):
        raise TraceError(f"{path}:{line}: {field}: not a whole number: {value!r}") from None
    if number < 0:
        raise TraceError(f"{path}:{line}: {field}: negative: {number}")
    return number


def _seconds(value, path: Path, line: int, field: str) -> float:
    try:
        number = float(str(value).strip())
    except (TypeError, ValueError):
        raise TraceError(f"{path}:{line}: {field}: not a number: {value!r}") from None
    if not math.isfinite(number):
        raise TraceError(f"{path}:{line}: {field}: not finite: {value!r}")
    return number


def _read_burstgpt(text: str, path: Path, models: Collection[str]) -> list[TraceRow]:
    rows = []
    for line, row in _csv_rows(text, path, BURSTGPT_COLUMNS):
        ts = _seconds(row["Timestamp"], path, line, "Timestamp")
        prompt = _count(row["Request tokens"], path, line, "Request tokens")
        output = _count(row["Response tokens"], path, line, "Response tokens")
        if not models or row.get("Model") in models:
            rows.append(TraceRow(ts, prompt, output))
    return rows


def _azure_time(value, path: Path, line: int) -> tuple[int, float]:
    """``2023-11-16 18:15:46.6805900`` -> (whole POSIX seconds, UTC; the fraction), kept apart so that
    differences keep every fractional digit."""
    text = str(value).strip()
    whole, _, fraction = text.partition(".")
    try:
        stamp = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
        return int(stamp.timestamp()), (float("0." + fraction) if fraction else 0.0)
    except ValueError:
        raise TraceError(f"{path}:{line}: TIMESTAMP: expected 'YYYY-MM-DD HH:MM:SS[.fraction]', "
                         f"got {text!r}") from None


def _read_azure(text: str, path: Path) -> list[TraceRow]:
    rows, base = [], None
    for line, row in _csv_rows(text, path, AZURE_COLUMNS):
        seconds, fraction = _azure_time(row["TIMESTAMP"], path, line)
        base = seconds if base is None else base
        rows.append(TraceRow((seconds - base) + fraction, _count(row["ContextTokens"], path, line, "ContextTokens"),
                             _count(row["GeneratedTokens"], path, line, "GeneratedTokens")))
    return rows


def _read_mooncake(text: str, path: Path) -> list[TraceRow]:
    rows = []
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{line}: not a JSON object ({exc.msg})") from None
        if not isinstance(item, dict):
            raise TraceError(f"{path}:{line}: not a JSON object")
        missing = [k for k in MOONCAKE_KEYS if k not in item]
        if missing:
            raise TraceError(f"{path}:{line}: missing key(s) {', '.join(missing)}")
        ms = _seconds(item["timestamp"], path, line, "timestamp")
        rows.append(TraceRow(ms / 1000.0, _count(item["input_length"], path, line, "input_length"),
                             _count(item["output_length"], path, line, "output_length")))
    return rows
