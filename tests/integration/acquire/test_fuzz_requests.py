"""Malformed task specs and acquire requests: a clear typed error, and nothing left behind.

Two doors: the trainer's client (validates before anything is enqueued) and the worker's
``Broker.acquire_and_deliver`` (a message written straight to Redis by anyone). For each bad
request: the error is an ``InvalidRequest`` (or ``UnknownJob``), the mailbox answer carries
its type, and no ledger row, no event, no pod and no queue entry was created.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from broker.acquire.service import Broker
from broker.backends.local import LocalBackend
from broker.client.sync import SandboxClient
from broker.errors import InvalidRequest, UnknownJob
from broker.ledger import store
from broker.ledger.models import Event, Sandbox
from broker.settings import Settings
from broker.wire import mailbox
from broker.wire.request import AcquireRequest
from tests.support.images import TASK_IMAGE

pytestmark = pytest.mark.integration
QUEUES = ("acquire", "release", "pool")


@pytest.fixture(scope="module")
def env(database_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory):
    from broker.ledger.db import make_engine, make_session_factory

    url = redis_url.rsplit("/", 1)[0] + "/13"
    r = redis.Redis.from_url(url)
    r.flushdb()
    settings = Settings(
        state_dir=tmp_path_factory.mktemp("fuzz-acquire"),
        database_url=database_url,
        redis_url=url,
        secret_key=secrets.token_hex(16),
        installation_id=f"fuzz-{secrets.token_hex(3)}",
    )
    engine = make_engine(database_url, pool_size=2)
    sessions = make_session_factory(engine)
    with sessions.begin() as s:
        store.ensure_job(s, "fuzz-ok")
    backend = LocalBackend(settings)
    svc = Broker(settings, sessions, backend, r, enqueue=lambda *a: None, actor="fuzz")
    client = SandboxClient(url, owner="fuzz")
    yield settings, sessions, svc, r, client, backend
    client.close()
    engine.dispose()


def _snapshot(env: Any) -> tuple[int, int, int, tuple[int, ...], int]:
    settings, sessions, _svc, r, _client, backend = env
    with sessions() as s:
        rows = int(s.scalar(select(func.count()).select_from(Sandbox)) or 0)
        events = int(s.scalar(select(func.count()).select_from(Event)) or 0)
    pods = len(backend.list_installation(settings.namespace, settings.installation_id))
    queues = tuple(int(r.llen(q)) for q in QUEUES)
    return rows, events, pods, queues, len(list(Path(settings.state_dir).rglob("*.json")))


def _request(**over: Any) -> dict[str, Any]:
    """A valid message with ``over`` applied (``...`` removes a field); no times yet."""
    base = {
        "request_id": f"r-{uuid.uuid4().hex}",
        "job": "fuzz-ok",
        "image": TASK_IMAGE,
        "cpu_m": 200,
        "memory_b": 128 << 20,
    }
    base.update(over)
    return {k: v for k, v in base.items() if v is not ...}


BAD_CLIENT_ARGS = [
    {"image": ""},
    {"image": "UPPER/Case:1"},
    {"image": "a" * 600},
    {"image": "python:3.12; rm -rf /"},
    {"image": "python:3.12\n"},
    {"image": "../../etc/passwd"},
    {"cpu": "-1"},
    {"cpu": 0},
    {"cpu": "1e9"},
    {"cpu": "lots"},
    {"cpu": True},
    {"memory": "1Ti" * 3},
    {"memory": "0"},
    {"memory": 10**30},
    {"memory": "-5Gi"},
    {"memory": "NaN"},
    {"job": ""},
    {"timeout": 0},
    {"timeout": -1},
    {"timeout": 10**9},
    {"role": "root"},
    {"cpu": float("nan")},
    {"cpu": float("inf")},
    {"timeout": "5"},
    {"timeout": None},
    {"image_digest": 1},
    {"base_commit": 1},
    {"base_commit": "c" * 65},
    {"env": "abc"},
    {"env": {"SANDMAN_EXECD_TOKEN": "x"}},
    {"env": {"LD_PRELOAD": "/tmp/x.so"}},
    {"workdir": "/repo\x00"},
]


@pytest.mark.parametrize("bad", BAD_CLIENT_ARGS, ids=lambda d: repr(d)[:40])
def test_client_refuses_before_enqueueing(env, bad):
    client = env[4]
    before = _snapshot(env)
    args: dict[str, Any] = {
        "image": TASK_IMAGE,
        "job": "fuzz-ok",
        "cpu": "200m",
        "memory": "128Mi",
        "timeout": 5,
    }
    args.update(bad)
    with pytest.raises(InvalidRequest):
        client.open(**args)
    assert _snapshot(env) == before


BAD_MESSAGES = [
    _request(job="no-such-job"),
    _request(job=""),
    _request(job=None),
    _request(job=...),
    _request(image=...),
    _request(image=""),
    _request(image="Bad Image"),
    _request(image="x" * 5000),
    _request(cpu_m=-5),
    _request(cpu_m=10**12),
    _request(cpu_m="lots"),
    _request(memory_b=0),
    _request(memory_b=10**20),
    _request(memory_b=[1]),
    _request(role="admin"),
    _request(enqueued_at="yesterday"),
    _request(workdir="relative/dir"),
    _request(env={"A": 1}),
    _request(env="A=1"),
    _request(request_id=...),
    _request(request_id="r-1\n"),
    _request(image="python:3.12\n"),
    _request(image_digest="sha256:" + "a" * 64 + "\n"),
    _request(workdir="/repo\x00"),
    _request(base_commit="c" * 65),
    _request(owner="o" * 129),
    _request(env={"SANDMAN_EXECD_TOKEN": "chosen-by-the-caller"}),
    _request(env={"LD_PRELOAD": "/tmp/x.so"}),
    _request(env={"PYTHONPATH": "/tmp"}),
    _request(env={f"V{i}": "x" for i in range(500)}),
    _request(deadline=float("nan")),
]


@pytest.mark.parametrize("message", BAD_MESSAGES, ids=lambda m: json.dumps(m)[80:140])
def test_worker_answers_typed_error_and_leaves_nothing(env, message):
    _settings, _sessions, svc, r, _client, _backend = env
    now = time.time()
    message = {"enqueued_at": now, "deadline": now + 30, **message}  # fresh, unless overridden
    before = _snapshot(env)
    rid = str(message.get("request_id", "missing"))
    out = svc.acquire_and_deliver(message) if "request_id" in message else None
    if out is None:
        with pytest.raises(InvalidRequest):  # no mailbox to answer: the parser is the door
            AcquireRequest.parse(message)
    else:
        got = r.blpop([mailbox.result_key(rid)], timeout=5)
        assert got is not None, "no answer in the trainer's mailbox"
        payload = mailbox.parse(got[1])
        assert "lease" not in payload, payload
        assert payload["error"]["type"] in ("InvalidRequest", "UnknownJob"), payload
        if message.get("job") == "no-such-job":
            assert payload["error"]["type"] == UnknownJob.__name__
    assert _snapshot(env) == before


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    fields=st.dictionaries(
        st.sampled_from(
            ["job", "image", "cpu_m", "memory_b", "role", "workdir", "env", "image_digest"]
        ),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(),
            st.floats(allow_nan=True),
            st.text(max_size=40),
            st.lists(st.integers(), max_size=3),
            st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
        ),
        min_size=1,
    )
)
def test_fuzzed_messages_never_create_anything_for_an_invalid_request(env, fields):
    """Whatever the worker receives: a lease for a valid request or a SandmanError; an
    invalid one leaves no row, event, pod or queue entry behind."""
    _settings, _sessions, svc, r, _client, _backend = env
    now = time.time()
    message = {
        "enqueued_at": now,
        "deadline": now + 30,
        **_request(**{"job": "no-such-job-" + uuid.uuid4().hex[:6], **fields}),
    }
    if fields.get("job") == "fuzz-ok":
        return  # a valid job would really create a sandbox: covered elsewhere
    before = _snapshot(env)
    svc.acquire_and_deliver(message)
    got = r.blpop([mailbox.result_key(message["request_id"])], timeout=5)
    assert got is not None
    payload = mailbox.parse(got[1])
    assert "error" in payload and payload["error"]["type"] in ("InvalidRequest", "UnknownJob")
    assert _snapshot(env) == before


def test_an_overlong_base_commit_is_refused_without_leaking_sql_or_secrets(env):
    """A 65-character base_commit for a real job used to reach the INSERT, fail on the
    64-character column, and answer the trainer with the statement, its parameters and the
    new sandbox's nonce. Now the constructor refuses it before any row or lock exists."""
    _settings, _sessions, svc, r, _client, _backend = env
    now = time.time()
    message = {"enqueued_at": now, "deadline": now + 30, **_request(base_commit="c" * 65)}
    before = _snapshot(env)
    svc.acquire_and_deliver(message)
    got = r.blpop([mailbox.result_key(message["request_id"])], timeout=5)
    assert got is not None, "no answer in the trainer's mailbox"
    raw = got[1].decode() if isinstance(got[1], bytes) else str(got[1])
    payload = mailbox.parse(got[1])
    assert payload["error"]["type"] == "InvalidRequest", payload
    assert "base_commit" in payload["error"]["message"]
    assert payload["error"]["field"] == "base_commit"
    for leak in ("INSERT", "nonce", "token", "sandboxes", "[SQL"):
        assert leak.lower() not in raw.lower(), raw
    assert _snapshot(env) == before
