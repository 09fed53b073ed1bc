"""Fixtures for the admin UI: an app on the real test PostgreSQL, logged-in clients, seeds.

Unit tests use ``tests.support.fakes.FakeBackend`` at the backend seam and no Redis; the
integration tests (``test_e2e_browser``, ``test_web_redis``) use real services.
"""

from __future__ import annotations

import itertools
import re
import secrets
from pathlib import Path

import pytest

from broker.ledger import store
from broker.ownership.provider import Provider
from broker.settings import Settings
from broker.wire.request import AcquireRequest
from tests.support.fakes import FakeBackend

ADMIN_TOKEN = "admin-" + "t" * 24
ADMIN_PASSWORD = "correct horse battery staple"
VIEWER_TOKEN = "viewer-" + "v" * 24
_jobs = itertools.count()


def write_viewer_token(state_dir: Path, token: str = VIEWER_TOKEN) -> None:
    path = state_dir / "secrets" / "web-viewer.token"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(token)
    path.chmod(0o600)


@pytest.fixture
def web_settings(tmp_path, database_url) -> Settings:
    write_viewer_token(tmp_path)
    return Settings(
        state_dir=tmp_path,
        database_url=database_url,
        redis_url="",
        admin_token=ADMIN_TOKEN,
        admin_password=ADMIN_PASSWORD,
        secret_key="s" * 32,
        installation_id=f"web-{tmp_path.name[-10:]}",
    )


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def app(web_settings, backend):
    from broker.acquire.root import WEB, Root
    from web.app import create_app

    app = create_app(web_settings, Root(web_settings, WEB, backend=backend, actor="web"))
    app.config["TESTING"] = True
    yield app
    app.extensions["sandman"].dispose()


@pytest.fixture
def provider(web_settings, sessions, backend) -> Provider:
    return Provider(web_settings, sessions, backend, sleep=lambda s: None, probe=lambda a, t: True)


@pytest.fixture
def job(sessions) -> str:
    name = f"wj-{secrets.token_hex(3)}-{next(_jobs)}"
    with sessions.begin() as s:
        store.ensure_job(s, name, readiness_budget_s=5.0, lease_s=60.0)
    return name


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert found, "no CSRF token in the page"
    return found.group(1)


def login(client, secret: str, name: str = "alice"):
    page = client.get("/login")
    return client.post(
        "/login",
        data={"secret": secret, "name": name, "csrf_token": csrf_of(page.get_data(as_text=True))},
    )


@pytest.fixture
def admin(app):
    client = app.test_client()
    assert login(client, ADMIN_TOKEN).status_code == 302
    return client


@pytest.fixture
def viewer(app):
    client = app.test_client()
    assert login(client, VIEWER_TOKEN, "bob").status_code == 302
    return client


def ready_sandbox(provider: Provider, job: str) -> str:
    sid, token = provider.intent(AcquireRequest(job=job, image="localhost/task:1"))
    provider.create(sid, token)
    return sid
