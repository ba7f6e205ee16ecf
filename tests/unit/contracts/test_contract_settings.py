"""Settings per service: DLS_ environment variables, keyword overrides, documented variables."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from pydantic_settings import BaseSettings

import shared.settings as settings_module
from shared.settings import (
    SERVICE_SETTINGS,
    GatewaySettings,
    SchedulerSettings,
    ServiceSettings,
    WorkerSettings,
    env_vars,
)

README = Path(settings_module.__file__).with_name("README.md")


def test_defaults_without_environment():
    s = SchedulerSettings()
    assert (s.nats_url, s.subject_prefix, s.max_payload_bytes) == ("nats://127.0.0.1:4222", "dls", 1024 * 1024)
    assert s.thresholds == [0.5, 0.6, 0.7, 0.8, 0.9]


def test_common_and_service_variables(monkeypatch):
    monkeypatch.setenv("DLS_NATS_URL", "nats://nats:4222")
    monkeypatch.setenv("DLS_SUBJECT_PREFIX", "staging")
    monkeypatch.setenv("DLS_GATEWAY_PORT", "9001")
    monkeypatch.setenv("DLS_WORKER_GPU_IDS", "[2, 3]")
    monkeypatch.setenv("PORT", "1")  # an unprefixed variable must not leak in
    gateway, worker = GatewaySettings(), WorkerSettings()
    assert (gateway.nats_url, gateway.subject_prefix, gateway.port) == ("nats://nats:4222", "staging", 9001)
    assert (worker.nats_url, worker.gpu_ids) == ("nats://nats:4222", [2, 3])


def test_keyword_arguments_override_the_environment(monkeypatch):
    monkeypatch.setenv("DLS_GATEWAY_PORT", "9001")
    assert GatewaySettings(port=9002, redis_url="redis://r:1/0").port == 9002


def test_invalid_values_fail_loudly(monkeypatch):
    monkeypatch.setenv("DLS_SUBJECT_PREFIX", "has space")
    with pytest.raises(ValidationError, match="subject prefix"):
        ServiceSettings()
    monkeypatch.delenv("DLS_SUBJECT_PREFIX")
    with pytest.raises(ValidationError):
        WorkerSettings(max_batch=0)
    with pytest.raises(ValidationError, match="instance id 'gpu.0'"):
        WorkerSettings(instance_id="gpu.0")


def test_no_module_level_settings_objects():
    assert not [name for name, value in vars(settings_module).items() if isinstance(value, BaseSettings)]


@pytest.mark.parametrize("name", sorted(SERVICE_SETTINGS))
def test_every_variable_is_documented(name):
    text = README.read_text()
    undocumented = [var for var in env_vars(SERVICE_SETTINGS[name]) if f"`{var}`" not in text]
    assert not undocumented, f"add to shared/README.md: {undocumented}"


def test_every_variable_has_a_description():
    for cls in SERVICE_SETTINGS.values():
        assert all(env_vars(cls).values()), cls.__name__
