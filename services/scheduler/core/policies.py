"""Policy registry: every policy by name, with its config class and factory.

    policy = make_policy("dilaserve", {"migration_margin": 0.2}, rng=7)

Names: ``dilaserve`` and its ablations ``dilaserve-no-loadctl``, ``dilaserve-oneshot``,
``dilaserve-no-migration``; baselines ``fixed``, ``infaas``, ``infaas++``, ``llumnix``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel

from services.scheduler.core.base import Policy
from services.scheduler.core.baselines import (
    InfaasConfig,
    InfaasPlusPlusConfig,
    InfaasPolicy,
    LlumnixConfig,
    LlumnixPolicy,
)
from services.scheduler.core.dilaserve import (
    DiLaServeConfig,
    DiLaServePolicy,
    FixedConfig,
    NoLoadControlConfig,
    NoMigrationConfig,
    OneShotConfig,
)


@dataclass(frozen=True)
class PolicySpec:
    config_cls: type[BaseModel]
    factory: Callable[[Any, np.random.Generator, str], Policy]  # (config, rng, name) -> policy
    description: str


# name -> spec
POLICIES: dict[str, PolicySpec] = {
    "dilaserve": PolicySpec(DiLaServeConfig, DiLaServePolicy, "SLO-aware threshold + load control + placement"),
    "dilaserve-no-loadctl": PolicySpec(NoLoadControlConfig, DiLaServePolicy, "ablation: no load control"),
    "dilaserve-oneshot": PolicySpec(OneShotConfig, DiLaServePolicy, "ablation: prediction at arrival only"),
    "dilaserve-no-migration": PolicySpec(NoMigrationConfig, DiLaServePolicy, "ablation: no migration"),
    "fixed": PolicySpec(FixedConfig, DiLaServePolicy, "DiLaServe placement, constant threshold"),
    "infaas": PolicySpec(InfaasConfig, InfaasPolicy, "least-loaded dispatch by token count"),
    "infaas++": PolicySpec(InfaasPlusPlusConfig, LlumnixPolicy, "Llumnix dispatch, no migration"),
    "llumnix": PolicySpec(LlumnixConfig, LlumnixPolicy, "freeness dispatch and pairwise migration"),
}


def policy_names() -> list[str]:
    return list(POLICIES)


def make_config(name: str, config: BaseModel | Mapping[str, Any] | None = None) -> BaseModel:
    """The config for ``name``: its defaults, updated from a mapping, or a ready config instance."""
    spec = _spec(name)
    if type(config) is spec.config_cls:
        return config
    if isinstance(config, BaseModel):
        raise TypeError(f"policy {name} takes {spec.config_cls.__name__}, not {type(config).__name__}")
    return spec.config_cls(**dict(config or {}))


def make_policy(
    name: str,
    config: BaseModel | Mapping[str, Any] | None = None,
    *,
    rng: np.random.Generator | int | None = None,
) -> Policy:
    """Build a policy by name. ``rng``: a generator, or a seed for one (default seed 0)."""
    generator = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng or 0)
    return _spec(name).factory(make_config(name, config), generator, name)


def _spec(name: str) -> PolicySpec:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
