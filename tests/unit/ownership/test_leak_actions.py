"""Leak actions: nonce-checked delete, adopt with ownership, dismiss; all audited."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import select, update

from broker.backends.base import LABEL_INSTALLATION, LABEL_JOB, LABEL_NONCE, LABEL_SANDBOX
from broker.ledger import store
from broker.ledger.models import Event, Leak, Sandbox, utcnow
from broker.ledger.states import State
from broker.ownership.gc import run_gc
from broker.wire.request import AcquireRequest
from tests.support.web_app import ADMIN_TOKEN, csrf_of, ready_sandbox

pytestmark = pytest.mark.unit


def plant_unowned(backend, sessions, settings, job, name, *, installation=None, nonce=None):
    nonce = nonce or (name.encode().hex() + "0" * 32)[:32]
    labels = {
        LABEL_INSTALLATION: installation or settings.installation_id,
        LABEL_JOB: job,
        LABEL_NONCE: nonce,
        LABEL_SANDBOX: "b" * 32,
    }
    backend.add_pod(settings.namespace, name, labels)
    kind = "unowned_pod" if installation is None else "foreign_pod"
    with sessions.begin() as s:
        leak = store.record_leak(
            s,
            kind,
            namespace=settings.namespace,
            pod_name=name,
            nonce=nonce,
            job=job,
            detail={"labels": labels},
        )
        return leak.id, nonce


def act(client, leak_id, action, nonce, confirmed=True):
    page = client.get(f"/leaks/{leak_id}?action={action}").get_data(as_text=True)
    data = {"csrf_token": csrf_of(page), "confirm_nonce": nonce}
    if confirmed:
        data["confirmed"] = "yes"
    return client.post(f"/leaks/{leak_id}/{action}", data=data)


def leak_row(sessions, leak_id) -> Leak:
    with sessions() as s:
        return s.get(Leak, leak_id)


def admin_events(sessions, leak_id):
    with sessions() as s:
        return [
            e
            for e in s.scalars(select(Event).where(Event.kind == "admin"))
            if e.detail.get("leak_id") == leak_id
        ]


def test_unowned_pod_delete_needs_confirmation_and_the_nonce_seen(
    admin, backend, sessions, web_settings, job
):
    leak_id, nonce = plant_unowned(backend, sessions, web_settings, job, "sm-orphan-del")
    act(admin, leak_id, "delete", nonce, confirmed=False)
    assert backend.pods and leak_row(sessions, leak_id).resolved_at is None
    act(admin, leak_id, "delete", "0" * 32)
    assert backend.pods and leak_row(sessions, leak_id).resolved_at is None
    response = act(admin, leak_id, "delete", nonce)
    assert response.status_code == 302 and not backend.pods
    leak = leak_row(sessions, leak_id)
    assert leak.resolution == "deleted" and leak.resolved_by == "admin:alice"
    [event] = admin_events(sessions, leak_id)
    assert event.actor == "admin:alice" and event.detail["labels"][LABEL_NONCE] == nonce


def test_adopt_records_the_pod_with_its_nonce_so_the_gc_manages_it(
    admin, backend, sessions, web_settings, job, provider
):
    leak_id, nonce = plant_unowned(backend, sessions, web_settings, job, "sm-orphan-adopt")
    response = act(admin, leak_id, "adopt", nonce)
    assert response.status_code == 302
    with sessions() as s:
        row = s.scalars(select(Sandbox).where(Sandbox.nonce == nonce)).one()
    assert row.state == State.READY and row.pod_name == "sm-orphan-adopt"
    assert row.installation == web_settings.installation_id and row.owner == "admin:alice"
    leak = leak_row(sessions, leak_id)
    assert leak.resolution == "adopted" and leak.sandbox_id == row.id
    report = run_gc(provider)
    assert "sm-orphan-adopt" not in report.unowned_pods and backend.pods
    with sessions.begin() as s:  # lease runs out: the GC now reclaims it like any other
        s.execute(
            update(Sandbox)
            .where(Sandbox.id == row.id)
            .values(lease_expires_at=utcnow() - dt.timedelta(seconds=1))
        )
    run_gc(provider)
    assert not backend.pods
    with sessions() as s:
        assert s.get(Sandbox, row.id).state == State.DELETED


def test_adopt_refuses_an_unknown_job(admin, backend, sessions, web_settings):
    leak_id, nonce = plant_unowned(backend, sessions, web_settings, "no-such-job", "sm-o-nj")
    page = act(admin, leak_id, "adopt", nonce)
    assert page.status_code == 302
    assert leak_row(sessions, leak_id).resolved_at is None
    follow = admin.get(page.headers["Location"]).get_data(as_text=True)
    assert "not in the ledger" in follow


def test_ledger_backed_leak_is_deleted_through_the_provider(
    admin, backend, sessions, provider, job
):
    sid, token = provider.intent(AcquireRequest(job=job, image="localhost/task:1"))
    provider.create(sid, token)
    with sessions.begin() as s:  # simulate a create whose worker died mid-way
        row = s.get(Sandbox, sid)
        row.state = State.CREATING
        leak = store.record_leak(
            s,
            "stuck_create",
            namespace=row.namespace,
            pod_name=row.pod_name,
            sandbox_id=sid,
            nonce=row.nonce,
            job=job,
        )
        leak_id, nonce = leak.id, row.nonce
    view = admin.get(f"/leaks/{leak_id}").get_data(as_text=True)
    assert "already owned by a ledger row" in view
    act(admin, leak_id, "delete", nonce)
    with sessions() as s:
        assert s.get(Sandbox, sid).state == State.DELETED
        actors = {e.actor for e in s.scalars(select(Event).where(Event.sandbox_id == sid))}
    assert not backend.pods and "admin:alice" in actors
    assert leak_row(sessions, leak_id).resolution == "deleted"


def test_foreign_pods_are_never_touched_only_dismissed(app, backend, sessions, web_settings, job):
    leak_id, nonce = plant_unowned(
        backend, sessions, web_settings, job, "sm-foreign", installation="someone-else"
    )
    client = app.test_client()
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    for action in ("delete", "adopt"):
        response = client.post(
            f"/api/leaks/{leak_id}/{action}", headers=headers, json={"confirm_nonce": nonce}
        )
        assert response.status_code == 409 and "never touched" in response.json["error"]["message"]
    assert backend.pods
    ok = client.post(f"/api/leaks/{leak_id}/dismiss", headers=headers, json={})
    assert ok.status_code == 200
    leak = leak_row(sessions, leak_id)
    assert leak.resolution == "dismissed" and leak.resolved_by == "admin:api"
    again = client.post(f"/api/leaks/{leak_id}/dismiss", headers=headers, json={})
    assert again.status_code == 409


def test_unowned_pod_that_gained_a_row_is_not_deleted(
    admin, backend, sessions, web_settings, provider, job
):
    sid = ready_sandbox(provider, job)
    with sessions() as s:
        row = s.get(Sandbox, sid)
    with sessions.begin() as s:
        leak = store.record_leak(
            s,
            "unowned_pod",
            namespace=row.namespace,
            pod_name=row.pod_name,
            nonce=row.nonce,
            job=job,
        )
        leak_id = leak.id
    page = admin.get(f"/leaks/{leak_id}").get_data(as_text=True)
    assert "already owned by a ledger row" in page  # judged ledger-backed: provider path
