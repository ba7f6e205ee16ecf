"""Schemathesis fuzzing of the gateway's OpenAPI schema: generated requests (valid and invalid
bodies, odd path parameters, with and without a key) against the in-process app (fake bus) never get
a 5xx, and every answer has a status code, content type and body the schema declares
(``tests/integration/test_schemathesis_stack.py`` runs the same checks against the real stack)."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from services.gateway.app import create_app
from tests.unit.gateway.gateway_builders import FakeBus
from tests.unit.gateway.gateway_builders import settings as gateway_settings

KEY = "schemathesis-key"
app = create_app(gateway_settings(api_keys=[KEY], max_request_bytes=65_536), bus=FakeBus())
schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers={"Authorization": f"Bearer {KEY}"})


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gets_a_server_error(case):
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {KEY}"}
    response = case.call()
    case.validate_response(response, checks=(not_a_server_error, status_code_conformance, content_type_conformance,
                                             response_schema_conformance))
    assert response.status_code < 500, response.text


@schema.parametrize()
@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
def test_without_a_key_every_generated_request_is_401_or_a_health_check(case):
    response = case.call()
    assert response.status_code < 500, response.text
    if case.path not in ("/health", "/healthz", "/readyz"):
        assert response.status_code == 401, (case.path, response.status_code)
