"""The pre-pull DaemonSet: invisible to the pod GC, owned by the job, held by digest."""

from __future__ import annotations

import pytest

from broker import names
from broker.backends.kube.podspec import prepull_daemonset, prepull_name

pytestmark = pytest.mark.unit
IMAGE = "localhost/task@sha256:" + "1" * 64


def test_prepull_pods_carry_no_sandbox_labels_and_hold_the_pinned_image() -> None:
    body = prepull_daemonset(
        installation="inst",
        job="j",
        image=IMAGE,
        node_selector={"pool": "gpu"},
        tolerations=[{"key": "k", "operator": "Exists"}],
        owner_uid="uid-1",
    )
    template = body["spec"]["template"]
    for labels in (body["metadata"]["labels"], template["metadata"]["labels"]):
        assert names.LABEL_INSTALLATION not in labels and names.LABEL_NONCE not in labels
        assert labels[names.LABEL_PREPULL] == "inst"
    assert body["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    container = template["spec"]["containers"][0]
    assert container["image"] == IMAGE and container["imagePullPolicy"] == "IfNotPresent"
    assert template["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert template["spec"]["automountServiceAccountToken"] is False
    assert body["metadata"]["name"] == prepull_name("inst", "j", IMAGE)


def test_prepull_names_are_stable_and_distinct() -> None:
    assert prepull_name("a", "j", IMAGE) == prepull_name("a", "j", IMAGE)
    assert len({prepull_name(i, j, IMAGE) for i in "ab" for j in ("j", "k")}) == 4
    assert len(prepull_name("a" * 60, "j" * 60, IMAGE)) <= 63
