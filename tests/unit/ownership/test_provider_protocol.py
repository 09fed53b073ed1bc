"""The ownership protocol against the real ledger, with faults injected at the backend seam."""

import datetime as dt
import threading

import pytest
from sqlalchemy import select, update

from broker.backends.base import LABEL_INSTALLATION, LABEL_NONCE
from broker.errors import (
    AcquireTimeout,
    AtCapacity,
    CreateFailed,
    ForeignPod,
    GuardMissing,
    IllegalTransition,
    ImageNotFound,
    UnknownJob,
)
from broker.ledger import store
from broker.ledger.models import Event, Leak, Sandbox
from broker.ledger.states import State
from broker.ownership.gc import run_gc
from broker.ownership.provider import Provider
from broker.settings import Settings
from broker.wire.request import AcquireRequest
from tests.support.fakes import FakeBackend

pytestmark = pytest.mark.unit


@pytest.fixture
def backend():
    return FakeBackend()


@pytest.fixture
def provider(sessions, backend, tmp_path):
    settings = Settings(state_dir=tmp_path, installation_id=f"inst-{tmp_path.name[-8:]}")
    sleeps: list[float] = []
    p = Provider(settings, sessions, backend, sleep=sleeps.append, probe=lambda a, t: True)
    p.sleeps = sleeps  # type: ignore[attr-defined]
    with sessions.begin() as s:
        store.ensure_job(s, "job-a", readiness_budget_s=5.0, lease_s=60.0)
        store.ensure_job(s, "job-deny", egress="deny")
    return p


def spec(**kw):
    return AcquireRequest(job=kw.pop("job", "job-a"), image="localhost/task:1", **kw)


def row_of(sessions, sandbox_id) -> Sandbox:
    with sessions() as s:
        return s.get(Sandbox, sandbox_id)


def test_happy_path_creates_one_pod_and_release_deletes_it(provider, backend, sessions):
    sid, token = provider.intent(spec(request_id="r-happy"))
    assert row_of(sessions, sid).state == State.REQUESTED
    lease = provider.create(sid, token)
    assert lease.address == "10.0.0.1:8080" and lease.token == token
    row = row_of(sessions, sid)
    assert row.state == State.READY and row.token_hash == store.hash_token(token)
    assert len(backend.pods) == 1
    provider.release(sid)
    assert row_of(sessions, sid).state == State.DELETED and not backend.pods
    with sessions() as s:
        states = [
            e.to_state
            for e in s.scalars(
                select(Event)
                .where(Event.sandbox_id == sid, Event.kind == "transition")
                .order_by(Event.id)
            )
        ]
    assert states == ["requested", "creating", "ready", "releasing", "deleted"]


def test_intent_is_idempotent_by_request_id(provider):
    a = provider.intent(spec(request_id="r-same"))
    b = provider.intent(spec(request_id="r-same"))
    assert a == b


def test_unknown_job_is_a_typed_error_and_writes_nothing(provider, sessions):
    with pytest.raises(UnknownJob):
        provider.intent(spec(job="nope", request_id="r-unknown"))
    with sessions() as s:
        assert store.by_request(s, "r-unknown") is None


def test_missing_image_is_typed_before_the_intent_row(provider, backend, sessions):
    backend.missing_images.add("localhost/task:1")
    with pytest.raises(ImageNotFound):
        provider.intent(spec(request_id="r-noimage"))
    with sessions() as s:
        assert store.by_request(s, "r-noimage") is None
    assert not backend.pods
    backend.missing_images.clear()
    pinned = "sha256:" + "a" * 64
    backend.missing_images.add(pinned)  # a pinned digest is what is checked
    with pytest.raises(ImageNotFound):
        provider.intent(spec(request_id="r-pinned", image_digest=pinned))


def test_5xx_after_store_is_adopted_by_nonce(provider, backend, sessions):
    backend.faults["create"].append("5xx-after-store")
    sid, token = provider.intent(spec())
    provider.create(sid, token)
    assert len(backend.pods) == 1
    assert backend.calls.count(f"create {row_of(sessions, sid).pod_name}") == 1
    with sessions() as s:
        outcomes = [
            e.outcome
            for e in s.scalars(select(Event).where(Event.sandbox_id == sid, Event.kind == "api"))
        ]
    assert "nonce-match" in outcomes


