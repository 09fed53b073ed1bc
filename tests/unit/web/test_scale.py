"""The sandboxes list stays fast at 20,000 rows: index scans, bounded pages, capped counts."""

from __future__ import annotations

import json
import time

import pytest
from sqlalchemy import delete, text
from sqlalchemy.dialects import postgresql

from broker.ledger import store
from broker.ledger.models import Event, Sandbox
from web import listing

pytestmark = pytest.mark.unit
ROWS = 20_000
JOB = "scale-20k"


@pytest.fixture(scope="module")
def seeded(db_engine):
    from broker.ledger.db import make_session_factory

    sessions = make_session_factory(db_engine)
    with sessions.begin() as s:
        store.ensure_job(s, JOB)
        s.execute(
            text(
                "INSERT INTO sandboxes (id, job, installation, nonce, pod_name, namespace,"
                " backend, image, cpu_m, memory_b, role, state, reuse_count, create_attempts,"
                " delete_attempts, requested_at, egress_denied, readiness_simulated,"
                " create_to_ready_s)"
                " SELECT md5('s' || i), :job, 'scale', md5('n' || i), 'sm-' || md5('s' || i),"
                " 'ns', 'fake', 'img', 100, 1024, 'rollout',"
                " (ARRAY['ready','deleted','deleted','deleted','failed'])[1 + i % 5],"
                " 0, 1, 0, now() - make_interval(secs => i), false, false, 1.0 + (i % 30)"
                " FROM generate_series(1, :n) AS i"
            ),
            {"job": JOB, "n": ROWS},
        )
    with db_engine.connect() as conn:
        conn.execute(text("ANALYZE sandboxes"))
        conn.commit()
    yield sessions
    with sessions.begin() as s:
        s.execute(delete(Event).where(Event.job == JOB))
        s.execute(delete(Sandbox).where(Sandbox.job == JOB))


def plan(session, query: listing.ListQuery) -> dict:
    stmt, _ = listing.statement(query)
    compiled = stmt.compile(dialect=postgresql.dialect())
    conn = session.connection()
    raw = conn.exec_driver_sql("EXPLAIN (FORMAT JSON) " + str(compiled), compiled.params)
    value = raw.scalar()
    return (json.loads(value) if isinstance(value, str) else value)[0]["Plan"]


def nodes(node: dict):
    yield node
    for child in node.get("Plans", []):
        yield from nodes(child)


def scans_of_sandboxes(node: dict) -> list[str]:
    return [n["Node Type"] for n in nodes(node) if n.get("Relation Name") == "sandboxes"]


def timed(session, query):
    started = time.perf_counter()
    page = listing.fetch(session, query)
    return page, time.perf_counter() - started


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"job": JOB},
        {"state": "ready"},
        {"sort": "pod_name", "order": "asc"},
        {"sort": "id"},
    ],
)
def test_list_query_uses_an_index(seeded, args):
    # Speed itself is a benchmark's job (machines here are noisy); what a test can pin down
    # is that the planner never scans the 20,000-row table sequentially.
    query = listing.ListQuery.from_args(args)
    with seeded() as session:
        scans = scans_of_sandboxes(plan(session, query))
        assert scans and all("Index" in kind or "Bitmap" in kind for kind in scans), scans
        page, _ = timed(session, query)
    assert len(page.rows) == listing.DEFAULT_LIMIT


def test_deep_pages_use_the_index_like_the_first(seeded):
    query = listing.ListQuery.from_args({"job": JOB, "limit": "200"})
    seen: set[str] = set()
    with seeded() as session:
        page, _ = timed(session, query)
        for _ in range(60):  # walk to row ~12,000 by keyset cursor
            query.cursor = page.next_cursor or ""
            page, _ = timed(session, query)
            ids = {row.id for row in page.rows}
            assert not ids & seen  # keyset pages never repeat a row
            seen |= ids
        scans = scans_of_sandboxes(plan(session, query))
    assert len(seen) == 60 * 200
    assert page.total == listing.COUNT_CAP and page.total_capped
    assert all("Index" in kind or "Bitmap" in kind for kind in scans), scans


def test_the_page_itself_renders_at_scale(seeded, admin):
    page = admin.get(f"/sandboxes?job={JOB}&sort=requested_at&order=desc")
    assert page.status_code == 200 and "10,000+" in page.get_data(as_text=True)
