"""A sandbox's execd is reachable only from namespaces labelled for it (#20 item 5).

The broker puts one ingress guard per installation on its sandboxes
(``podspec.ingress_policy``), before the first pod. On the local cluster, whose real node
enforces NetworkPolicy (kube-network-policies), this test runs a real sandbox and two
client pods on the real node: another pod of the same installation in the sandbox
namespace (a rollout probing its neighbour) never connects to the sandbox's execd, a pod
of a namespace labelled ``sandman.io/execd-access=allowed`` (a trainer) does, and the
broker on the host still gets answers with the sandbox's token.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker import names
from broker.backends.base import PodSpec
from broker.backends.kube.api import Kube
from broker.backends.kube.backend import KubeBackend
from broker.backends.kube.egress_probe import PodOutcome, _pod_body, _wait_for_reports
from broker.ledger import store
from broker.ownership.provider import Provider
from broker.settings import Settings
from broker.wire.execd import execd_answers
from broker.wire.request import AcquireRequest
from tests.cluster.conftest import REAL_NODE_SELECTOR, TASK_BASE_IMAGE, default_sa_exists
from tests.support.wait import wait_until

pytestmark = pytest.mark.cluster


@pytest.fixture
def settings(kubeconfig_path: str, namespace: str, tmp_path: Path) -> Settings:
    return Settings(
        state_dir=tmp_path,
        backend="kubernetes",
        kubeconfig=kubeconfig_path,
        namespace=namespace,
        installation_id=f"ingress-{secrets.token_hex(4)}",
    )


@pytest.fixture
def provider(settings: Settings, sessions: Any) -> Provider:
    with sessions.begin() as session:
        store.ensure_job(
            session, "ingress", node_selector=REAL_NODE_SELECTOR, readiness_budget_s=120.0
        )
    return Provider(settings, sessions, KubeBackend.from_settings(settings))


@pytest.fixture
def trainer_namespace(core_v1: Any) -> Iterator[str]:
    """A namespace whose pods may call execd, as a trainer's in-cluster namespace is."""
    from kubernetes import client

    name = f"lc-trainers-{secrets.token_hex(3)}"
    labels = {"sandman.io/test": "localcluster", names.LABEL_EXECD_ACCESS: "allowed"}
    core_v1.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=labels))
    )
    wait_until(lambda: default_sa_exists(core_v1, name), 60, what=f"serviceaccount {name}/default")
    yield name
    core_v1.delete_namespace(name, grace_period_seconds=0)


def _connect_from_pod(
    kube: Kube, namespace: str, installation: str, address: str, *, expect: bool
) -> PodOutcome:
    """A pod on the real node tries TCP connects to ``address`` and reports them."""
    host, port = address.rsplit(":", 1)
    name = f"client-{secrets.token_hex(4)}"
    spec = PodSpec(
        name=name,
        namespace=namespace,
        installation=installation,
        job="ingress",
        sandbox_id=name,
        nonce=secrets.token_hex(4),
        role="rollout",
        image=TASK_BASE_IMAGE,
        cpu_m=100,
        memory_b=64 << 20,
        token="",
        node_selector=dict(REAL_NODE_SELECTOR),
    )
    args = {
        "host": host,
        "port": int(port),
        "banner": "",
        "delay_s": 2.0,  # time for the engine to learn this pod's address
        "attempts": 8,
        "interval_s": 1.0,
        "timeout_s": 2.0,
        "stop_when_connected": expect,
    }
    kube.create_pod(namespace, _pod_body(spec, args, deadline_s=120))
    try:
        return _wait_for_reports(kube, namespace, {True: spec}, time.monotonic() + 150)[True]
    finally:
        kube.delete_pod(namespace, name, uid=None, grace_s=0)


def test_only_labelled_namespaces_reach_a_sandboxs_execd(
    provider: Provider, settings: Settings, enforcing_kube: Kube, trainer_namespace: str
) -> None:
    sid, token = provider.intent(
        AcquireRequest(job="ingress", image=TASK_BASE_IMAGE, cpu_m=250, memory_b=256 << 20)
    )
    lease = provider.create(sid, token)
    try:
        policy = enforcing_kube.get_object(
            "networkpolicy", settings.namespace, f"sandman-ingress-{settings.installation_id}"
        )
        assert policy is not None, "the ingress guard exists once a sandbox does"
        neighbour = _connect_from_pod(
            enforcing_kube, settings.namespace, settings.installation_id, lease.address,
            expect=False,
        )  # fmt: skip
        assert not neighbour.problem, neighbour
        assert neighbour.attempts and not any(a.connected for a in neighbour.attempts), neighbour
        trainer = _connect_from_pod(
            enforcing_kube, trainer_namespace, "trainers", lease.address, expect=True
        )
        assert not trainer.problem, trainer
        assert trainer.attempts[-1].connected, trainer
        assert execd_answers(lease.address, token), "the broker on the host is still served"
    finally:
        provider.release(sid)
