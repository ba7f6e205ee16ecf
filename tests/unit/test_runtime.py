"""shared.runtime: the event loop the services run on."""

from __future__ import annotations

import asyncio

import pytest

from shared.runtime import EVENT_LOOP_ENV, event_loop_name, run


def test_uvloop_is_the_default_and_asyncio_can_be_forced(monkeypatch):
    monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    assert event_loop_name() == "uvloop"  # a project dependency
    monkeypatch.setenv(EVENT_LOOP_ENV, "asyncio")
    assert event_loop_name() == "asyncio"


@pytest.mark.parametrize("name", ["uvloop", "asyncio"])
def test_run_uses_the_chosen_loop(monkeypatch, name):
    monkeypatch.setenv(EVENT_LOOP_ENV, name)

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run(loop_module()).startswith("uvloop" if name == "uvloop" else "asyncio")


def test_an_unknown_loop_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(EVENT_LOOP_ENV, "trio")
    with pytest.raises(ValueError, match="DLS_EVENT_LOOP"):
        event_loop_name()
