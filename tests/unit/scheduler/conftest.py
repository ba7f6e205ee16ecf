import pytest

from shared.profiles import LatencyProfile
from tests.unit.scheduler.sched_builders import H100_PROFILE, toy_profile


@pytest.fixture
def profile() -> LatencyProfile:
    return toy_profile()


@pytest.fixture
def h100() -> LatencyProfile:
    return LatencyProfile.load(H100_PROFILE)