def test_reset_before_store_retries_and_makes_exactly_one_pod(provider, backend, sessions):
    backend.faults["create"].append("reset-before-store")
    sid, token = provider.intent(spec())
    provider.create(sid, token)
    assert len(backend.pods) == 1
    assert row_of(sessions, sid).state == State.READY


def test_429_honours_retry_after(provider, backend):
    backend.faults["create"].append("429")
    sid, token = provider.intent(spec())
    provider.create(sid, token)
    assert provider.sleeps and provider.sleeps[0] >= 1.5


def test_foreign_pod_with_our_name_is_never_touched(provider, backend, sessions):
    sid, token = provider.intent(spec())
    name = row_of(sessions, sid).pod_name
    backend.add_pod(
        "sandman-sandboxes", name, {LABEL_INSTALLATION: "other", LABEL_NONCE: "sentinel"}
    )
    with pytest.raises(ForeignPod) as info:
        provider.create(sid, token)
    assert isinstance(info.value, CreateFailed) and info.value.code == CreateFailed.code
    assert info.value.pod_name == name and info.value.nonce == "sentinel"
    assert not info.value.retryable
    assert backend.pods[("sandman-sandboxes", name)].nonce == "sentinel"
    assert row_of(sessions, sid).state == State.FAILED


def test_job_at_its_live_cap_is_refused_by_type_and_writes_nothing(provider, sessions):
    with sessions.begin() as s:
        store.ensure_job(s, "job-capped", max_live=1)
    provider.intent(spec(job="job-capped", request_id="r-cap-1"))
    with pytest.raises(AtCapacity) as info:
        provider.intent(spec(job="job-capped", request_id="r-cap-2"))
    assert info.value.retryable
    with sessions() as s:
        assert store.by_request(s, "r-cap-2") is None
    # the cap never refuses a redelivery of an admitted request
    assert provider.intent(spec(job="job-capped", request_id="r-cap-1"))


def test_abandoned_request_is_refused_unless_already_admitted(provider, sessions):
    admitted = provider.intent(spec(request_id="r-admitted"))
    assert provider.intent(spec(request_id="r-admitted"), abandoned=True) == admitted
    with pytest.raises(AcquireTimeout):
        provider.intent(spec(request_id="r-abandoned"), abandoned=True)
    with sessions() as s:
        assert store.by_request(s, "r-abandoned") is None


def assert_given_up_create_deletes(p, backend, sessions, give_up: threading.Event) -> None:
    """The create the caller gave up on times out and leaves no pod, and its row deleted."""
    sid, token = p.intent(spec())
    with pytest.raises(AcquireTimeout):
        p.create(sid, token, give_up=give_up)
    assert not backend.pods
    assert row_of(sessions, sid).state == State.DELETED


def test_caller_giving_up_mid_create_still_gets_the_pod_deleted(provider, backend, sessions):
    backend.become_ready = False
    give_up = threading.Event()
    give_up.set()
    assert_given_up_create_deletes(provider, backend, sessions, give_up)


def test_caller_giving_up_as_the_pod_turns_ready_still_gets_it_deleted(sessions, backend, tmp_path):
    """The give-up lands after readiness was seen but before the ready commit: the
    creator itself must delete the pod (the row is still `creating`)."""
    give_up = threading.Event()
    settings = Settings(state_dir=tmp_path, installation_id=f"inst-{tmp_path.name[-8:]}")
    p = Provider(
        settings,
        sessions,
        backend,
        probe=lambda a, t: True,
        failpoint=lambda name: give_up.set() if name == "before-ready-commit" else None,
    )
    with sessions.begin() as s:
        store.ensure_job(s, "job-a", readiness_budget_s=5.0, lease_s=60.0)
    assert_given_up_create_deletes(p, backend, sessions, give_up)


def test_release_during_create_is_honoured_by_the_creator(provider, backend, sessions):
    sid, token = provider.intent(spec())
    real_create = backend.create

    def create_then_release(s):
        info = real_create(s)
        provider.release(sid, actor="trainer")  # arrives while the create is in flight
        return info

    backend.create = create_then_release
    with pytest.raises(AcquireTimeout):
        provider.create(sid, token)
    assert not backend.pods and row_of(sessions, sid).state == State.DELETED


def test_egress_denied_create_is_refused_without_its_guard(provider, backend, sessions):
    backend.deny_guard_install = True
    sid, token = provider.intent(spec(job="job-deny"))
    with pytest.raises(GuardMissing):
        provider.create(sid, token)
    assert not backend.pods


