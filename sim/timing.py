"""Virtual time of a step: the latency profile, applied to the bundled model's steps.

The bundled model decodes 16 tokens in blocks of 8 (about 2-9 steps per request) where LLaDA-8B
decodes 256 in blocks of 32 (about 80 steps at threshold 0.9). The simulator keeps the model's own
step *counts* (they carry the speed-quality trade-off) and gives each step the time the profile says
a LLaDA-8B step takes on the instance's TP degree at its batch:

- the profile is *anchored* at the workload's mean context (``anchored``): its ``context_tokens``
  becomes the mean prompt-plus-generation tokens of the bundled model's requests, so the capacity and
  load formulas of the scheduler (token-steps) and the reconfigurator (context scale) count the
  bundled model's tokens against the profile consistently;
- one batched step runs at most two forwards, as the engine does: the recompute group costs
  ``alpha_d(n_recompute)`` scaled by its mean context over the anchor (``scale_context``), the
  cache group ``beta_d(n_cache)``; with no KV cache every step costs ``full_d(n)``;
- ``control_plane_s`` (default 0) is added to every step: the time a live stack spends between a
  request's consecutive steps on one instance besides the forward (the worker's state write and
  events, the results and the next command over NATS, the scheduling pass), which a GPU's step time
  does not hold. ``dls sim --control-plane-ms`` sets it to what the live stack measured
  (``loadgen.timelines``: ``dls loadgen --timelines``); the paper presets leave it at 0.
- ``time_scale`` multiplies every step time. Presets set it to (LLaDA-8B steps per request at 0.9, 80)
  / (the bundled model's, ~8), so that request latencies, SLOs and rates are on LLaDA's scale
  (seconds, ~15 req/s for 16 GPUs) and start-up times and reconfiguration periods keep their meaning.
  It is folded into the anchored profile, which the scheduler and reconfigurator also get.

The scheduler estimates each request's step at ``alpha_d(b)`` or ``beta_d(b)`` at the instance's
whole batch ``b``; the two-forward time here is at most that, so its estimates are conservative.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shared.profiles import LatencyProfile


def anchored(profile: LatencyProfile, context_tokens: float, time_scale: float = 1.0) -> LatencyProfile:
    """The same curves times ``time_scale``, measured "at" ``context_tokens`` (module docstring).

    Every core (scheduler, reconfigurator) and the timer get this profile, so estimates and virtual
    time are in the same seconds.
    """
    data = {
        "model": profile.model,
        "device": profile.device,
        "measured": profile.measured,
        "context_tokens": max(1, int(round(context_tokens))),
        "block_length": profile.block_length,
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "notes": f"{profile.notes} [sim: anchored at {context_tokens:.0f} tokens, time x{time_scale:.4g}]",
        "tp": {
            str(tp): {
                kind: {str(b): ms * time_scale for b, ms in zip(curve.batch_sizes, curve.latencies_ms, strict=True)}
                for kind, curve in kinds.items()
            }
            for tp, kinds in profile.curves.items()
        },
    }
    # what the file's loader derived or smoothed stays said (the curves are copied as loaded)
    return dataclasses.replace(LatencyProfile.from_dict(data, source="sim.timing.anchored"),
                               derived_tp=profile.derived_tp, smoothed=profile.smoothed)


@dataclass(frozen=True)
class StepTimer:
    profile: LatencyProfile  # anchored
    time_scale: float = 1.0
    scale_context: bool = True
    control_plane_s: float = 0.0  # added to every step (module docstring)

    def duration(self, tp: int, recompute_contexts: list[int], num_cache: int, no_cache: bool = False) -> float:
        """Seconds for one batched step: ``recompute_contexts`` are the full-forward requests' tokens
        (``LatencyProfile.batch_step_s``, the paced worker's model too), plus the control plane's time."""
        seconds = self.profile.batch_step_s(tp, recompute_contexts, num_cache, no_cache, self.scale_context)
        return seconds * self.time_scale + self.control_plane_s

    def isolated_latency(self, tp: int, recompute_steps: float, cache_steps: float, context: float | None = None,
                         no_cache: bool = False) -> float:
        """A request alone on an instance: its full-forward and cache steps at batch 1."""
        full = self.profile.batch_step_s(tp, [context or self.profile.context_tokens], 0, no_cache,
                                         self.scale_context)
        return (recompute_steps * full + cache_steps * self.profile.beta(tp, 1)) * self.time_scale
