"""Login, roles, CSRF, cookie flags, and secrets kept out of logs."""

from __future__ import annotations

import logging

import pytest

from tests.support.web_app import ADMIN_PASSWORD, ADMIN_TOKEN, VIEWER_TOKEN, csrf_of, login

pytestmark = pytest.mark.unit


def test_pages_redirect_to_login_and_api_answers_401(app):
    client = app.test_client()
    page = client.get("/sandboxes")
    assert page.status_code == 302 and "/login" in page.headers["Location"]
    api = client.get("/api/overview")
    assert api.status_code == 401 and api.json["error"]["code"] == "unauthorized"
    assert client.get("/metrics").status_code == 401
    assert client.get("/api/openapi.json").status_code == 200
    assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize("secret", [ADMIN_TOKEN, ADMIN_PASSWORD])
def test_admin_logs_in_with_token_or_password(app, secret):
    client = app.test_client()
    response = login(client, secret)
    assert response.status_code == 302
    cookie = response.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Secure" not in cookie
    page = client.get("/").get_data(as_text=True)
    assert "admin:alice" in page and "role-admin" in page


def test_wrong_secret_is_refused_and_not_logged(app, caplog):
    client = app.test_client()
    with caplog.at_level(logging.DEBUG):
        response = login(client, "nope-" + ADMIN_TOKEN)
    assert response.status_code == 401
    assert "Wrong token or password" in response.get_data(as_text=True)
    assert ADMIN_TOKEN not in caplog.text and "nope-" not in caplog.text
    assert client.get("/api/overview").status_code == 401


def test_login_itself_needs_csrf(app):
    client = app.test_client()
    client.get("/login")
    response = client.post("/login", data={"secret": ADMIN_TOKEN})
    assert response.status_code == 403


def test_open_redirect_is_refused(app):
    client = app.test_client()
    page = client.get("/login?next=https://evil.example/")
    response = client.post(
        "/login?next=https://evil.example/",
        data={"secret": ADMIN_TOKEN, "csrf_token": csrf_of(page.get_data(as_text=True))},
    )
    assert response.headers["Location"] == "/"


def test_viewer_reads_but_cannot_act(viewer):
    assert viewer.get("/").status_code == 200
    assert viewer.get("/api/overview").status_code == 200
    page = viewer.get("/leaks").get_data(as_text=True)
    assert "Run GC pass" not in page
    token = csrf_of(page)
    response = viewer.post("/leaks/gc", data={"csrf_token": token, "dry_run": "yes"})
    assert response.status_code == 403


def test_state_changing_post_without_csrf_is_refused(admin):
    assert admin.post("/leaks/gc", data={"dry_run": "yes"}).status_code == 403
    bad = admin.post("/leaks/gc", data={"dry_run": "yes", "csrf_token": "forged"})
    assert bad.status_code == 403


def test_cross_origin_post_is_refused_even_with_token(admin):
    token = csrf_of(admin.get("/leaks").get_data(as_text=True))
    response = admin.post(
        "/leaks/gc",
        data={"csrf_token": token, "dry_run": "yes"},
        headers={"Origin": "https://evil.example"},
    )
    assert response.status_code == 403


def test_bearer_tokens_for_api_and_metrics(app):
    client = app.test_client()
    for token in (ADMIN_TOKEN, VIEWER_TOKEN):
        headers = {"Authorization": f"Bearer {token}"}
        assert client.get("/api/overview", headers=headers).status_code == 200
        assert client.get("/metrics", headers=headers).status_code == 200
    assert client.get("/api/overview", headers={"Authorization": "Bearer x"}).status_code == 401
    viewer = {"Authorization": f"Bearer {VIEWER_TOKEN}"}
    assert client.post("/api/leaks/1/dismiss", headers=viewer, json={}).status_code == 403


def test_rotating_a_token_ends_sessions_made_with_it(app, web_settings, admin):
    import dataclasses

    from web.app import create_app

    assert admin.get("/").status_code == 200
    rotated = create_app(dataclasses.replace(web_settings, admin_token="new-" + ADMIN_TOKEN))
    client = rotated.test_client()
    cookie = admin.get_cookie("sandman_session")
    client.set_cookie("sandman_session", cookie.value)
    assert client.get("/").status_code == 302
    rotated.extensions["sandman"].dispose()


def test_logout_clears_the_session(admin):
    token = csrf_of(admin.get("/").get_data(as_text=True))
    assert admin.post("/logout", data={"csrf_token": token}).status_code == 302
    assert admin.get("/").status_code == 302


def test_generated_admin_token_and_session_key_are_private_files(tmp_path, database_url):
    from broker.settings import Settings
    from web import security

    settings = Settings(state_dir=tmp_path, database_url=database_url)
    creds = security.credentials(settings)
    assert [c.role for c in creds] == ["admin"] and len(creds[0].value) >= 32
    key = security.session_key(settings)
    for name in ("web-admin.token", "web-session.key"):
        path = tmp_path / "secrets" / name
        assert path.stat().st_mode & 0o777 == 0o600
    assert security.session_key(settings) == key
    assert creds[0].value not in repr(creds)


def test_security_headers(admin):
    response = admin.get("/")
    assert "default-src 'self'" in response.headers["Content-Security-Policy"]
    assert response.headers["X-Frame-Options"] == "DENY"


def test_viewer_token_and_secure_cookie_settings_are_honoured(web_settings):
    """SANDMAN_VIEWER_TOKEN replaces the token file; SANDMAN_WEB_COOKIE_SECURE sets Secure."""
    import dataclasses

    from web.app import create_app

    app = create_app(
        dataclasses.replace(
            web_settings, viewer_token="field-viewer-token-0123456789", web_cookie_secure=True
        )
    )
    try:
        client = app.test_client()
        response = login(client, "field-viewer-token-0123456789", "carol")
        assert response.status_code == 302 and "Secure" in response.headers["Set-Cookie"]
        assert login(app.test_client(), VIEWER_TOKEN).status_code == 401  # file ignored now
    finally:
        app.extensions["sandman"].dispose()
