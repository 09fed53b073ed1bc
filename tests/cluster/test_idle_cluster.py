"""Idle reclaim of pods on the local cluster's real node (broker/acquire/idle.py).

Two held sandboxes of a job with a 1 s idle timeout: the idle one is reclaimed (execd
refuses at once, the ledger says why, the pod is deleted through the provider's
nonce-checked release), the one running a command is not until the command ended. The
sweep runs in the test process (as each worker's sweep thread would) against the real
API server, PostgreSQL and Redis; the release the sweep enqueues is run by the test, so
it can look between the revoke and the delete.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_lib

from broker.acquire.idle import IdleReclaimer
from broker.backends.kube.backend import KubeBackend
from broker.client import core
from broker.errors import SandboxLost, SandboxReclaimed
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.ledger.states import State
from broker.names import IDLE_DEADLINES_KEY, reclaimed_key
from broker.ownership.provider import Provider
from broker.wire.execd import Endpoint, exec_call, reclaim_call, run_call, shared_http
from broker.wire.request import AcquireRequest
from tests.cluster.conftest import REAL_NODE_SELECTOR, TASK_BASE_IMAGE, cluster_settings
from tests.support.wait import wait_until

pytestmark = pytest.mark.cluster
TIMEOUT_S = 1.0


@pytest.fixture
def redis(redis_url: str) -> Iterator[redis_lib.Redis]:
    r = redis_lib.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/13")
    r.delete(IDLE_DEADLINES_KEY)
    yield r
    r.delete(IDLE_DEADLINES_KEY)
    r.close()


@pytest.fixture
def provider(
    kubeconfig_path: str, namespace: str, tmp_path: Any, sessions: Any
) -> Iterator[Provider]:
    settings = cluster_settings(kubeconfig_path, namespace, tmp_path)
    with sessions.begin() as s:
        store.ensure_job(
            s,
            "idle-real",
            node_selector=REAL_NODE_SELECTOR,
            readiness_budget_s=120.0,
            idle_timeout_s=TIMEOUT_S,
        )
    backend = KubeBackend.from_settings(settings)
    yield Provider(settings, sessions, backend)
    backend.close()


def _hold(provider: Provider) -> tuple[str, Endpoint]:
    request = AcquireRequest(
        job="idle-real",
        image=TASK_BASE_IMAGE,
        cpu_m=100,
        memory_b=128 << 20,
        request_id=f"r-{secrets.token_hex(6)}",
    )
    sid, token = provider.intent(request)
    lease = provider.create(sid, token)
    return sid, Endpoint(lease.address, token)


def test_an_idle_pod_is_reclaimed_and_a_busy_one_kept_until_its_command_ends(
    provider: Provider, sessions: Any, redis: redis_lib.Redis, core_v1: Any
) -> None:
    releases: list[list[Any]] = []
    idle = IdleReclaimer(sessions, redis, provider, lambda name, args, queue: releases.append(args))
    idle_id, idle_execd = _hold(provider)
    busy_id, busy_execd = _hold(provider)
    gate = "/tmp/go"
    done: list[int] = []
    call = exec_call(f"while [ ! -e {gate} ]; do sleep 0.05; done", timeout=600)
    runner = threading.Thread(
        target=lambda: done.append(busy_execd.send(shared_http(), call)["exit_code"])
    )
    runner.start()
    ask = reclaim_call(1e9, 1e9)  # a timeout never reached: only reports
    wait_until(lambda: busy_execd.send(shared_http(), ask)["running"], what="the command")
    for sid in (idle_id, busy_id):  # held from now on (as at a hand-out)
        idle.register(sid, TIMEOUT_S)

    def swept_until(sid: str) -> bool:
        return sid in idle.sweep().reclaimed or bool(redis.exists(reclaimed_key(sid)))

    wait_until(lambda: swept_until(idle_id), what="the idle pod reclaimed")
    with sessions() as s:
        row = s.get(Sandbox, idle_id)
        assert row is not None and row.state == State.RELEASING
    with pytest.raises(SandboxReclaimed):  # the pod still runs: its execd refuses
        idle_execd.send(shared_http(), exec_call("true"))
    assert releases == [[idle_id, "idle"]]
    provider.release(idle_id, actor="worker", reason="idle")  # what the release task does
    with sessions() as s:
        row = s.get(Sandbox, idle_id)
        assert row is not None and row.state == State.DELETED
    assert provider.backend.get(provider.settings.namespace, row.pod_name) is None
    with pytest.raises(SandboxLost) as lost:  # the pod is gone: the marker says why
        idle_execd.send(shared_http(), exec_call("true"))
    marker = redis.get(reclaimed_key(idle_id))
    assert isinstance(core.lost_error(lost.value, idle_id, marker), SandboxReclaimed)

    # The busy pod was judged at least once past its deadline, and kept.
    wait_until(lambda: idle.sweep().rescheduled or None, what="a check of the busy pod")
    assert not redis.exists(reclaimed_key(busy_id))
    with sessions() as s:
        row = s.get(Sandbox, busy_id)
        assert row is not None and row.state == State.READY
    busy_execd.send(shared_http(), run_call(f"touch {gate}"))  # beside the busy session
    runner.join()
    assert done == [0]
    wait_until(lambda: swept_until(busy_id), what="the busy pod reclaimed after its command")
    provider.release(busy_id, actor="worker", reason="idle")
    with sessions() as s:
        row = s.get(Sandbox, busy_id)
        assert row is not None and row.state == State.DELETED
