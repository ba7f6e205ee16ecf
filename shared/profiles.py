"""Step-latency profiles: how long one denoising step takes on an instance.

A profile is a JSON file (see ``profiles/README.md``)::

    {
      "model": "llada-8b", "device": "H100-SXM-80GB", "measured": false,
      "dtype": "bf16", "context_tokens": 512, "block_length": 32,
      "tp": {"1": {"recompute_ms": {"1": 41.0, "8": 60.2, ...},
                   "cache_ms":     {"1": 11.3, ...}},
             "2": {...}},
      "notes": "how the numbers were obtained"
    }

``recompute_ms`` is a full forward over prompt plus generation (a block start, or every step with no
cache: ``alpha_d(b)``); ``cache_ms`` is a cache step over the current block (``beta_d(b)``). An
optional ``full_ms`` is a full step with no cache at all (it writes no KV); where it is absent,
``recompute_ms`` stands in (``full``).
Batch sizes between measured ones are interpolated linearly; beyond the largest, extrapolated from
the last two points (never below the last measured value).

Every curve must be monotone (a larger batch never faster). A file whose curves are not is refused
(``ProfileError`` naming the degree, kind and batches) unless it names the rule that smooths them:
``"batch_monotone": "min-over-larger"`` times each batch as the fastest batch at least as large (a
step of b requests can always run in the place of a larger batch's, so that time bounds it); the
points it changed are listed in ``smoothed`` and in ``notes``.

A profile measured at some TP degrees only (one GPU measures TP 1) gets the others from a modelled
profile's tensor-parallel scaling when it says so: ``"tp_scaling": {"from_tp": 1, "like":
"llada-8b-h100.json"}`` (a path relative to the profile's file) gives TP-d, for every degree ``like``
has and the file does not, as ``t_from(b) * like_d(b) / like_from(b)`` at each measured batch and
step kind (``full_ms`` follows ``like``'s full steps, its recompute steps where it has none): the
modelled profile's efficiency, all-reduces and per-step overhead, applied to the measured times.
``derived_tp`` names those degrees and ``notes`` says how they were made.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

STEP_KINDS = ("recompute_ms", "cache_ms")
OPTIONAL_STEP_KINDS = ("full_ms",)
MONOTONE_RULES = ("min-over-larger",)  # the rules ``batch_monotone`` may name (module docstring)
# a recompute step's throughput has stopped growing where doubling its batch adds less than this
# (``LatencyProfile.recompute_saturation``: the step's recompute token budget)
RECOMPUTE_GROWTH = 0.05


class ProfileError(ValueError):
    """A profile file is missing fields or has bad values."""


@dataclass(frozen=True)
class _Curve:
    """Latency (ms) as a function of batch size."""

    batch_sizes: tuple[int, ...]
    latencies_ms: tuple[float, ...]

    def at(self, batch: float) -> float:
        xs, ys = self.batch_sizes, self.latencies_ms
        if len(xs) == 1 or batch <= xs[0]:
            return ys[0]
        i = bisect.bisect_left(xs, batch)
        if i >= len(xs):
            i = len(xs) - 1
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        value = y0 + (y1 - y0) * (batch - x0) / (x1 - x0)
        return max(value, ys[-1]) if batch > xs[-1] else value


@dataclass(frozen=True)
class LatencyProfile:
    """Step latencies per TP degree, step kind and batch size."""

    model: str
    device: str
    measured: bool
    context_tokens: int
    block_length: int
    # tp degree -> step kind -> curve
    curves: dict[int, dict[str, _Curve]] = field(repr=False)
    notes: str = ""
    kv_bytes_per_token: int = 0  # KV cache of one context token, every layer and head (0: not known)
    derived_tp: tuple[int, ...] = ()  # degrees made from another's curves by ``tp_scaling``, not measured
    smoothed: tuple[str, ...] = ()  # "TP-1 cache_ms b2 48.7 -> 29.1 ms": points ``batch_monotone`` changed

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        return tuple(sorted(self.curves))

    def kv_tokens(self, tp: int, budget_bytes_per_gpu: int) -> int | None:
        """Context tokens a TP-``tp`` instance's KV caches hold when each of its GPUs gives them
        ``budget_bytes_per_gpu`` (the heads are split over the GPUs: TP-2 holds twice TP-1's); None
        when the profile does not know its model's KV bytes per token."""
        if not self.kv_bytes_per_token:
            return None
        return tp * budget_bytes_per_gpu // self.kv_bytes_per_token

    def max_batch(self, tp: int) -> int:
        return self._curve(tp, "recompute_ms").batch_sizes[-1]

    def alpha(self, tp: int, batch: float) -> float:
        """Recompute (full forward) step latency in seconds."""
        return self._curve(tp, "recompute_ms").at(batch) / 1000.0

    def beta(self, tp: int, batch: float) -> float:
        """Cache step latency in seconds."""
        return self._curve(tp, "cache_ms").at(batch) / 1000.0

    def full(self, tp: int, batch: float) -> float:
        """Full step with no KV cache (cache mode ``none``) in seconds; the recompute step if unprofiled."""
        curve = self.curves.get(tp, {}).get("full_ms")
        return curve.at(batch) / 1000.0 if curve is not None else self.alpha(tp, batch)

    def step_latency(self, tp: int, batch: float, recompute: bool) -> float:
        return self.alpha(tp, batch) if recompute else self.beta(tp, batch)

    def batch_step_s(self, tp: int, recompute_contexts: Sequence[int], num_cache: int, no_cache: bool = False,
                     scale_context: bool = True) -> float:
        """Seconds one batched step takes: the step-time model of the simulator's timer and the paced
        worker alike. A step runs at most two forwards, as the engine does: the full-forward group
        (``recompute_contexts``: each request's prompt plus canvas tokens) costs ``full_d(n)`` when
        none of them uses a cache (``no_cache``), else ``alpha_d(n)``, times its mean context over the
        profile's ``context_tokens`` when ``scale_context``; the cache group costs ``beta_d(num_cache)``."""
        seconds = 0.0
        if recompute_contexts:
            n = len(recompute_contexts)
            seconds = self.full(tp, n) if no_cache else self.alpha(tp, n)
            if scale_context and self.context_tokens:
                seconds *= sum(recompute_contexts) / n / self.context_tokens
        if num_cache:
            seconds += self.beta(tp, num_cache)
        return seconds

    def recompute_saturation(self, tp: int, growth: float = RECOMPUTE_GROWTH) -> int:
        """The batch beyond which a recompute step's throughput (requests per second of ``alpha``)
        stops growing: the smallest batch ``b`` whose double (within the profile's batches) adds less
        than ``growth`` to it. A compute-bound full forward saturates early: batching more recomputes
        into one step multiplies its latency and adds no throughput."""
        top = self.max_batch(tp)
        b = 1
        while b < top:
            nxt = min(2 * b, top)
            if (nxt / self.alpha(tp, nxt)) < (b / self.alpha(tp, b)) * (1 + growth):
                return b
            b = nxt
        return top

    def recompute_token_budget(self, tp: int, growth: float = RECOMPUTE_GROWTH) -> int:
        """The recompute tokens one step should carry (chunked prefill's token budget, for a DLM's
        full forwards): ``recompute_saturation`` requests of the profile's context."""
        return self.recompute_saturation(tp, growth) * max(self.context_tokens, 1)

    def token_steps_per_s(self, tp: int, batch: int, cache_fraction: float = 0.0) -> float:
        """Throughput in (generated token x step) units: batch requests each advance one step.

        ``cache_fraction`` is the share of steps that are cache steps; capacity for Algorithm 2 is
        this times the number of output tokens each request carries.
        """
        step_s = (1 - cache_fraction) * self.alpha(tp, batch) + cache_fraction * self.beta(tp, batch)
        return batch / step_s

    def scaled(self, factor: float) -> LatencyProfile:
        """Every latency times ``factor`` (a slower device, or a bigger model, with the same shape)."""
        if factor <= 0:
            raise ProfileError(f"scale factor must be positive, got {factor}")
        curves = {tp: {kind: _Curve(c.batch_sizes, tuple(v * factor for v in c.latencies_ms))
                       for kind, c in kinds.items()} for tp, kinds in self.curves.items()}
        notes = f"{self.notes}; latencies x{factor:g}".lstrip("; ")
        return dataclasses.replace(self, curves=curves, notes=notes)

    def with_alias(self, tp: int, like_tp: int) -> LatencyProfile:
        """This profile plus TP-``tp`` timed as TP-``like_tp`` (for degrees a profile never measured)."""
        curves = {**self.curves, tp: self.curves[like_tp]}
        notes = f"{self.notes}; TP-{tp} timed as TP-{like_tp}".lstrip("; ")
        return dataclasses.replace(self, curves=curves, notes=notes)

    def _curve(self, tp: int, kind: str) -> _Curve:
        try:
            return self.curves[tp][kind]
        except KeyError:
            raise ProfileError(f"profile {self.model}/{self.device} has no {kind} for TP {tp}") from None

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>", base_dir: Path | None = None) -> LatencyProfile:
        """``base_dir``: where a ``tp_scaling.like`` path is found (``load`` passes the file's folder)."""
        for key in ("model", "device", "tp"):
            if key not in data:
                raise ProfileError(f"{source}: missing field '{key}'")
        curves = _parse_curves(data["tp"], source)
        rule = _monotone_rule(data, source)
        smoothed = _make_monotone(curves, rule, source, set(curves))
        notes = str(data.get("notes", ""))
        derived: tuple[int, ...] = ()
        if "tp_scaling" in data:
            derived, how = _derive_tp(curves, data["tp_scaling"], source, base_dir)
            smoothed += _make_monotone(curves, rule, source, set(derived))
            notes = _add_note(notes, how)
        if smoothed:
            notes = _add_note(notes, f"smoothed ({rule}): {', '.join(smoothed)}")
        return cls(
            model=str(data["model"]),
            device=str(data["device"]),
            measured=bool(data.get("measured", False)),
            context_tokens=int(data.get("context_tokens", 0)),
            block_length=int(data.get("block_length", 0)),
            curves=curves,
            notes=notes,
            kv_bytes_per_token=int(data.get("kv_bytes_per_token", 0)),
            derived_tp=derived,
            smoothed=smoothed,
        )

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ProfileError(f"profile file not found: {path}") from None
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data, source=str(path), base_dir=path.parent)


