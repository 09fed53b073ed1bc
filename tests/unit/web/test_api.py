"""The JSON API conforms to its OpenAPI description; /metrics parses as Prometheus text."""

from __future__ import annotations

import pytest
from openapi_schema_validator import OAS31Validator
from openapi_spec_validator import validate as validate_spec
from prometheus_client.parser import text_string_to_metric_families

from broker.ledger import store
from tests.support.web_app import ADMIN_TOKEN, ready_sandbox

pytestmark = pytest.mark.unit


def check(spec, path: str, status: str, body, method: str = "") -> None:
    method = method or ("post" if "post" in spec["paths"][path] else "get")
    schema = spec["paths"][path][method]["responses"][status]["content"]["application/json"]
    OAS31Validator({**schema["schema"], "components": spec["components"]}).validate(body)


def test_openapi_document_is_valid(app):
    spec = app.test_client().get("/api/openapi.json").json
    validate_spec(spec)
    assert spec["openapi"].startswith("3.1")


def test_every_endpoint_answers_as_described(admin, provider, job, sessions):
    spec = admin.get("/api/openapi.json").json
    sid = ready_sandbox(provider, job)
    with sessions.begin() as s:
        leak = store.record_leak(
            s, "unowned_pod", pod_name="sm-gone", namespace="nowhere", nonce="f" * 32, job=job
        )
        leak_id = leak.id
    check(spec, "/api/overview", "200", admin.get("/api/overview").json)
    check(spec, "/api/sandboxes", "200", admin.get(f"/api/sandboxes?job={job}").json)
    check(spec, "/api/sandboxes", "400", admin.get("/api/sandboxes?limit=x").json)
    check(spec, "/api/sandboxes/{sandbox_id}", "200", admin.get(f"/api/sandboxes/{sid}").json)
    check(spec, "/api/sandboxes/{sandbox_id}", "404", admin.get("/api/sandboxes/zz").json)
    check(spec, "/api/leaks", "200", admin.get("/api/leaks?status=all").json)
    check(spec, "/api/jobs", "200", admin.get("/api/jobs").json)
    check(spec, "/api/events", "200", admin.get(f"/api/events?job={job}").json)
    check(spec, "/api/events", "400", admin.get("/api/events?kind=nope").json)
    token = admin.get("/").get_data(as_text=True).split('name="csrf_token" value="')[1][:32]
    token = token.split('"')[0]
    refused = admin.post(
        f"/api/leaks/{leak_id}/delete",
        json={"confirm_nonce": "f" * 32},
        headers={"X-CSRF-Token": token},
    )
    assert refused.status_code == 409
    check(spec, "/api/leaks/{leak_id}/{action}", "409", refused.json)
    done = admin.post(f"/api/leaks/{leak_id}/dismiss", json={}, headers={"X-CSRF-Token": token})
    check(spec, "/api/leaks/{leak_id}/{action}", "200", done.json)
    check(
        spec,
        "/api/leaks/{leak_id}/{action}",
        "404",
        admin.post("/api/leaks/0/dismiss", json={}, headers={"X-CSRF-Token": token}).json,
    )


def test_metrics_are_prometheus_text_with_the_promised_families(admin, provider, job):
    ready_sandbox(provider, job)
    response = admin.get("/metrics")
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(response.get_data(as_text=True))}
    for name in (
        "sandman_acquire_latency_seconds",
        "sandman_create_to_ready_seconds",
        "sandman_live_pods",
        "sandman_leaks_open",
        "sandman_pacer_tokens",
        "sandman_gc_pass_duration_seconds",
        "sandman_queue_depth",
    ):
        assert name in families, name
    ready = families["sandman_create_to_ready_seconds"]
    assert ready.type == "histogram"
    count = next(s.value for s in ready.samples if s.name.endswith("_count"))
    inf = next(s.value for s in ready.samples if s.labels.get("le") == "+Inf")
    assert count == inf >= 1
    live = [s for s in families["sandman_live_pods"].samples if s.labels["job"] == job]
    assert [(s.labels["state"], s.value) for s in live] == [("ready", 1.0)]


def test_hostile_inputs_get_documented_errors_not_500(admin):
    import base64
    import json

    cursor = base64.urlsafe_b64encode(json.dumps(["bogus", "x", "next"]).encode()).decode()
    long_q = "x" * 254
    for url, status in (
        ("/api/sandboxes?job=a%00b", 200),  # matches nothing: no stored name has NUL
        ("/api/events?nonce=%00", 200),
        ("/api/sandboxes/a%00b", 404),
        ("/api/events?until=", 400),
        (f"/api/sandboxes?sort=state&cursor={cursor}", 200),  # unreadable: first page
        ("/api/sandboxes?limit=0", 400),
        (f"/api/sandboxes?q={long_q}", 400),
        ("/api/leaks?before=", 400),
        ("/api/leaks?kind=garbage", 400),  # not a leak kind: refused, not an empty 200
        ("/api/leaks?kind=" + "x" * 40, 400),
        ("/api/leaks?kind=", 200),  # every kind
        ("/api/leaks?kind=stuck_create", 200),
        ("/leaks?kind=garbage", 400),  # the page shares the filter
        ("/api/leaks?before=0", 400),
        ("/api/leaks?before=99999999999999999999999", 400),
        ("/api/events?before=-1", 400),
        ("/api/events?since=2000-01-01T23:59:60Z", 400),
        ("/api/sandboxes/" + "x" * 300, 404),
        ("/api/events?sandbox=" + "0" * 33, 400),
    ):
        response = admin.get(url)
        assert response.status_code == status, (url, response.status_code)
        if status != 200 and url.startswith("/api/"):
            assert set(response.json["error"]) == {"code", "message"}
    token = admin.get("/").get_data(as_text=True).split('name="csrf_token" value="')[1]
    token = token.split('"')[0]
    huge = admin.post(
        "/api/leaks/99999999999999999999/dismiss", json={}, headers={"X-CSRF-Token": token}
    )
    assert huge.status_code == 404
    bearer = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    trace = admin.application.test_client().open("/api/overview", method="TRACE", headers=bearer)
    assert trace.status_code == 405 and "GET" in trace.headers["Allow"]
    odd = admin.post(
        "/api/leaks/1/delete", json={"confirm_nonce": 5}, headers={"X-CSRF-Token": token}
    )
    assert odd.status_code == 400


def test_image_pulls_reach_metrics_and_the_overview(admin, provider, job, sessions):
    """Rows the node marked pulled / not pulled (set at the ledger seam: the fake backend
    has no node) are counted per image in /metrics and the overview's pull table."""
    from broker.ledger.models import Sandbox

    image = f"localhost/pull-share-{job}:1"
    sids = [ready_sandbox(provider, job) for _ in range(4)]
    with sessions.begin() as s:
        for n, sid in enumerate(sids):
            row = s.get(Sandbox, sid)
            row.image = image
            row.image_pulled = n == 0
            row.image_pull_s = 4.5 if n == 0 else None
    text = admin.get("/metrics").get_data(as_text=True)
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(family: str) -> float:
        return next(s.value for s in families[family].samples if s.labels.get("image") == image)

    assert value("sandman_image_starts") == 4
    assert value("sandman_image_pulls") == 1
    assert value("sandman_image_pull_seconds") == 4.5
    page = admin.get("/").get_data(as_text=True)
    table = page.split('id="image-pulls"', 1)[1].split("</table>", 1)[0]
    row = table.split(image, 1)[1].split("</tr>", 1)[0]
    assert ">4<" in row and ">1<" in row and "25%" in row and "4.50 s" in row
