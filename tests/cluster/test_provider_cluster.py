"""The provider and GC against the real API server (kwok nodes and the real node)."""

from __future__ import annotations

import datetime as dt
import multiprocessing
import os
import secrets
import signal
import threading

import pytest
from sqlalchemy import select

from bench.harness.faultproxy import FaultProxy, Rule
from bench.kwok import ensure_kwok_job, sentinel_pod
from broker.backends.kube.api import Kube, load_api_client
from broker.backends.kube.backend import KubeBackend
from broker.backends.kube.podspec import owner_name
from broker.errors import AcquireTimeout, SandmanError
from broker.ledger import store
from broker.ledger.models import Event, Leak, Sandbox, utcnow
from broker.ledger.states import State
from broker.ownership.gc import run_gc
from broker.ownership.provider import Provider
from broker.settings import Settings
from broker.wire.execd import execd_answers
from broker.wire.request import AcquireRequest
from tests.cluster.conftest import (
    REAL_NODE_SELECTOR,
    TASK_BASE_IMAGE,
)
from tests.support.wait import wait_until

pytestmark = pytest.mark.cluster


@pytest.fixture
def settings(kubeconfig_path, namespace, tmp_path):
    return Settings(
        state_dir=tmp_path,
        backend="kubernetes",
        kubeconfig=kubeconfig_path,
        namespace=namespace,
        installation_id=f"test-{secrets.token_hex(4)}",
        create_lease_margin_s=1.0,
    )


@pytest.fixture
def provider(settings, sessions):
    with sessions.begin() as s:
        ensure_kwok_job(s, "kwok", readiness_budget_s=60.0)
        store.ensure_job(s, "real", node_selector=REAL_NODE_SELECTOR, readiness_budget_s=120.0)
    return Provider(settings, sessions, KubeBackend.from_settings(settings))


def kwok_spec(**kw):
    return AcquireRequest(job="kwok", image="localhost/kwok:1", cpu_m=10, memory_b=16 << 20, **kw)


def pods_of(provider):
    return provider.backend.list_installation(
        provider.settings.namespace, provider.settings.installation_id
    )


def state_of(sessions, sid):
    with sessions() as s:
        return s.get(Sandbox, sid).state


def test_happy_path_on_the_real_node(provider, sessions, core_v1, settings):
    sid, token = provider.intent(
        AcquireRequest(
            job="real",
            image=TASK_BASE_IMAGE,
            cpu_m=250,
            memory_b=256 << 20,
            request_id=f"r-{sid_hex()}",
        )
    )
    lease = provider.create(sid, token)
    pod = core_v1.read_namespaced_pod(lease.pod_name, settings.namespace)
    node = core_v1.read_node(pod.spec.node_name)
    for key, value in REAL_NODE_SELECTOR.items():
        assert node.metadata.labels.get(key) == value  # scheduled by the job's node selector
    assert pod.spec.enable_service_links is False
    assert pod.spec.automount_service_account_token is False
    limits, requests = (
        pod.spec.containers[0].resources.limits,
        pod.spec.containers[0].resources.requests,
    )
    assert limits == requests
    assert execd_answers(lease.address, token)
    assert not execd_answers(lease.address, "wrong-token")
    with sessions() as s:
        row = s.get(Sandbox, sid)
        assert row.state == State.READY and row.create_to_ready_s and row.pod_ip
    provider.release(sid)
    assert state_of(sessions, sid) == State.DELETED
    assert not pods_of(provider)


def sid_hex() -> str:
    return secrets.token_hex(6)


def test_create_is_idempotent_on_retry(provider, sessions):
    request_id = f"r-{sid_hex()}"
    sid, token = provider.intent(kwok_spec(request_id=request_id))
    first = provider.create(sid, token)
    assert provider.intent(kwok_spec(request_id=request_id)) == (sid, token)
    again = provider.create(sid, token)  # redelivered task: same lease, no second pod
    assert again.pod_name == first.pod_name and len(pods_of(provider)) == 1
    provider.release(sid)
    provider.release(sid)  # releases are idempotent too
    assert not pods_of(provider)


