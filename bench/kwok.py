"""Pods for the local cluster's kwok nodes, built one way for the benches, campaigns and tests.

kwok nodes run no containers: a pod there is only an API object that kwok marks Ready.
That is what the scale and fault benches want (the API server and the broker under load,
no kubelet), but it needs a node selector and a toleration of kwok's taint on every pod.
Sentinel pods (our label keys, not our nonce) prove that the GC never deletes what is not
its own; the fault campaign and the provider's cluster tests plant the same ones.
"""

from __future__ import annotations

from typing import Any

from broker.names import LABEL_INSTALLATION, LABEL_JOB, LABEL_NONCE

KWOK_SELECTOR = {"type": "kwok"}
KWOK_TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}
KWOK_IMAGE = "localhost/kwok:1"  # never pulled: kwok only pretends to run it


def kwok_pod(
    name: str,
    labels: dict[str, str],
    *,
    image: str = KWOK_IMAGE,
    container: str = "c",
    namespace: str | None = None,
    resources: dict[str, Any] | None = None,
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A pod manifest scheduled onto a kwok node; ``spec`` adds fields to the pod spec."""
    metadata: dict[str, Any] = {"name": name, "labels": labels}
    if namespace:
        metadata["namespace"] = namespace
    main: dict[str, Any] = {"name": container, "image": image}
    if resources:
        main["resources"] = resources
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "nodeSelector": KWOK_SELECTOR,
            "tolerations": [KWOK_TOLERATION],
            **(spec or {}),
            "containers": [main],
        },
    }


def sentinel_pod(name: str, installation: str, job: str, nonce: str) -> dict[str, Any]:
    """A pod with our label keys whose nonce is in no ledger: the GC must report, not delete."""
    return kwok_pod(name, {LABEL_INSTALLATION: installation, LABEL_JOB: job, LABEL_NONCE: nonce})


def plant_sentinels(admin: Any, namespace: str, installation: str, count: int) -> list[str]:
    """``count`` sentinel pods, alternately of another installation and of ours with an
    unknown nonce (both must survive every GC pass); their names."""
    names = []
    for i in range(count):
        name = f"sentinel-{installation}-{i}"[:63]
        inst = installation if i % 2 else "someone-else"
        admin.create_pod(namespace, sentinel_pod(name, inst, "campaign", f"sentinel{i}"))
        names.append(name)
    return names


def ensure_kwok_job(session: Any, job: str, **options: Any) -> None:
    """Create or update ``job`` with its pods pinned to kwok nodes (``options``: budgets etc.)."""
    from broker.ledger import store

    store.ensure_job(
        session, job, node_selector=KWOK_SELECTOR, tolerations=[KWOK_TOLERATION], **options
    )
