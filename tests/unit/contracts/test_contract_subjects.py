"""The subject helper: every subject under one prefix, ids validated."""

from __future__ import annotations

import pytest

from shared.subjects import SubjectError, Subjects, check_id


def test_default_subjects():
    s = Subjects()
    assert (s.intake_stream, s.intake, s.cancel) == ("DLS_REQUESTS", "dls.requests", "dls.cancel")
    assert (s.step("w-0"), s.step_all, s.results) == ("dls.step.w-0", "dls.step.*", "dls.results")
    assert (s.events("cmpl-1f2e"), s.events_all) == ("dls.events.cmpl-1f2e", "dls.events.*")
    assert (s.predict, s.heartbeat, s.stats) == ("dls.predict", "dls.heartbeat", "dls.stats")
    assert (s.plans, s.plans_ack) == ("dls.plans", "dls.plans.ack")


def test_custom_and_dotted_prefixes():
    assert Subjects("t1").step("w0") == "t1.step.w0"
    staging = Subjects("dls.staging")
    assert staging.results == "dls.staging.results"
    assert staging.intake_stream == "DLS_STAGING_REQUESTS"  # stream names may not contain dots


def test_every_subject_shares_the_prefix():
    s = Subjects("pfx")
    names = [s.intake, s.cancel, s.step("i"), s.results, s.events("r"), s.predict, s.heartbeat, s.stats, s.plans,
             s.plans_ack]
    assert all(name.startswith("pfx.") for name in names)
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("bad", ["a b", "a.b", "a*", ">", "tab\there", "new\nline", ""])
def test_bad_request_ids_are_named_in_the_error(bad):
    with pytest.raises(SubjectError, match="request id"):
        Subjects().events(bad)


def test_bad_instance_id_error_names_it():
    with pytest.raises(SubjectError, match=r"instance id 'gpu 0'.*' '"):
        Subjects().step("gpu 0")


@pytest.mark.parametrize("bad", ["", "a..b", "a.*", "has space", ">"])
def test_bad_prefixes_are_refused(bad):
    with pytest.raises(SubjectError, match="prefix"):
        Subjects(bad)


def test_check_id_returns_good_ids():
    assert check_id("cmpl-9f_A:1") == "cmpl-9f_A:1"