def online_profile(model: str, tp: int, context_tokens: int, block_length: int,
                   ms_by_kind: dict[str, dict[int, float]], served_steps: int) -> LatencyProfile:
    """The profile of an instance whose worker measured its own step times (an uncalibrated model:
    ``services.worker.service.online_profile``), noisy points smoothed (``min-over-larger``); ``ProfileError``
    when a step kind is missing."""
    kinds = {kind: points for kind, points in ms_by_kind.items() if points or kind in STEP_KINDS}
    return LatencyProfile.from_dict({
        "model": model, "device": "measured by its worker", "measured": True,
        "context_tokens": context_tokens, "block_length": block_length,
        "tp": {str(tp): {kind: {str(b): ms for b, ms in points.items()} for kind, points in kinds.items()}},
        "batch_monotone": "min-over-larger",
        "notes": f"online: measured by its worker at start, {served_steps} served steps folded in",
    }, source=f"the online profile of a {model} instance")


def _add_note(notes: str, note: str) -> str:
    return f"{notes.rstrip('. ')}; {note}" if notes and note else notes or note


def _parse_curves(tp_section: dict, source: str) -> dict[int, dict[str, _Curve]]:
    curves: dict[int, dict[str, _Curve]] = {}  # tp degree -> step kind -> curve
    for tp_key, kinds in tp_section.items():
        try:
            tp = int(tp_key)
        except ValueError:
            raise ProfileError(f"{source}: tp key '{tp_key}' is not an integer") from None
        if tp < 1:
            raise ProfileError(f"{source}: tp degree {tp} must be >= 1")
        curves[tp] = {kind: _parse_curve(kinds, kind, f"{source}: tp.{tp_key}") for kind in STEP_KINDS}
        for kind in OPTIONAL_STEP_KINDS:
            if kind in kinds:
                curves[tp][kind] = _parse_curve(kinds, kind, f"{source}: tp.{tp_key}")
    if not curves:
        raise ProfileError(f"{source}: field 'tp' is empty")
    return curves


