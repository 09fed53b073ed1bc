"""Images on the real node come through the loopback registry (issue #15 items 1-2).

The local cluster's registry serves ``localhost/...`` refs (up.sh writes the setting
beside the kubeconfig). Each test pushes its image under a fresh name, so the node
cannot already hold it: a cold create pays a real pull, recorded in the ledger; a tag
the registry lacks is ImageNotFound before any row or pod; a manifest whose layer blob
is gone fails as ImagePullFailed as soon as the node says so.
"""

from __future__ import annotations

import secrets

import pytest
from sqlalchemy import func, select

from broker.backends.kube.backend import KubeBackend
from broker.errors import ImageNotFound, ImagePullFailed
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.ledger.states import State
from broker.ownership.provider import Provider
from broker.settings import Settings
from broker.wire.execd import execd_answers
from broker.wire.request import AcquireRequest
from tests.cluster.conftest import REAL_NODE_SELECTOR, TASK_BASE_IMAGE, image_tarball
from tests.support.registry import LoopbackRegistry, tiny_image

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def registry(registry_setting: str) -> LoopbackRegistry:
    return LoopbackRegistry.running_at(registry_setting.split("=", 1)[1])


@pytest.fixture
def provider(kubeconfig_path, namespace, tmp_path, sessions, registry_setting):
    settings = Settings(
        state_dir=tmp_path,
        backend="kubernetes",
        kubeconfig=kubeconfig_path,
        namespace=namespace,
        installation_id=f"test-{secrets.token_hex(4)}",
        registries=registry_setting,
    )
    with sessions.begin() as s:
        store.ensure_job(s, "real-pull", node_selector=REAL_NODE_SELECTOR, readiness_budget_s=180.0)
    backend = KubeBackend.from_settings(settings)
    yield Provider(settings, sessions, backend)
    backend.close()


def _request(image: str) -> AcquireRequest:
    return AcquireRequest.new(job="real-pull", image=image, cpu=0.25, memory="256Mi")


def test_a_cold_create_pulls_by_digest_and_the_ledger_records_it(provider, sessions, registry):
    name = f"sandman-pulltest-{secrets.token_hex(3)}:v1"
    digest = registry.push(image_tarball(TASK_BASE_IMAGE), name)
    image = f"localhost/{name}"
    sids = []
    try:
        for _ in range(2):
            sid, token = provider.intent(_request(image))
            sids.append(sid)
            lease = provider.create(sid, token)
            assert execd_answers(lease.address, token)
        with sessions() as s:
            cold, warm = (s.get(Sandbox, sid) for sid in sids)
            assert cold.image_resolved == digest == warm.image_resolved
            assert cold.image_pulled is True and cold.image_pull_s and cold.image_pull_s > 0
            assert warm.image_pulled is False, "the node holds the image now"
        pod = provider.backend.kube.get_pod(provider.settings.namespace, lease.pod_name)
        repository = name.split(":", maxsplit=1)[0]
        assert pod["spec"]["containers"][0]["image"] == f"localhost/{repository}@{digest}"
    finally:
        for sid in sids:
            provider.release(sid)


def test_a_missing_tag_is_image_not_found_before_any_row_or_pod(provider, sessions):
    request = _request(f"localhost/sandman-task-base:missing-{secrets.token_hex(3)}")
    with pytest.raises(ImageNotFound):
        provider.intent(request)
    with sessions() as s:
        count = s.scalar(select(func.count()).where(Sandbox.request_id == request.request_id))
    assert count == 0
    assert not provider.backend.list_installation(
        provider.settings.namespace, provider.settings.installation_id
    )


def test_a_manifest_whose_blob_is_gone_is_image_pull_failed(provider, sessions, registry, tmp_path):
    name = f"sandman-broken-{secrets.token_hex(3)}"
    digest = registry.push(tiny_image(tmp_path, f"localhost/{name}:v1", name), f"{name}:v1")
    manifest = provider.backend.registry.manifest(f"localhost/{name}@{digest}").json()
    registry.delete_blob(name, manifest["layers"][0]["digest"])
    sid, token = provider.intent(_request(f"localhost/{name}:v1"))
    with pytest.raises(ImagePullFailed) as info:
        provider.create(sid, token)
    assert info.value.reason in ("ErrImagePull", "ImagePullBackOff")
    with sessions() as s:
        row = s.get(Sandbox, sid)
        assert row.state in (State.FAILED, State.DELETED), row.state
        assert "pull" in (row.last_error or "").lower()
    assert not provider.backend.list_installation(
        provider.settings.namespace, provider.settings.installation_id
    )


def test_a_hot_image_is_pre_pulled_so_the_first_create_does_not_pull(provider, sessions, registry):
    """The pre-pull reconciler holds a job's hot image on the real node (a DaemonSet,
    no ledger row, invisible to the pod GC); the job's first create then finds it there.
    Once the job no longer wants it, the DaemonSet goes."""
    from broker.backends.kube.podspec import prepull_name
    from broker.ownership.gc import run_gc
    from broker.pools.prepull import PrePull
    from tests.support.wait import wait_until

    name = f"sandman-hot-{secrets.token_hex(3)}:v1"
    digest = registry.push(image_tarball(TASK_BASE_IMAGE), name)
    image = f"localhost/{name}"
    namespace = provider.settings.namespace
    with sessions.begin() as s:
        store.ensure_job(s, "real-pull", hot_images=[image])
    prepull = PrePull(provider.settings, sessions, provider.backend, None, lambda job: None)
    sid = None
    try:
        counts = prepull.reconcile()
        assert counts["created"] >= 1, counts
        pinned = f"localhost/{name.split(':', maxsplit=1)[0]}@{digest}"
        held = prepull_name(provider.settings.installation_id, "real-pull", pinned)

        def pulled_everywhere():
            mine = [p for p in provider.backend.prepulls(namespace) if p.name == held]
            return mine and mine[0].desired >= 1 and mine[0].ready == mine[0].desired

        wait_until(pulled_everywhere, timeout=300, what=f"pre-pull {held} ready")
        report = run_gc(provider)
        seen = report.unowned_pods + report.foreign_pods + report.late_pods
        assert not [pod for pod in seen if pod.startswith(held)], report
        sid, token = provider.intent(_request(image))
        provider.create(sid, token)
        with sessions() as s:
            row = s.get(Sandbox, sid)
            assert row.image_resolved == digest
            assert row.image_pulled is False, "pre-pulled: the create found the image"
    finally:
        if sid is not None:
            provider.release(sid)
        with sessions.begin() as s:
            store.ensure_job(s, "real-pull", hot_images=[])
    after = prepull.reconcile()
    assert after["removed"] >= 1
    assert all(p.name != held for p in provider.backend.prepulls(namespace))
