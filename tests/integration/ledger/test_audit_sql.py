"""The auditors' SQL surface (docs/audit-sql.md), read AS ``sandman_auditor`` on real
PostgreSQL: the documented queries, run as the page prints them, answer for a ledger
written by a real acquire and release (Celery worker, local sandbox) and by real GC
passes; the role is refused every table and every write; ``gc_passes`` is append-only.
"""

from __future__ import annotations

import datetime as dt
import re
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg.rows import dict_row

from broker.acquire import quotas
from broker.acquire.root import WORKER, Root
from broker.backends.base import PodSpec
from broker.cli.main import main
from broker.client.sync import SandboxClient
from broker.ledger import store
from broker.ledger.auditor import AUDITOR_ROLE, auditor_url, libpq_url
from broker.ledger.models import Sandbox
from broker.ledger.states import State
from broker.settings import Settings
from tests.support.images import TASK_IMAGE
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[3] / "docs" / "audit-sql.md"
TRAINER = "audit-sql-trainer"


def documented(name: str) -> str:
    """The page's query ``name``, its psql variables (``:'x'``) as psycopg parameters."""
    blocks = re.findall(r"```sql\n(.*?)```", DOC.read_text(), flags=re.S)
    (query,) = [b for b in blocks if b.startswith(f"-- query: {name}\n")]
    return re.sub(r":'(\w+)'", r"%(\1)s", query)


def run(conn: psycopg.Connection[dict[str, Any]], name: str, **params: Any) -> list[dict[str, Any]]:
    return conn.execute(documented(name), params).fetchall()  # type: ignore[arg-type]


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["db", "auditor", *args])
    return result.exit_code, result.output


class Auditor:
    """The auditor's login as the module set it: its password, and a connection with it."""

    def __init__(self, database_url: str, pw_file: Path) -> None:
        self.url, self.pw_file = auditor_url(database_url), pw_file
        self.password = pw_file.read_text().strip()

    def __call__(self) -> psycopg.Connection[dict[str, Any]]:
        return psycopg.connect(self.url, password=self.password, row_factory=dict_row)

    def login_on(self) -> None:
        code, out = _cli("--password-file", str(self.pw_file))
        assert code == 0 and "login on" in out and self.url in out, out


@pytest.fixture(scope="module")
def auditor(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Auditor]:
    """Login on through ``sandman db auditor --password-file``; off again at the end."""
    pw_file = tmp_path_factory.mktemp("auditor") / "pw"
    pw_file.write_text(secrets.token_urlsafe(24) + "\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SANDMAN_DATABASE_URL", database_url)
        login = Auditor(database_url, pw_file)
        login.login_on()
        yield login
        code, out = _cli("--nologin")
        assert code == 0, out


@pytest.fixture(scope="module")
def gc_root(stack: Settings) -> Iterator[Root]:
    """GC passes over the stack's installation, run from here: nothing else runs one."""
    root = Root(stack, WORKER, actor="audit-gc")
    yield root
    root.dispose()


