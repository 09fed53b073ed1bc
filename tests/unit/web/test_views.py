"""Every page renders against the real ledger, with the fake backend at the pod seam."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from broker.backends.base import LABEL_INSTALLATION, LABEL_JOB, LABEL_NONCE, LABEL_SANDBOX
from broker.ledger import store
from broker.ledger.models import Event, Sandbox
from tests.support.web_app import ready_sandbox

pytestmark = pytest.mark.unit


def test_overview_shows_live_counts_charts_and_leaks(admin, provider, job, sessions):
    sid = ready_sandbox(provider, job)
    with sessions.begin() as s:
        store.record_leak(s, "unowned_pod", pod_name="sm-x", namespace="ns", job=job)
    page = admin.get("/").get_data(as_text=True)
    assert job in page and "Live sandboxes" in page and "Leaks open" in page
    assert page.count("<svg") >= 5 and "Create → Ready" in page and "(s)" in page
    assert "Redis unavailable" in page  # no Redis in unit tests: degrade, do not fail
    fragment = admin.get("/?fragment=1").get_data(as_text=True)
    assert "<html" not in fragment and job in fragment
    data = admin.get("/api/overview").json
    assert data["live_by_job"][job] == {"ready": 1}
    assert data["queue_depth"] == {"acquire": None, "release": None, "pool": None}
    assert sid


def test_sandboxes_list_filters_sorts_and_pages(admin, provider, job):
    ids = [ready_sandbox(provider, job) for _ in range(5)]
    provider.release(ids[0])
    page = admin.get(f"/sandboxes?job={job}&limit=2").get_data(as_text=True)
    assert "2 shown of 5 matching" in page and 'rel="next"' in page
    live = admin.get(f"/api/sandboxes?job={job}&state=live").json
    assert live["total"] == 4 and ids[0] not in [r["id"] for r in live["items"]]
    seen, cursor = [], None
    while True:
        url = f"/api/sandboxes?job={job}&limit=2&sort=id&order=asc"
        data = admin.get(url + (f"&cursor={cursor}" if cursor else "")).json
        seen += [r["id"] for r in data["items"]]
        cursor = data["next_cursor"]
        if not cursor:
            break
    assert seen == sorted(ids)
    back = admin.get(
        f"/api/sandboxes?job={job}&limit=2&sort=id&order=asc&cursor={data['prev_cursor']}"
    )
    assert [r["id"] for r in back.json["items"]] == sorted(ids)[2:4]
    by_q = admin.get(f"/api/sandboxes?q=sm-{ids[3]}").json
    assert [r["id"] for r in by_q["items"]] == [ids[3]]
    assert admin.get("/api/sandboxes?sort=nonce").status_code == 400
    assert admin.get("/api/sandboxes?cursor=garbage").status_code == 200  # restarts
    assert admin.get("/sandboxes?state=bogus").status_code == 400
    fragment = admin.get(f"/sandboxes?job={job}&fragment=1")
    assert fragment.status_code == 200 and "<html" not in fragment.get_data(as_text=True)
    assert admin.get("/leaks?fragment=1").status_code == 200


def test_sandbox_detail_shows_row_pod_and_history(admin, provider, job, backend):
    sid = ready_sandbox(provider, job)
    page = admin.get(f"/sandboxes/{sid}").get_data(as_text=True)
    assert "present" in page and "sandman.io/nonce" in page and "requested" in page
    detail = admin.get(f"/api/sandboxes/{sid}").json
    assert detail["pod"]["ready"] is True and detail["pod_status"] == "present"
    assert [e["to_state"] for e in detail["events"] if e["kind"] == "transition"] == [
        "ready",
        "creating",
        "requested",
    ]
    backend.pods.clear()
    assert "absent" in admin.get(f"/sandboxes/{sid}").get_data(as_text=True)
    backend.faults["get"].append("unavailable")
    assert "unavailable" in admin.get(f"/sandboxes/{sid}").get_data(as_text=True)
    assert admin.get("/sandboxes/nope").status_code == 404
    assert admin.get("/api/sandboxes/nope").status_code == 404


def test_admin_release_is_confirmed_and_audited(admin, provider, job, sessions, backend):
    from tests.support.web_app import csrf_of

    sid = ready_sandbox(provider, job)
    confirm = admin.get(f"/sandboxes/{sid}/release").get_data(as_text=True)
    assert "Release sandbox" in confirm
    with sessions() as s:
        nonce = s.get(Sandbox, sid).nonce
    bad = admin.post(
        f"/sandboxes/{sid}/release", data={"csrf_token": csrf_of(confirm), "confirm_nonce": "other"}
    )
    assert bad.status_code == 302
    ok = admin.post(
        f"/sandboxes/{sid}/release", data={"csrf_token": csrf_of(confirm), "confirm_nonce": nonce}
    )
    assert ok.status_code == 302
    with sessions() as s:
        assert s.get(Sandbox, sid).state == "deleted"
        admin_events = s.scalars(
            select(Event).where(Event.sandbox_id == sid, Event.kind == "admin")
        ).all()
        actors = {e.actor for e in s.scalars(select(Event).where(Event.sandbox_id == sid))}
    assert [e.action for e in admin_events] == ["release"] and "admin:alice" in actors
    assert not backend.pods


def test_jobs_page_shows_pacing_caps_and_pools(admin, sessions, job):
    with sessions.begin() as s:
        store.ensure_job(
            s,
            job,
            max_live=10,
            create_rate=2.0,
            warm_pools=[{"image": "localhost/task:1", "size": 3, "idle_timeout_s": 120}],
        )
    page = admin.get("/jobs").get_data(as_text=True)
    assert job in page and "localhost/task:1" in page and "120s" in page
    data = admin.get("/api/jobs").json
    mine = next(j for j in data["jobs"] if j["name"] == job)
    assert mine["max_live"] == 10 and mine["pools"][0]["size"] == 3
    assert data["pacing"]["tokens"] is None  # no Redis here


def test_audit_search_by_sandbox_nonce_job_kind_and_time(admin, provider, job, sessions):
    sid = ready_sandbox(provider, job)
    other = ready_sandbox(provider, job)
    with sessions() as s:
        nonce = s.get(Sandbox, sid).nonce
    by_sandbox = admin.get(f"/api/events?sandbox={sid}").json["items"]
    assert by_sandbox and {e["sandbox_id"] for e in by_sandbox} == {sid}
    by_nonce = admin.get(f"/api/events?nonce={nonce}&kind=transition").json["items"]
    assert {e["to_state"] for e in by_nonce} == {"requested", "creating", "ready"}
    by_job = admin.get(f"/api/events?job={job}&limit=2").json
    assert len(by_job["items"]) == 2 and by_job["next_before"]
    future = admin.get(f"/api/events?job={job}&since=2999-01-01T00:00").json["items"]
    assert future == []
    page = admin.get(f"/audit?sandbox={other}").get_data(as_text=True)
    assert other[:12] in page and sid[:12] not in page
    assert f'name="sandbox" value="{other}"' in page  # the form keeps the filter
    assert admin.get("/audit?since=yesterday").status_code == 400


def test_leaks_page_lists_open_leaks_with_labels(admin, backend, web_settings, job, sessions):
    labels = {
        LABEL_INSTALLATION: web_settings.installation_id,
        LABEL_JOB: job,
        LABEL_NONCE: "n" * 32,
        LABEL_SANDBOX: "a" * 32,
    }
    backend.add_pod(web_settings.namespace, "sm-orphan-1", labels)
    with sessions.begin() as s:
        leak = store.record_leak(
            s,
            "unowned_pod",
            namespace=web_settings.namespace,
            pod_name="sm-orphan-1",
            nonce="n" * 32,
            job=job,
            detail={"labels": labels, "reason": "no ledger row"},
        )
        leak_id = leak.id
    page = admin.get("/leaks").get_data(as_text=True)
    assert "sm-orphan-1" in page and "Resolve…" in page
    detail = admin.get(f"/leaks/{leak_id}").get_data(as_text=True)
    assert "sandman.io/nonce" in detail and "n" * 32 in detail and "do-adopt" in detail
    assert admin.get("/leaks/999999999").status_code == 404


def test_pages_degrade_when_redis_and_the_cluster_are_unreachable(
    web_settings, provider, job, tmp_path
):
    import dataclasses

    from tests.support.web_app import ADMIN_TOKEN, login
    from web.app import create_app

    sid = ready_sandbox(provider, job)
    settings = dataclasses.replace(
        web_settings, redis_url="redis://127.0.0.1:1/0", backend="kubernetes",
        kubeconfig=str(tmp_path / "missing-kubeconfig"),
    )  # fmt: skip
    app = create_app(settings)
    try:
        client = app.test_client()
        login(client, ADMIN_TOKEN)
        assert "Redis unavailable" in client.get("/").get_data(as_text=True)
        detail = client.get(f"/sandboxes/{sid}").get_data(as_text=True)
        assert "unavailable" in detail and "ready" in detail
        metrics = client.get("/metrics").get_data(as_text=True)
        assert "sandman_redis_up 0" in metrics
    finally:
        app.extensions["sandman"].dispose()


def test_warm_pool_hit_rate_counts_hand_outs(admin, provider, job, sessions):
    sid = ready_sandbox(provider, job)
    with sessions.begin() as s:
        row = s.get(Sandbox, sid)
        store.append_event(s, row, kind="pool", action="hand-out")
    data = admin.get("/api/overview").json
    assert data["warm_hits_1h"] >= 1 and data["acquires_1h"] >= 1
    assert 0 < data["warm_hit_rate"] <= 1


def test_sortable_headers_toggle_and_mark_the_sorted_column(admin, provider, job):
    ready_sandbox(provider, job)
    page = admin.get(f"/sandboxes?job={job}&sort=job&order=asc").get_data(as_text=True)
    assert 'aria-sort="ascending"' in page and "order=desc" in page
    assert admin.get(f"/sandboxes?job={job}&sort=state&order=desc").status_code == 200


def test_operator_gc_pass_is_audited(admin, sessions):
    from tests.support.web_app import csrf_of

    token = csrf_of(admin.get("/leaks").get_data(as_text=True))
    response = admin.post("/leaks/gc", data={"csrf_token": token, "dry_run": "yes"})
    assert response.status_code == 302
    flashed = admin.get("/leaks").get_data(as_text=True)
    assert "GC pass (dry run)" in flashed
    with sessions() as s:
        events = s.scalars(
            select(Event).where(Event.kind == "admin", Event.action == "gc-pass")
        ).all()
    assert events and events[-1].actor == "admin:alice" and events[-1].outcome == "dry-run"