def test_failed_delete_stays_pending_and_gc_retries_it(provider, backend, sessions):
    sid, token = provider.intent(spec())
    provider.create(sid, token)
    backend.faults["delete"].append("unavailable")
    provider.release(sid)
    row = row_of(sessions, sid)
    assert row.state == State.RELEASING and row.delete_attempts == 1 and backend.pods
    report = run_gc(provider)
    assert not backend.pods and row_of(sessions, sid).state == State.DELETED
    assert any(a["sandbox"] == sid for a in report.actions)


def _expire(sessions, sid):
    past = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    with sessions.begin() as s:
        s.execute(
            update(Sandbox)
            .where(Sandbox.id == sid)
            .values(lease_expires_at=past, requested_at=past, ready_at=past)
        )


def test_gc_removes_pod_of_stuck_create_after_worker_death(provider, backend, sessions):
    sid, _token = provider.intent(spec())
    with sessions.begin() as s:  # the worker committed `creating`, created, then died
        store.transition(s, s.get(Sandbox, sid), State.CREATING)
    row = row_of(sessions, sid)
    backend.add_pod(
        row.namespace, row.pod_name, {LABEL_INSTALLATION: row.installation, LABEL_NONCE: row.nonce}
    )
    assert run_gc(provider).actions == []  # lease not expired yet: may still be in flight
    _expire(sessions, sid)
    run_gc(provider)
    assert not backend.pods and row_of(sessions, sid).state == State.DELETED
    with sessions() as s:
        leak = s.scalars(select(Leak).where(Leak.sandbox_id == sid)).one()
    assert leak.kind == "stuck_create" and leak.resolution == "released"


def test_gc_reclaims_abandoned_sandbox_and_deletes_late_pod(provider, backend, sessions):
    sid, token = provider.intent(spec())
    provider.create(sid, token)
    _expire(sessions, sid)
    run_gc(provider)
    assert row_of(sessions, sid).state == State.DELETED and not backend.pods
    # A late pod for a deleted row (create that landed after give-up) is ours: delete it.
    row = row_of(sessions, sid)
    backend.add_pod(
        row.namespace, row.pod_name, {LABEL_INSTALLATION: row.installation, LABEL_NONCE: row.nonce}
    )
    run_gc(provider)
    assert not backend.pods


def test_gc_never_deletes_sentinel_pods(provider, backend, sessions):
    inst = provider.settings.installation_id
    backend.add_pod(
        "sandman-sandboxes", "sentinel-other", {LABEL_INSTALLATION: "other", LABEL_NONCE: "n1"}
    )
    backend.add_pod(
        "sandman-sandboxes",
        "sentinel-ours",
        {LABEL_INSTALLATION: inst, LABEL_NONCE: "unknown-nonce"},
    )
    report = run_gc(provider)
    assert len(backend.pods) == 2
    assert report.foreign_pods == ["sentinel-other"]
    assert report.unowned_pods == ["sentinel-ours"]
    with sessions() as s:
        assert (
            s.scalars(select(Leak).where(Leak.pod_name == "sentinel-ours")).one().kind
            == "unowned_pod"
        )
    del backend.pods[("sandman-sandboxes", "sentinel-ours")]
    run_gc(provider)
    with sessions() as s:
        assert (
            s.scalars(select(Leak).where(Leak.pod_name == "sentinel-ours")).one().resolution
            == "gone"
        )


def test_gc_closes_ready_row_whose_pod_vanished(provider, backend, sessions):
    sid, token = provider.intent(spec())
    provider.create(sid, token)
    backend.pods.clear()
    _expire(sessions, sid)
    report = run_gc(provider)
    assert sid in report.dangling_rows
    assert row_of(sessions, sid).state == State.DELETED


def test_gc_dry_run_changes_nothing(provider, backend, sessions):
    sid, token = provider.intent(spec())
    provider.create(sid, token)
    _expire(sessions, sid)
    report = run_gc(provider, dry_run=True)
    assert report.actions and backend.pods
    assert row_of(sessions, sid).state == State.READY


def test_illegal_transition_raises(provider, sessions):
    sid, _ = provider.intent(spec())
    with sessions.begin() as s, pytest.raises(IllegalTransition):
        store.transition(s, s.get(Sandbox, sid), State.READY)