def _monotone_rule(data: dict, source: str) -> str | None:
    rule = data.get("batch_monotone")
    if rule is not None and rule not in MONOTONE_RULES:
        raise ProfileError(f"{source}: batch_monotone '{rule}' is not a known rule (one of {', '.join(MONOTONE_RULES)})")
    return rule


def _make_monotone(curves: dict[int, dict[str, _Curve]], rule: str | None, source: str,
                   degrees: set[int]) -> tuple[str, ...]:
    """Check (and, with ``rule``, smooth in place) the curves of ``degrees``: what was changed."""
    changes: list[str] = []
    for tp in sorted(degrees):
        for kind, curve in curves[tp].items():
            xs, ys = curve.batch_sizes, curve.latencies_ms
            bad = next(((xs[i], ys[i], xs[i + 1], ys[i + 1]) for i in range(len(xs) - 1) if ys[i + 1] < ys[i]), None)
            if bad is None:
                continue
            if rule is None:
                raise ProfileError(
                    f"{source}: tp.{tp}.{kind} is not monotone in batch size (batch {bad[0]}: {bad[1]:g} ms, batch "
                    f"{bad[2]}: {bad[3]:g} ms); fix the measurement, or set \"batch_monotone\": \"min-over-larger\" "
                    "to time each batch as the fastest batch at least as large")
            smooth = tuple(min(ys[i:]) for i in range(len(ys)))
            changes += [f"TP-{tp} {kind} b{b} {old:g} -> {new:g} ms"
                        for b, old, new in zip(xs, ys, smooth, strict=True) if new != old]
            curves[tp][kind] = _Curve(xs, smooth)
    return tuple(changes)


