import pytest

from broker.errors import ConfigError
from broker.settings import Settings, redact_url

pytestmark = pytest.mark.unit


def test_reads_prefixed_variables_with_types(tmp_path):
    env = {
        "SANDMAN_STATE_DIR": str(tmp_path),
        "SANDMAN_CREATE_RATE": "7.5",
        "SANDMAN_CREATE_BURST": "3",
        "SANDMAN_BACKEND": "kubernetes",
        "OTHER": "ignored",
    }
    s = Settings.from_env(env)
    assert s.state_dir == tmp_path
    assert s.create_rate == 7.5 and s.create_burst == 3
    assert s.backend == "kubernetes"


def test_overrides_win_over_environment():
    s = Settings.from_env({"SANDMAN_CREATE_RATE": "2"}, create_rate=9.0)
    assert s.create_rate == 9.0


def test_environment_is_not_read_at_import(monkeypatch):
    monkeypatch.setenv("SANDMAN_CREATE_RATE", "3")
    assert Settings.from_env({}).create_rate == Settings().create_rate
    assert Settings.from_env().create_rate == 3.0


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SANDMAN_CREATE_RATE", "fast"),
        ("SANDMAN_BACKEND", "docker"),
        ("SANDMAN_CREATE_RATE", "0"),
        ("SANDMAN_SNAPSHOT_TTL_S", "0"),
        ("SANDMAN_SNAPSHOT_GRACE_S", "-1"),
    ],
)
def test_bad_values_raise_typed_error(name, value):
    with pytest.raises(ConfigError) as info:
        Settings.from_env({name: value})
    assert isinstance(info.value, ValueError)


def test_redacted_view_hides_secrets():
    s = Settings.from_env(
        {
            "SANDMAN_ADMIN_TOKEN": "tok-secret",
            "SANDMAN_DATABASE_URL": "postgresql://u:pw-secret@h:5432/db",
            "SANDMAN_REDIS_URL": "redis://:r-secret@h:6379/0",
        }
    )
    shown = repr(s.redacted())
    for secret in ("tok-secret", "pw-secret", "r-secret"):
        assert secret not in shown
    assert s.redacted()["admin_token"] == "***"


def test_redact_url_keeps_urls_without_password():
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redact_url("postgresql://u:p@h/db") == "postgresql://u:***@h/db"
