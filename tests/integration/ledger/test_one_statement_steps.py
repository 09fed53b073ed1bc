"""The acquire path's one-statement ledger steps write what the ORM steps write.

``store.insert_intent``, ``begin_create`` and ``mark_ready`` replaced ORM objects on the
hot path (broker CPU per create, docs/performance.md). Each is checked here against the
ORM step it stands for, on the real PostgreSQL: the same columns, the same events, and
no write at all when the row is not in the state the step expects (the caller's general
path then decides). The pool's ping of idle connections is checked against a backend
PostgreSQL really terminated.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

import pytest
from sqlalchemy import select, text

from broker.ledger import db, store
from broker.ledger.models import Event, Sandbox
from broker.ledger.states import State
from broker.wire.request import AcquireRequest

pytestmark = pytest.mark.integration

# Columns that differ between two intents by construction (identity and clock).
PER_ROW = {"id", "nonce", "pod_name", "request_id", "requested_at", "token_hash"}


def _spec(job: str) -> AcquireRequest:
    return AcquireRequest.new(image="img:v1", job=job, cpu="100m", memory="64Mi", owner="t")


def _where() -> dict[str, Any]:
    return {"installation": "inst-steps", "namespace": "ns", "token_hash": "sha256:x"}


@pytest.fixture
def job(sessions: Any) -> str:
    name = f"steps-{secrets.token_hex(3)}"
    with sessions.begin() as session:
        store.ensure_job(session, name, lease_s=60.0)
    return name


def _row(sessions: Any, sandbox_id: str) -> dict[str, Any]:
    with sessions() as session:
        row = session.get(Sandbox, sandbox_id)
        assert row is not None
        return {c.key: getattr(row, c.key) for c in Sandbox.__table__.columns}


def _events(sessions: Any, sandbox_id: str) -> list[tuple[Any, ...]]:
    with sessions() as session:
        rows = session.execute(
            select(
                Event.kind,
                Event.action,
                Event.from_state,
                Event.to_state,
                Event.outcome,
                Event.actor,
                Event.detail,
                Event.job,
                Event.pod_name,
                Event.nonce,
            )
            .where(Event.sandbox_id == sandbox_id)
            .order_by(Event.kind, Event.action)
        ).all()
    return [tuple(r) for r in rows]


def test_the_one_statement_intent_writes_the_orm_intent(sessions: Any, job: str) -> None:
    spec = _spec(job)
    twin = dataclasses.replace(spec, request_id=f"{spec.request_id}-twin")
    with sessions.begin() as session:
        orm_id = store.new_intent(session, spec, actor="steps", **_where()).id
    with sessions.begin() as session:
        core_id = store.insert_intent(session, twin, actor="steps", **_where())
    orm, core = _row(sessions, orm_id), _row(sessions, core_id)
    assert {k: v for k, v in core.items() if k not in PER_ROW} == {
        k: v for k, v in orm.items() if k not in PER_ROW
    }
    assert core["pod_name"] == store.pod_name_for(core_id) and core["state"] == State.REQUESTED
    strip = [e[:6] + e[7:8] for e in _events(sessions, core_id)]
    assert strip == [e[:6] + e[7:8] for e in _events(sessions, orm_id)]
    (event,) = _events(sessions, core_id)
    assert event[8:] == (core["pod_name"], core["nonce"])
    assert event[6]["request_id"] == core["request_id"]


def test_create_and_ready_steps_move_the_row_and_write_their_events(
    sessions: Any, job: str
) -> None:
    with sessions.begin() as session:
        sandbox_id = store.insert_intent(session, _spec(job), actor="steps", **_where())
    first = store.begin_create(sessions, sandbox_id, actor="steps")
    assert first is not None and first.prev_state == "requested"
    again = store.begin_create(sessions, sandbox_id, actor="steps")  # a retried create
    assert again is not None and again.prev_state == "creating"
    row = _row(sessions, sandbox_id)
    assert row["state"] == State.CREATING and row["create_attempts"] == 2
    observed = {
        "pod_ip": "10.0.0.9",
        "node_name": "node-1",
        "address": "10.0.0.9:8080",
        "create_to_ready_s": 0.25,
        "image_pull_s": None,
        "start_s": None,
        "image_pulled": None,
        "readiness_simulated": True,
    }
    audit = {"action": "ready", "outcome": "observed", "api_s": 0.125}
    lease = store.mark_ready(
        sessions, sandbox_id, actor="steps", lease_s=60.0, observed=observed, audit=audit
    )
    assert lease is not None and lease.address == "10.0.0.9:8080"
    row = _row(sessions, sandbox_id)
    assert row["state"] == State.READY and row["readiness_simulated"] is True
    assert row["acquired_at"] == row["ready_at"]
    assert (row["lease_expires_at"] - row["ready_at"]).total_seconds() == pytest.approx(60.0)
    assert row["acquire_latency_s"] == pytest.approx(
        (row["ready_at"] - row["enqueued_at"]).total_seconds()
    )
    steps = [(e[0], e[1], e[2], e[3], e[6]) for e in _events(sessions, sandbox_id)]
    assert steps == [
        ("api", "ready", None, None, {"api_s": 0.125}),
        ("transition", "creating", "requested", "creating", {}),
        ("transition", "intent", None, "requested", steps[2][4]),
        ("transition", "ready", "creating", "ready", {}),
    ]
    # Ready is not a state these steps start from: nothing is written, None is returned.
    assert store.begin_create(sessions, sandbox_id, actor="steps") is None
    assert (
        store.mark_ready(
            sessions, sandbox_id, actor="steps", lease_s=60.0, observed=observed, audit=audit
        )
        is None
    )
    assert len(_events(sessions, sandbox_id)) == 4
    assert _row(sessions, sandbox_id)["create_attempts"] == 2


def test_a_released_row_is_not_marked_ready(sessions: Any, job: str) -> None:
    with sessions.begin() as session:
        sandbox_id = store.insert_intent(session, _spec(job), actor="steps", **_where())
    assert store.begin_create(sessions, sandbox_id, actor="steps") is not None
    with sessions.begin() as session:
        row = store.lock_row(session, sandbox_id)
        assert row is not None
        store.transition(session, row, State.RELEASING, actor="steps")
    observed = dict.fromkeys(
        ("pod_ip", "node_name", "address", "create_to_ready_s", "image_pull_s", "start_s")
    )
    observed.update(image_pulled=None, readiness_simulated=False)
    audit = {"action": "ready", "outcome": "observed"}
    assert (
        store.mark_ready(
            sessions, sandbox_id, actor="steps", lease_s=60.0, observed=observed, audit=audit
        )
        is None
    )
    assert _row(sessions, sandbox_id)["state"] == State.RELEASING
    assert not [e for e in _events(sessions, sandbox_id) if e[0] == "api"]


def test_a_pooled_connection_killed_while_idle_is_replaced(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db, "PING_AFTER_IDLE_S", 0.0)  # every checkout counts as idle
    engine = db.make_engine(database_url, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar()
        other = db.make_engine(database_url, pool_size=1, max_overflow=0)
        try:
            with other.connect() as admin:
                admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
                admin.commit()
        finally:
            other.dispose()
        with engine.connect() as conn:  # pinged, found dead, replaced: no error
            assert conn.execute(text("SELECT pg_backend_pid()")).scalar() != pid
    finally:
        engine.dispose()


def test_the_one_statement_intent_is_also_the_idempotency_read(sessions: Any, job: str) -> None:
    spec = _spec(job)
    first = store.insert_intent_once(sessions, spec, actor="steps", **_where())
    assert first is not None
    # A redelivery with a fresh id and nonce converges on the first row, writing nothing.
    again = store.insert_intent_once(
        sessions, spec, actor="steps", **_where(), sandbox_id="f" * 32, nonce="f" * 32
    )
    assert again is not None and (again.id, again.nonce) == (first.id, first.nonce)
    with sessions() as session:
        rows = session.scalars(select(Sandbox.id).where(Sandbox.request_id == spec.request_id))
        assert list(rows) == [first.id]
    assert [e[1] for e in _events(sessions, first.id)] == ["intent"]
    assert _events(sessions, "f" * 32) == []