def _derive_tp(curves: dict[int, dict[str, _Curve]], scaling: dict, source: str,
               base_dir: Path | None) -> tuple[tuple[int, ...], str]:
    """Add the degrees ``scaling["like"]`` has and ``curves`` lacks (module docstring): (them, a note)."""
    if not isinstance(scaling, dict) or "from_tp" not in scaling or "like" not in scaling:
        raise ProfileError(f"{source}: tp_scaling needs 'from_tp' and 'like' (a modelled profile's file)")
    from_tp = int(scaling["from_tp"])
    if from_tp not in curves:
        raise ProfileError(f"{source}: tp_scaling.from_tp {from_tp} is not a measured degree ({sorted(curves)})")
    like_path = Path(scaling["like"])
    if not like_path.is_absolute():
        like_path = (base_dir or Path(".")) / like_path
    like = LatencyProfile.load(like_path)
    if from_tp not in like.curves:
        raise ProfileError(f"{source}: tp_scaling.like {like_path} has no TP-{from_tp} to scale from")
    derived = tuple(tp for tp in like.tp_degrees if tp not in curves)
    for tp in derived:
        curves[tp] = {kind: _scaled_curve(curve, like, kind, from_tp, tp) for kind, curve in curves[from_tp].items()}
    how = (f"TP-{', TP-'.join(map(str, derived))} derived from TP-{from_tp} times {like_path.name}'s TP-d / "
           f"TP-{from_tp} latency at each batch and step kind (its tensor-parallel model)") if derived else ""
    return derived, how


def _scaled_curve(curve: _Curve, like: LatencyProfile, kind: str, from_tp: int, tp: int) -> _Curve:
    def like_s(degree: int, batch: int) -> float:
        if kind == "full_ms":
            return like.full(degree, batch)
        return like.alpha(degree, batch) if kind == "recompute_ms" else like.beta(degree, batch)

    latencies = tuple(round(ms * like_s(tp, b) / like_s(from_tp, b), 3)
                      for b, ms in zip(curve.batch_sizes, curve.latencies_ms, strict=True))
    return _Curve(curve.batch_sizes, latencies)


def _parse_curve(kinds: dict, kind: str, where: str) -> _Curve:
    if kind not in kinds:
        raise ProfileError(f"{where}: missing '{kind}'")
    points = sorted((int(b), float(ms)) for b, ms in kinds[kind].items())
    if not points:
        raise ProfileError(f"{where}.{kind}: no batch sizes")
    for b, ms in points:
        if b < 1 or ms <= 0:
            raise ProfileError(f"{where}.{kind}: batch {b} -> {ms} ms is not positive")
    return _Curve(tuple(b for b, _ in points), tuple(ms for _, ms in points))
