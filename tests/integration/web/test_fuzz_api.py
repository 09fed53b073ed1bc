"""schemathesis against the admin JSON API's own OpenAPI description (in-process WSGI).

docs/web.md records a full run (coverage, fuzzing and stateful phases) against gunicorn;
this is the bounded version that keeps it true in the suite: every operation, a few
examples each, all of schemathesis' checks (no 5xx, status codes and bodies conform to the
document), with the admin bearer token. Plus: without a token every operation is a 401.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from broker.settings import Settings
from tests.support.fakes import FakeBackend

pytestmark = pytest.mark.integration
TOKEN = "admin-" + secrets.token_hex(16)


def _app(database_url: str, state: Path):  # type: ignore[no-untyped-def]
    from broker.acquire.root import WEB, Root
    from web.app import create_app

    settings = Settings(
        state_dir=state,
        database_url=database_url,
        redis_url="",
        admin_token=TOKEN,
        secret_key=secrets.token_hex(16),
        installation_id=f"st-{secrets.token_hex(3)}",
    )
    return create_app(settings, Root(settings, WEB, backend=FakeBackend()))


@pytest.fixture(scope="module")
def wsgi_app(database_url: str, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    app = _app(database_url, tmp_path_factory.mktemp("web-fuzz"))
    yield app
    app.extensions["sandman"].dispose()


def _operations(wsgi_app):  # type: ignore[no-untyped-def]
    schema = schemathesis.openapi.from_wsgi("/api/openapi.json", wsgi_app)
    ops = [result.ok() for result in schema.get_all_operations()]
    assert len(ops) >= 7
    return ops


def test_api_conforms_to_its_openapi_document(wsgi_app):  # type: ignore[no-untyped-def]
    """Every operation, 5 generated cases each, every schemathesis check."""
    for op in _operations(wsgi_app):

        @given(case=op.as_strategy())
        @settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
        def run(case):  # type: ignore[no-untyped-def]
            case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"})

        run()


def test_every_operation_needs_a_token(wsgi_app):  # type: ignore[no-untyped-def]
    for op in _operations(wsgi_app):

        @given(case=op.as_strategy())
        @settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
        def run(case):  # type: ignore[no-untyped-def]
            for headers in ({}, {"Authorization": "Bearer not-" + TOKEN}):
                response = case.call(headers=headers)
                # GETs: 401. POSTs may be refused earlier by the CSRF guard (403): either way
                # nothing happens without a valid token.
                allowed = (401,) if case.method == "GET" else (401, 403)
                assert response.status_code in allowed, (case.method, case.formatted_path)

        run()