def _db_now(database_url: str) -> dt.datetime:
    with psycopg.connect(libpq_url(database_url)) as conn:
        row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def test_owner_history_and_pod_hours_of_a_real_acquire_and_release(
    stack: Settings, sessions: Any, database_url: str, auditor: Auditor
) -> None:
    job, tenant = f"audit-{secrets.token_hex(3)}", f"team-{secrets.token_hex(3)}"
    with sessions.begin() as session:
        store.ensure_job(session, job)
    quotas.create(sessions, tenant, {"max_live": 5}, actor="admin:audit")
    quotas.assign_job(sessions, job, tenant, actor="admin:audit")
    before = _db_now(database_url)
    client = SandboxClient(stack.redis_url, owner=TRAINER)
    try:
        with client.acquire(
            image=TASK_IMAGE, cpu="250m", memory="256Mi", job=job, timeout=60
        ) as sb:
            pod, sandbox_id = sb.lease.pod_name, sb.lease.sandbox_id
            during = _db_now(database_url)
            assert sb.exec("echo hi").stdout == "hi\n"
    finally:
        client.close()

    def deleted() -> Sandbox | None:
        with sessions() as session:
            row = session.get(Sandbox, sandbox_id)
            return row if row is not None and row.state == State.DELETED else None

    row = wait_until(deleted, timeout=60, interval=0.1, what=f"{pod} deleted")
    after = _db_now(database_url)
    assert row.creating_at is not None and row.deleted_at is not None

    with auditor() as conn:
        (owned,) = run(conn, "owner-at", pod_name=pod, at=during)
        assert (owned["sandbox_id"], owned["job"], owned["trainer"]) == (sandbox_id, job, TRAINER)
        assert owned["tenant"] == tenant
        assert owned["owned_from"] == row.requested_at and owned["owned_until"] == row.deleted_at
        assert owned["created_by"] == "worker" and owned["deleted_by"] == "worker"
        assert run(conn, "owner-at", pod_name=pod, at=before) == []
        assert run(conn, "owner-at", pod_name=pod, at=after) == []

        history = run(conn, "history", pod_name=pod)
        assert [h["to_state"] for h in history] == [
            "requested",
            "creating",
            "ready",
            "releasing",
            "deleted",
        ]
        assert [h["left_at"] for h in history[:-1]] == [h["entered_at"] for h in history[1:]]
        assert history[-1]["left_at"] is None

        expected = (row.deleted_at - row.creating_at).total_seconds() / 3600
        (used,) = [r for r in run(conn, "pod-hours") if r["job"] == job]
        assert used["pods"] == 1 and float(used["pod_hours"]) == pytest.approx(expected)
        assert float(used["cpu_core_hours"]) == pytest.approx(expected * 0.25)
        (billed,) = [r for r in run(conn, "pod-hours-by-tenant") if r["tenant"] == tenant]
        assert (billed["jobs"], billed["pods"]) == (1, 1)
        assert float(billed["pod_hours"]) == pytest.approx(expected)
        changes = run(conn, "quota-changes", tenant=tenant, job=job)
        assert [(c["action"], c["actor"], c["job"]) for c in changes] == [
            ("tenant-create", "admin:audit", None),
            ("job-tenant", "admin:audit", job),
        ]
        assert changes[0]["after"] == {
            "max_live": 5,
            "creates_per_minute": None,
            "snapshot_bytes": None,
        }
        # a window holding only the second half of the pod's life counts only that half
        middle = row.creating_at + (row.deleted_at - row.creating_at) / 2
        (half,) = [
            r
            for r in run(conn, "pod-hours-window", **{"from": middle, "to": after})
            if r["job"] == job
        ]
        assert float(half["pod_hours"]) == pytest.approx(
            (row.deleted_at - middle).total_seconds() / 3600
        )
        later = run(conn, "pod-hours-window", **{"from": after, "to": after})
        assert [r for r in later if r["job"] == job] == []


def test_an_unowned_pod_is_bounded_by_the_gc_passes_that_wrote_their_rows(
    stack: Settings, gc_root: Root, auditor: Auditor
) -> None:
    first = gc_root.gc.run_and_publish(actor=gc_root.actor, by="test").report
    assert first.unowned_pods == [] and not first.skipped_locked
    backend = gc_root.need_backend()
    nonce = secrets.token_hex(16)
    pod = f"sm-planted-{nonce[:8]}"
    backend.create(
        PodSpec(
            name=pod,
            namespace=stack.namespace,
            installation=stack.installation_id,
            job="audit-planted",
            sandbox_id=uuid.uuid4().hex,
            nonce=nonce,
            role="rollout",
            image=TASK_IMAGE,
            cpu_m=100,
            memory_b=64 << 20,
            token=secrets.token_hex(8),
        )
    )
    try:
        seen = gc_root.gc.run_and_publish(actor=gc_root.actor, by="test").report
        assert seen.unowned_pods == [pod]
    finally:
        backend.delete(stack.namespace, pod, nonce)
    gone = gc_root.gc.run_and_publish(actor=gc_root.actor, by="test").report
    assert gone.unowned_pods == []

    with auditor() as conn:
        passes = [
            p
            for p in run(conn, "gc-passes")
            if (p["installation"], p["actor"]) == (stack.installation_id, gc_root.actor)
        ]
        assert len(passes) == 3, passes
        last, middle, earliest = passes  # newest first
        assert [p["unowned_pods"] for p in passes] == [0, 1, 0]
        assert [p["clean"] for p in passes] == [True, False, True]
        assert middle["pods_ours"] == 1 and middle["live_rows"] == 0
        assert middle["observed_minus_ledger"] == 1
        assert not any(p["dry_run"] for p in passes)

        (unowned,) = [u for u in run(conn, "unowned") if u["pod_name"] == pod]
        assert unowned["kind"] == "unowned_pod" and unowned["job"] == "audit-planted"
        assert unowned["unowned_from_earliest"] == earliest["started_at"]
        assert middle["started_at"] <= unowned["unowned_from_latest"] <= middle["finished_at"]
        assert last["started_at"] <= unowned["unowned_until"] <= last["finished_at"]
        assert unowned["max_duration"] == unowned["unowned_until"] - earliest["started_at"]
        assert unowned["min_duration"] == (
            unowned["unowned_until"] - unowned["unowned_from_latest"]
        )
        assert [o for o in run(conn, "open-leaks") if o["pod_name"] == pod] == []


