"""``sandman trace export`` builds the replay trace from real ledger rows (PostgreSQL)."""

from __future__ import annotations

import datetime as dt
import json
import secrets

import pytest
from click.testing import CliRunner

from broker.ledger import store
from broker.ledger.states import Role
from broker.replay import Policy, read_trace, simulate
from broker.replay.trace import export_ledger
from broker.wire.request import AcquireRequest

pytestmark = pytest.mark.integration

T0 = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


def _row(session, job, image, *, enq, acq, rel, role=Role.ROLLOUT, warm=False):  # type: ignore[no-untyped-def]
    spec = AcquireRequest(
        job=job,
        image=image,
        cpu_m=100,
        memory_b=64 << 20,
        role=role,
        request_id=f"r-{secrets.token_hex(6)}",
        pool_key="pk" if warm else None,
    )
    row = store.new_intent(session, spec, installation="test-replay", namespace="ns")
    row.requested_at = T0 + dt.timedelta(seconds=enq - (30 if warm else 0))
    row.enqueued_at = T0 + dt.timedelta(seconds=enq) if enq is not None else None
    row.acquired_at = T0 + dt.timedelta(seconds=acq) if acq is not None else None
    row.releasing_at = T0 + dt.timedelta(seconds=rel) if rel is not None else None
    return row


def test_export_builds_the_trace_from_ledger_rows(sessions, database_url, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    job = f"replay-{secrets.token_hex(3)}"
    with sessions.begin() as session:
        store.ensure_job(session, job)
        _row(session, job, "img-a", enq=0, acq=4, rel=14)  # on demand: 4 s wait, held 10 s
        _row(session, job, "img-a", enq=5, acq=5.1, rel=8.1, warm=True)  # warm hit
        _row(session, job, "img-b", enq=9, acq=12, rel=None, role=Role.GRADING)  # still held
        _row(session, job, "img-b", enq=20, acq=None, rel=None)  # never handed out: skipped

    with sessions() as session:
        events = export_ledger(session, job=job)
    assert [(e.image, e.role) for e in events] == [
        ("img-a", "rollout"),
        ("img-a", "rollout"),
        ("img-b", "grading"),
    ]
    assert events[0].time == pytest.approx(T0.timestamp())
    assert [round(e.time - events[0].time, 3) for e in events] == [0.0, 5.0, 9.0]
    assert events[0].duration == pytest.approx(10.0)
    assert events[1].duration == pytest.approx(3.0)
    assert events[2].duration > 0  # open lease: held until now

    from broker.cli.main import main

    monkeypatch.setenv("SANDMAN_DATABASE_URL", database_url)
    result = CliRunner().invoke(main, ["trace", "export", "--job", job])
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in result.stdout.splitlines() if x.startswith("{")]
    assert [x["time"] for x in lines] == pytest.approx([0.0, 5.0, 9.0])
    assert set(lines[0]) == {"time", "job", "image", "role", "duration"}

    # The exported trace replays: one warm pod of img-a serves the second request.
    trace = read_trace([json.dumps(x) for x in lines])  # type: ignore[arg-type]
    result_sim = simulate(trace, Policy(warm={"img-a": 1}, create_s=3.0, idle_timeout_s=1e9))
    assert (result_sim.hits, result_sim.misses) == (2, 1)
