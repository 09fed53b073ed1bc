"""``sandman job create --egress``: the job's egress policy in the ledger (PostgreSQL)."""

from __future__ import annotations

import json
import secrets

import pytest
from click.testing import CliRunner

from broker.cli.main import main
from broker.ledger import store

pytestmark = pytest.mark.integration


def _create(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["job", "create", *args])
    return result.exit_code, result.output


def test_job_egress_allow_deny_and_cidrs(sessions, database_url, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SANDMAN_DATABASE_URL", database_url)
    job = f"egress-{secrets.token_hex(3)}"
    # Documentation ranges only (RFC 5737, RFC 3849): nothing here sends traffic.
    code, out = _create(job, "--egress", "192.0.2.0/24, 2001:db8::/32")
    assert code == 0, out
    shown = json.loads(out.splitlines()[-1])
    assert shown["egress"] == "allowlist"
    assert shown["egress_allow"] == ["192.0.2.0/24", "2001:db8::/32"]
    with sessions() as session:
        row = store.get_job(session, job)
        assert (row.egress, row.egress_allow) == ("allowlist", ["192.0.2.0/24", "2001:db8::/32"])

    code, out = _create(job, "--egress", "deny")  # an update: the old holes are gone
    assert code == 0, out
    with sessions() as session:
        row = store.get_job(session, job)
        assert (row.egress, row.egress_allow) == ("deny", [])

    code, out = _create(job, "--rate", "2")  # no --egress: the policy is kept
    assert code == 0, out
    with sessions() as session:
        assert store.get_job(session, job).egress == "deny"

    for bad in ("192.0.2.1/24", "everything", ""):  # host bits set, a word, empty
        code, out = _create(job, "--egress", bad)
        assert code != 0 and "--egress" in out, out
    with sessions() as session:
        assert store.get_job(session, job).egress == "deny"


def test_job_idle_timeout_set_kept_and_turned_off(sessions, database_url, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SANDMAN_DATABASE_URL", database_url)
    job = f"idle-{secrets.token_hex(3)}"
    code, out = _create(job)
    assert code == 0, out
    assert json.loads(out.splitlines()[-1])["idle_timeout_s"] is None  # off unless asked
    code, out = _create(job, "--idle-timeout-s", "90")
    assert code == 0 and json.loads(out.splitlines()[-1])["idle_timeout_s"] == 90.0, out
    code, out = _create(job, "--rate", "2")  # not given: kept
    assert code == 0 and json.loads(out.splitlines()[-1])["idle_timeout_s"] == 90.0, out
    code, out = _create(job, "--idle-timeout-s", "-1")
    assert code != 0 and "--idle-timeout-s" in out, out
    code, out = _create(job, "--idle-timeout-s", "0")
    assert code == 0, out
    with sessions() as session:
        assert store.get_job(session, job).idle_timeout_s is None
