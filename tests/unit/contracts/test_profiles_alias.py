"""A profile lacking a TP degree can time it as another (the scheduler plans an unprofiled TP-2
instance on the CPU profile as TP-1)."""

import pytest

from shared.profiles import LatencyProfile, ProfileError


def test_alias_adds_a_degree_with_the_other_degrees_curves():
    profile = LatencyProfile.load("models/dls-tiny/calibration/profile.json")
    with pytest.raises(ProfileError):
        profile.alpha(2, 1)
    aliased = profile.with_alias(2, 1)
    assert aliased.tp_degrees == (1, 2)
    assert aliased.alpha(2, 4) == profile.alpha(1, 4) and aliased.beta(2, 8) == profile.beta(1, 8)
    assert "TP-2 timed as TP-1" in aliased.notes and profile.tp_degrees == (1,)


def test_scaled_profile_multiplies_every_latency():
    profile = LatencyProfile.load("profiles/llada-8b-h100.json")
    slow = profile.scaled(4.0)
    for tp in profile.tp_degrees:
        assert slow.alpha(tp, 3) == pytest.approx(4 * profile.alpha(tp, 3))
        assert slow.beta(tp, 5) == pytest.approx(4 * profile.beta(tp, 5))
    with pytest.raises(ProfileError):
        profile.scaled(0)
