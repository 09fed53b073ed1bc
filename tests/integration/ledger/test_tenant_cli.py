"""``sandman tenant create|set|ls`` and ``sandman job create --tenant`` on the real ledger:
each change is written, audited as ``cli:<user>``, and a bad value changes nothing."""

from __future__ import annotations

import getpass
import json
import secrets
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from broker.cli.main import main
from broker.ledger.models import Event, Job
from tests.support.audit import weight_changes

pytestmark = pytest.mark.integration


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_tenant_commands_change_audit_and_list(
    sessions: Any, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDMAN_DATABASE_URL", database_url)
    name, job = f"team-{secrets.token_hex(3)}", f"cli-{secrets.token_hex(3)}"
    code, out = _cli("tenant", "create", name, "--max-live", "5")
    assert code == 0, out
    assert json.loads(out)["max_live"] == 5 and json.loads(out)["creates_per_minute"] is None
    code, out = _cli("tenant", "set", name, "--creates-per-minute", "60", "--max-live", "none")
    assert code == 0, out
    assert (json.loads(out)["max_live"], json.loads(out)["creates_per_minute"]) == (None, 60)
    code, out = _cli("job", "create", job, "--tenant", name)
    assert code == 0 and json.loads(out.splitlines()[-1])["tenant"] == name, out

    for bad in (("--max-live", "-1"), ("--max-live", "lots"), ()):
        code, out = _cli("tenant", "set", name, *bad)
        assert code != 0, (bad, out)
    assert _cli("tenant", "set", "nobody-here", "--max-live", "1")[0] != 0
    assert _cli("tenant", "create", name)[0] != 0  # exists
    assert _cli("job", "create", job, "--tenant", "nobody-here")[0] != 0

    code, out = _cli("tenant", "ls", "--json")
    assert code == 0, out
    (mine,) = [t for t in map(json.loads, out.splitlines()) if t["name"] == name]
    assert (mine["max_live"], mine["creates_per_minute"], mine["jobs"]) == (None, 60, [job])
    code, out = _cli("tenant", "ls")
    assert code == 0 and any(line.split()[:2] == [name, "0/-"] for line in out.splitlines()), out

    # fair-share weights: the tenant's and the job's, validated and audited
    code, out = _cli("tenant", "set", name, "--weight", "3")
    assert code == 0 and json.loads(out)["weight"] == 3.0, out
    code, out = _cli("job", "create", job, "--weight", "2.5")
    assert code == 0 and json.loads(out.splitlines()[-1])["weight"] == 2.5, out
    for bad in (("tenant", "set", name, "--weight", "0"), ("job", "create", job, "--weight", "-1")):
        assert _cli(*bad)[0] != 0, bad
    assert weight_changes(sessions, name, job) == [
        ("tenant-set", 1.0, 3.0),
        ("job-weight", 1.0, 2.5),
    ]

    code, out = _cli("job", "create", job, "--tenant", "none")
    assert code == 0, out
    with sessions() as session:
        assert session.get(Job, job).tenant is None
        audited = [
            (e.action, e.actor, e.job)
            for e in session.scalars(
                select(Event)
                .where(Event.kind == "admin", Event.action.like("%tenant%"))
                .where((Event.detail["tenant"].as_string() == name) | (Event.job == job))
                .order_by(Event.id)
            )
        ]
    who = f"cli:{getpass.getuser()}"
    assert audited == [
        ("tenant-create", who, None),
        ("tenant-set", who, None),
        ("job-tenant", who, job),
        ("tenant-set", who, None),  # the weight
        ("job-tenant", who, job),
    ]