@pytest.mark.parametrize("when", ["before-submit", "during-wait", "release-in-flight"])
def test_cancellation_at_every_step_leaves_no_pod(provider, sessions, when):
    give_up = threading.Event()
    sid, token = provider.intent(kwok_spec())
    if when == "before-submit":
        give_up.set()
    elif when == "during-wait":
        threading.Timer(0.05, give_up.set).start()
    else:
        real = provider.backend.create

        def create_then_release(spec):
            info = real(spec)
            provider.release(sid, actor="trainer")
            return info

        provider.backend.create = create_then_release  # type: ignore[method-assign]
    try:
        provider.create(sid, token, give_up=give_up)
    except AcquireTimeout:
        pass
    else:
        # The create can win the race against a 50 ms give-up; then release normally.
        provider.release(sid)
    with sessions() as s:
        row = s.get(Sandbox, sid)
        assert row.state == State.DELETED, row.last_error
    wait_until(lambda: not pods_of(provider), 30, what="no pods left")


def test_adoption_after_a_lost_create_response(
    provider, sessions, settings, kubeconfig_path, tmp_path
):
    proxy = FaultProxy.from_kubeconfig(kubeconfig_path).start()
    try:
        proxy.add(Rule("error_after", "POST", r"/pods$", times=1))
        proxied = Settings(
            **{**settings.__dict__, "kubeconfig": str(proxy.write_kubeconfig(tmp_path / "p.kcfg"))}
        )
        p = Provider(proxied, sessions, KubeBackend.from_settings(proxied))
        sid, token = p.intent(kwok_spec())
        p.create(sid, token)
        assert proxy.counts == {"error_after": 1}
        assert len(pods_of(provider)) == 1
        with sessions() as s:
            outcomes = [e.outcome for e in s.scalars(select(Event).where(Event.sandbox_id == sid))]
        assert "nonce-match" in outcomes
        p.release(sid)
        assert not pods_of(provider)
    finally:
        proxy.stop()


def _crash_after_create(settings, database_url, out):
    from broker.ledger.db import make_engine, make_session_factory

    def crash(name):
        if name == "after-create-sent":
            os.kill(os.getpid(), signal.SIGKILL)

    engine = make_engine(database_url, pool_size=1)
    p = Provider(
        settings, make_session_factory(engine), KubeBackend.from_settings(settings), failpoint=crash
    )
    sid, token = p.intent(kwok_spec())
    out.send(sid)
    p.create(sid, token)


def test_gc_collects_the_pod_of_a_worker_killed_mid_create(
    provider, sessions, settings, database_url
):
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_crash_after_create, args=(settings, database_url, send))
    child.start()
    sid = recv.recv()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert state_of(sessions, sid) == State.CREATING and len(pods_of(provider)) == 1
    with sessions.begin() as s:  # its readiness budget runs out (not waited for: 60 s)
        row = s.get(Sandbox, sid)
        assert row.lease_expires_at > utcnow()  # the dead creator's budget, still running
        row.lease_expires_at = utcnow() - dt.timedelta(seconds=1)
    report = run_gc(provider)
    assert any(a["sandbox"] == sid and a["why"] == "stuck_create" for a in report.actions)
    assert state_of(sessions, sid) == State.DELETED and not pods_of(provider)
    with sessions() as s:
        assert s.scalars(select(Leak).where(Leak.sandbox_id == sid)).one().resolution == "released"


def test_deleting_the_job_owner_cascades_to_its_pods(provider, sessions, core_v1, settings):
    sid, token = provider.intent(kwok_spec())
    provider.create(sid, token)
    core_v1.delete_namespaced_config_map(owner_name("kwok"), settings.namespace)
    wait_until(lambda: not pods_of(provider), 60, what="owner cascade")

    def ledger_caught_up():
        # The GC leaves rows younger than its race window alone, then closes the row.
        run_gc(provider)
        return state_of(sessions, sid) == State.DELETED

    wait_until(ledger_caught_up, 60, interval=2, what="GC closing the row of the lost pod")