def test_gc_passes_refuse_update_delete_and_truncate_even_for_their_owner(
    gc_root: Root, database_url: str
) -> None:
    gc_root.gc.run(actor="audit-dry-run", dry_run=True)  # not one of the other test's passes
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT id, dry_run FROM gc_passes WHERE installation = %s AND actor = %s"
            " ORDER BY id DESC LIMIT 1",
            (gc_root.settings.installation_id, "audit-dry-run"),
        ).fetchone()
        assert row is not None and row[1] is True  # the dry run wrote its row
        for statement in (
            "UPDATE gc_passes SET errors = errors + 1 WHERE id = %s",
            "DELETE FROM gc_passes WHERE id = %s",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
                conn.execute(statement, (row[0],))
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
            conn.execute("TRUNCATE gc_passes")
        assert conn.execute(
            "SELECT count(*) FROM gc_passes WHERE id = %s", (row[0],)
        ).fetchone() == (1,)


def test_the_auditor_reads_views_only_and_writes_nothing(
    database_url: str, auditor: Auditor
) -> None:
    with psycopg.connect(libpq_url(database_url)) as owner:
        tables = [
            r[0]
            for r in owner.execute(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = 'public' AND table_type = 'BASE TABLE' ORDER BY 1"
            )
        ]
    assert {"sandboxes", "events", "leaks", "jobs", "gc_passes", "alembic_version"} <= set(tables)
    with auditor() as conn:
        conn.autocommit = True
        for table in tables:  # sandboxes holds the token hashes; no table is readable
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(f'SELECT 1 FROM public."{table}" LIMIT 1')
        columns = {
            r["column_name"]
            for r in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = 'audit'"
            )
        }
        assert {"nonce", "pod_name", "job", "created_by", "deleted_by"} <= columns
        assert not columns & {"token_hash", "request_id", "detail", "address", "last_error"}
        # sessions are read-only by default (even a session's own temporary table is
        # refused), and without that the missing privileges still refuse every write
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("CREATE TEMPORARY TABLE scratch (x int)")
        conn.execute("SET default_transaction_read_only = off")
        for statement in (
            "UPDATE audit.leaks SET resolution = 'x'",
            "DELETE FROM audit.gc_passes",
            "INSERT INTO audit.events (kind, action, actor) VALUES ('x', 'x', 'x')",
            "CREATE TABLE public.auditor_was_here (x int)",
            "CREATE VIEW audit.auditor_was_here AS SELECT 1",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)


def test_login_off_refuses_the_auditor_and_bad_password_files_are_refused(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, auditor: Auditor
) -> None:
    monkeypatch.setenv("SANDMAN_DATABASE_URL", database_url)
    for content in ("", "\n", "two\nlines\n"):
        (tmp_path / "pw").write_text(content)
        code, out = _cli("--password-file", str(tmp_path / "pw"))
        assert code != 0 and "--password-file" in out, out
    code, out = _cli()
    assert code != 0 and "exactly one" in out, out
    with auditor() as conn:  # the refusals above changed nothing
        assert conn.execute("SELECT current_user AS me").fetchone() == {"me": AUDITOR_ROLE}
    password = secrets.token_urlsafe(16)
    (tmp_path / "pw").write_text(password)
    try:
        assert _cli("--nologin")[0] == 0
        with pytest.raises(psycopg.OperationalError, match="sandman_auditor"):
            psycopg.connect(auditor_url(database_url), password=password)
        assert _cli("--password-file", str(tmp_path / "pw"))[0] == 0  # no line end: fine
        with psycopg.connect(auditor_url(database_url), password=password) as conn:
            assert conn.execute("SELECT count(*) FROM audit.sandboxes").fetchone() is not None
    finally:
        auditor.login_on()  # as the module set it, whatever happened here
