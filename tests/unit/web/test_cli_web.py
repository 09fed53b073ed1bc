"""``sandman web``: registered on the CLI; ``sandman web token`` makes private token files."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from broker.cli.main import main
from broker.cli.web import gunicorn_argv

pytestmark = pytest.mark.unit


def test_web_command_is_registered_and_serves_web_wsgi():
    result = CliRunner().invoke(main, ["web", "--help"])
    assert result.exit_code == 0 and "gunicorn" in result.output
    argv = gunicorn_argv("127.0.0.1:8123", 3)
    assert argv[-1] == "web.wsgi:app" and "127.0.0.1:8123" in argv


def test_viewer_token_is_created_once_and_private(tmp_path, monkeypatch):
    monkeypatch.setenv("SANDMAN_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("SANDMAN_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("SANDMAN_ADMIN_PASSWORD", raising=False)
    runner = CliRunner()
    first = runner.invoke(main, ["web", "token", "--role", "viewer"])
    second = runner.invoke(main, ["web", "token", "--role", "viewer"])
    assert first.exit_code == 0 and first.stdout.strip() == second.stdout.strip()
    path = tmp_path / "secrets" / "web-viewer.token"
    assert path.read_text().strip() == first.stdout.strip()
    assert path.stat().st_mode & 0o777 == 0o600


def test_admin_token_command_defers_to_configured_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("SANDMAN_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("SANDMAN_ADMIN_TOKEN", "set-elsewhere")
    result = CliRunner().invoke(main, ["web", "token"])
    assert result.exit_code == 1 and "set-elsewhere" not in result.output
