"""A non-default SANDMAN_NAMESPACE works on a fresh cluster without ``kubectl create ns``:
the workers' root creates it, the read-only admin UI's root only reports it missing."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from broker.acquire.root import WEB, WORKER, Root
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.ledger.states import State
from broker.settings import Settings
from broker.wire.request import AcquireRequest
from tests.cluster.conftest import KWOK_NODE_SELECTOR, KWOK_TOLERATION

pytestmark = pytest.mark.cluster


@pytest.fixture
def missing_namespace(kubeconfig_path: str) -> Iterator[str]:
    """A namespace name nobody created; deleted afterwards if the test made it."""
    from broker.backends.kube.api import Kube, load_api_client

    name = f"lc-fresh-ns-{secrets.token_hex(3)}"
    yield name
    Kube(load_api_client(kubeconfig_path, qps_pool=2)).delete_namespace(name)


def _exists(core_v1: Any, name: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        core_v1.read_namespace(name)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def test_workers_create_the_namespace_and_the_first_create_works(
    kubeconfig_path, missing_namespace, tmp_path, database_url, sessions, core_v1
):
    settings = Settings(
        state_dir=tmp_path,
        backend="kubernetes",
        kubeconfig=kubeconfig_path,
        namespace=missing_namespace,
        installation_id=f"ns-{secrets.token_hex(4)}",
    )
    web = Root(settings, WEB, database_url=database_url)
    assert web.backend() is None
    assert "NamespaceUnavailable" in (web.backend_error or "")
    assert missing_namespace in (web.backend_error or "")
    assert not _exists(core_v1, missing_namespace)  # the UI never creates it

    with sessions.begin() as s:
        store.ensure_job(
            s, "kwok", node_selector=KWOK_NODE_SELECTOR, tolerations=[KWOK_TOLERATION],
            readiness_budget_s=60.0,
        )  # fmt: skip
    worker = Root(settings, WORKER, database_url=database_url, actor="worker")
    try:
        provider = worker.provider()
        assert _exists(core_v1, missing_namespace)
        sid, token = provider.intent(
            AcquireRequest(job="kwok", image="localhost/kwok:1", cpu_m=10, memory_b=16 << 20)
        )
        lease = provider.create(sid, token)  # no kube_not_found on the first ConfigMap
        assert core_v1.read_namespaced_pod(lease.pod_name, missing_namespace)
        provider.release(sid)
        with sessions() as s:
            assert s.get(Sandbox, sid).state == State.DELETED
    finally:
        worker.dispose()
        web.dispose()
