"""Fixtures for the reconfigurator tests."""

from __future__ import annotations

import pytest

from services.reconfigurator.core.spec import uniform_cluster
from shared.profiles import LatencyProfile
from tests.unit.reconfigurator.reconfig_builders import profile_dict


@pytest.fixture
def profile() -> LatencyProfile:
    return LatencyProfile.from_dict(profile_dict())


@pytest.fixture
def cluster16():
    return uniform_cluster(4, 4, (1, 2, 4))