def test_sentinel_pods_are_never_deleted(provider, settings, kubeconfig_path):
    admin = Kube(load_api_client(kubeconfig_path))
    names = []
    for i, inst in enumerate(["another-installation", settings.installation_id]):
        name = f"sentinel-{i}-{sid_hex()}"
        admin.create_pod(settings.namespace, sentinel_pod(name, inst, "kwok", "not-in-any-ledger"))
        names.append(name)
    report = run_gc(provider)
    assert names[0] in report.foreign_pods and names[1] in report.unowned_pods
    for name in names:
        assert admin.get_pod(settings.namespace, name) is not None
    with pytest.raises(SandmanError):
        provider.backend.delete(settings.namespace, names[1], "some-other-nonce")
    assert admin.get_pod(settings.namespace, names[1]) is not None


def test_short_fault_campaign_keeps_every_invariant(kubeconfig_path, database_url, tmp_path):
    from bench.harness.campaign import run_campaign

    result = run_campaign(
        kubeconfig=kubeconfig_path,
        database_url=database_url,
        trials=24,
        concurrency=4,
        seed=7,
        sentinels=4,
        state_dir=tmp_path,
    )
    print(result.summary())
    assert result.ok, result.summary()
    assert result.trials == 24 and result.pods_created > 0


def test_readiness_and_deletes_come_from_one_shared_watch(
    provider, sessions, settings, kubeconfig_path, tmp_path
):
    """No per-pod watch and (nearly) no per-pod GET: one stream serves every waiter."""
    proxy = FaultProxy.from_kubeconfig(kubeconfig_path).start()
    try:
        one_pod = proxy.add(Rule("observe-get", "GET", r"/pods/sm-[^/]+$", times=None))
        lists = proxy.add(Rule("observe-list", "GET", r"/pods$", times=None))
        proxied = Settings(
            **{**settings.__dict__, "kubeconfig": str(proxy.write_kubeconfig(tmp_path / "p.kcfg"))}
        )
        backend = KubeBackend.from_settings(proxied)
        p = Provider(proxied, sessions, backend)
        n = 6
        for _ in range(n):
            sid, token = p.intent(kwok_spec())
            lease = p.create(sid, token)
            assert lease.address
            p.release(sid)
            assert state_of(sessions, sid) == State.DELETED
        # delete() reads the pod once to check its nonce: n reads are the protocol's own.
        assert one_pod.hits <= n + n // 2, proxy.counts
        assert lists.hits <= 4, proxy.counts  # one version list + one watch (+ a renewal)
        backend.close()
    finally:
        proxy.stop()


def test_waiters_recover_when_the_shared_watch_is_cut(
    provider, sessions, settings, kubeconfig_path, tmp_path
):
    """The API server vanishes (every connection cut, the shared watch among them) after
    the create was sent and before the pod is Ready: the waiter still sees it Ready."""
    proxy = FaultProxy.from_kubeconfig(kubeconfig_path).start()
    try:
        proxied = Settings(
            **{**settings.__dict__, "kubeconfig": str(proxy.write_kubeconfig(tmp_path / "p.kcfg"))}
        )
        backend = KubeBackend.from_settings(proxied)
        p = Provider(proxied, sessions, backend)
        sid, token = p.intent(
            AcquireRequest(job="real", image=TASK_BASE_IMAGE, cpu_m=100, memory_b=128 << 20)
        )
        result: dict[str, object] = {}

        def create() -> None:
            try:
                result["lease"] = p.create(sid, token)
            except SandmanError as exc:
                result["error"] = exc

        worker = threading.Thread(target=create)
        worker.start()
        with sessions() as s:
            pod_name = s.get(Sandbox, sid).pod_name
        # The real node takes seconds to start a container: cut the API while it does.
        wait_until(
            lambda: provider.backend.get(settings.namespace, pod_name) is not None,
            30,
            what="pod created",
        )
        proxy.blackout(1.0)
        worker.join(120)
        assert proxy.counts.get("blackout") == 1
        assert "lease" in result, result
        assert state_of(sessions, sid) == State.READY
        p.release(sid)
        with sessions() as s:
            row = s.get(Sandbox, sid)
            assert row.state == State.DELETED, row.last_error
        assert not pods_of(provider)
        backend.close()
    finally:
        proxy.stop()
