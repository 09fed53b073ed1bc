"""The tenants JSON API: admin-only quota changes, audited with the admin's name, answers
as the OpenAPI description says; a viewer is refused; bad input is 400, unknown 404."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from sqlalchemy import select

from broker.ledger.models import Event, Job
from tests.support.web_app import csrf_of
from tests.unit.web.test_api import check

pytestmark = pytest.mark.unit


def _post(client: Any, path: str, body: Any) -> Any:
    token = csrf_of(client.get("/").get_data(as_text=True))
    return client.post(path, json=body, headers={"X-CSRF-Token": token})


def test_a_byte_quota_goes_past_the_count_quotas_limit(admin: Any) -> None:
    spec = admin.get("/api/openapi.json").json
    name = f"team-{secrets.token_hex(3)}"
    assert _post(admin, "/api/tenants", {"name": name}).status_code == 201
    fifty_gib = _post(admin, f"/api/tenants/{name}", {"snapshot_bytes": 50 << 30})
    assert fifty_gib.status_code == 200, fifty_gib.json
    check(spec, "/api/tenants/{name}", "200", fifty_gib.json)
    assert fifty_gib.json["snapshot_bytes"] == 50 << 30
    assert (
        _post(admin, f"/api/tenants/{name}", {"snapshot_bytes": (1 << 50) + 1}).status_code == 400
    )
    assert _post(admin, f"/api/tenants/{name}", {"max_live": 50 << 30}).status_code == 400


def test_admin_creates_changes_lists_and_moves_a_job_all_audited(
    admin: Any, job: str, sessions: Any
) -> None:
    spec = admin.get("/api/openapi.json").json
    name = f"team-{secrets.token_hex(3)}"
    made = _post(admin, "/api/tenants", {"name": name, "max_live": 4})
    assert made.status_code == 201, made.json
    check(spec, "/api/tenants", "201", made.json)
    assert (made.json["max_live"], made.json["creates_per_minute"]) == (4, None)

    changed = _post(admin, f"/api/tenants/{name}", {"creates_per_minute": 30})
    assert changed.status_code == 200, changed.json
    check(spec, "/api/tenants/{name}", "200", changed.json)
    assert (changed.json["max_live"], changed.json["creates_per_minute"]) == (4, 30)
    moved = _post(admin, f"/api/jobs/{job}/tenant", {"tenant": name})
    assert moved.status_code == 200, moved.json
    check(spec, "/api/jobs/{job}/tenant", "200", moved.json)

    listed = admin.get("/api/tenants")
    check(spec, "/api/tenants", "200", listed.json, method="get")
    (mine,) = [t for t in listed.json["tenants"] if t["name"] == name]
    assert mine["jobs"] == [job] and mine["live"] == 0
    (row,) = [j for j in admin.get("/api/jobs").json["jobs"] if j["name"] == job]
    assert row["tenant"] == name
    page = admin.get("/jobs").get_data(as_text=True)
    tenants_table = page.split('id="tenants"')[1].split("</table>")[0]
    assert f"<td>{name}</td>" in tenants_table and f"<td>{job}</td>" in tenants_table
    with sessions() as session:
        assert session.get(Job, job).tenant == name
        actions = [
            (e.action, e.actor)
            for e in session.scalars(
                select(Event)
                .where(Event.kind == "admin", Event.detail["tenant"].as_string() == name)
                .order_by(Event.id)
            )
        ]
    assert actions == [
        ("tenant-create", "admin:alice"),
        ("tenant-set", "admin:alice"),
        ("job-tenant", "admin:alice"),
    ]


def test_bad_unknown_and_viewer_requests_are_refused_and_change_nothing(
    admin: Any, viewer: Any, job: str
) -> None:
    spec = admin.get("/api/openapi.json").json
    name = f"team-{secrets.token_hex(3)}"
    assert _post(admin, "/api/tenants", {"name": name}).status_code == 201
    for body in ({"max_live": -1}, {"max_live": "3"}, {"max_live": True}, {"nope": 1}, {}):
        bad = _post(admin, f"/api/tenants/{name}", body)
        assert bad.status_code == 400, (body, bad.json)
        check(spec, "/api/tenants/{name}", "400", bad.json)
    exists = _post(admin, "/api/tenants", {"name": name})
    assert exists.status_code == 409, exists.json
    check(spec, "/api/tenants", "409", exists.json)
    for path, body in (
        ("/api/tenants", {"name": "no spaces"}),
        ("/api/tenants", {"name": "é-accented"}),
        ("/api/tenants", {"name": 7}),
    ):
        assert _post(admin, path, body).status_code == 400, body
    missing = _post(admin, "/api/tenants/nobody-here", {"max_live": 1})
    assert missing.status_code == 404
    check(spec, "/api/tenants/{name}", "404", missing.json)
    assert _post(admin, f"/api/jobs/{job}/tenant", {"tenant": "nobody-here"}).status_code == 404
    assert _post(admin, "/api/jobs/no-such-job/tenant", {"tenant": name}).status_code == 404
    assert _post(viewer, f"/api/tenants/{name}", {"max_live": 1}).status_code == 403
    (mine,) = [t for t in admin.get("/api/tenants").json["tenants"] if t["name"] == name]
    assert (mine["max_live"], mine["creates_per_minute"], mine["jobs"]) == (None, None, [])
