"""The composition root: parts built lazily from Settings, never a service started.

Fakes only at the backend seam (``FakeBackend``); the ledger is the test PostgreSQL.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import select, text

from broker.acquire.root import TOOL, WEB, WORKER, Root
from broker.errors import ServiceUnavailable
from broker.ledger.models import Event, Sandbox
from broker.ledger.states import State
from broker.ownership import operator
from broker.settings import Settings
from broker.wire.services import known_urls, urls_file
from tests.support.fakes import FakeBackend
from tests.support.web_app import ready_sandbox

pytestmark = pytest.mark.unit


def test_without_urls_the_root_starts_nothing_and_says_what_to_do(tmp_path: Path) -> None:
    root = Root(Settings(state_dir=tmp_path), WEB)
    with pytest.raises(ServiceUnavailable, match="sandman services up"):
        root.sessions  # noqa: B018 (the property builds the engine)
    assert root.redis() is None and "SANDMAN_REDIS_URL" in (root.redis_error or "")
    with pytest.raises(ServiceUnavailable):
        root.need_redis()
    assert not (tmp_path / "postgres").exists() and not (tmp_path / "redis").exists()


def test_urls_come_from_the_settings_first_then_the_recorded_file(
    tmp_path: Path, database_url: str
) -> None:
    urls_file(Settings(state_dir=tmp_path)).parent.mkdir(parents=True)
    urls_file(Settings(state_dir=tmp_path)).write_text(
        json.dumps({"database_url": database_url, "redis_url": "redis://127.0.0.1:1/0"})
    )
    recorded = known_urls(Settings(state_dir=tmp_path))
    assert recorded.database_url == database_url
    assert known_urls(Settings(state_dir=tmp_path, redis_url="redis://x/1")).redis_url == (
        "redis://x/1"
    )
    root = Root(Settings(state_dir=tmp_path), TOOL)
    try:
        with root.sessions() as session:
            assert session.execute(text("SELECT 1")).scalar() == 1
    finally:
        root.dispose()


def test_a_web_root_reports_an_unbuildable_backend_and_a_worker_root_raises_it(
    tmp_path: Path, database_url: str
) -> None:
    settings = Settings(
        state_dir=tmp_path,
        database_url=database_url,
        backend="kubernetes",
        kubeconfig=str(tmp_path / "missing-kubeconfig"),
    )
    web = Root(settings, WEB)
    assert web.backend() is None and web.backend_error
    assert web.backend() is None  # inside the retry window: no second attempt
    with pytest.raises(Exception) as caught:
        Root(settings, WORKER).need_backend()
    assert type(caught.value).__name__ in (web.backend_error or "")


def test_providers_are_built_once_per_actor_over_the_one_backend(
    web_settings: Settings, database_url: str
) -> None:
    backend = FakeBackend()
    root = Root(web_settings, TOOL, backend=backend, actor="cli")
    try:
        alice, again, default = (
            root.provider("admin:alice"),
            root.provider("admin:alice"),
            (root.provider()),
        )
        assert alice is again and alice.actor == "admin:alice" and default.actor == "cli"
        assert alice.backend is backend is default.backend
    finally:
        root.dispose()


def test_operator_release_is_audited_as_the_operator(
    web_settings: Settings, backend: FakeBackend, provider, job: str, sessions
) -> None:
    root = Root(web_settings, WEB, backend=backend)
    try:
        sid = ready_sandbox(provider, job)  # a provider whose readiness probe is faked
        operator.release_by_operator(root.provider("admin:carol"), sid)
        with sessions() as s:
            assert s.get(Sandbox, sid).state == State.DELETED
            event = s.scalars(
                select(Event).where(Event.sandbox_id == sid, Event.kind == "admin")
            ).one()
        assert event.actor == "admin:carol" and event.detail["from_state"] == "ready"
    finally:
        root.dispose()


def test_a_gc_pass_without_redis_still_runs_and_is_audited(
    web_settings: Settings, sessions
) -> None:
    root = Root(web_settings, WEB, backend=FakeBackend())
    try:
        done = root.gc.run_and_publish(actor="admin:dan", dry_run=True, audit=True)
        assert done.report.dry_run and done.summary["by"] == "admin:dan"
        with sessions() as s:
            actions = [
                e.outcome
                for e in s.scalars(select(Event).where(Event.actor == "admin:dan"))
                if e.action == "gc-pass"
            ]
        assert actions == ["dry-run"]
    finally:
        root.dispose()


def test_services_up_records_its_urls_for_processes_that_start_nothing(
    sandman_settings: Settings, service_urls
) -> None:
    assert known_urls(sandman_settings) == service_urls
    assert urls_file(sandman_settings).stat().st_mode & 0o777 == 0o600  # it holds passwords
