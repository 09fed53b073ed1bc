"""The local Kubernetes cluster works end to end.

Checks the parts later issues rely on: kwok fake nodes and the real node are Ready,
a locally built task image runs real Python on the real node (readiness probe, pod IP
reachable from the host, logs), controller-manager garbage collection cascades to
dependents, and the scheduler honours topology spread over the fake nodes.
"""

from __future__ import annotations

import json
import urllib.request
from collections import Counter
from typing import Any

import pytest
from kubernetes.utils import parse_quantity

from tests.cluster.conftest import (
    KWOK_NODE_SELECTOR,
    KWOK_TOLERATION,
    REAL_NODE_SELECTOR,
    REPO_ROOT,
    SWE_TASK_IMAGE,
    TASK_BASE_IMAGE,
)
from tests.support.wait import wait_until

pytestmark = pytest.mark.cluster

MIN_KWOK_NODES = 16
SWE_TASK_DIR = REPO_ROOT / "deploy" / "images" / "swe-task"


def _ready(node: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])


def _pod(name: str, spec: dict[str, Any], labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"automountServiceAccountToken": False, **spec},
    }


def _phase(core_v1: Any, ns: str, name: str) -> str:
    return core_v1.read_namespaced_pod(name, ns).status.phase or ""


def _pod_ready(core_v1: Any, ns: str, name: str) -> bool:
    pod = core_v1.read_namespaced_pod(name, ns)
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def test_nodes_ready(core_v1: Any) -> None:
    nodes = core_v1.list_node().items
    kwok = [n for n in nodes if (n.metadata.labels or {}).get("type") == "kwok"]
    real = [n for n in nodes if (n.metadata.labels or {}).get("sandman.io/node-kind") == "real"]

    assert len(kwok) >= MIN_KWOK_NODES, [n.metadata.name for n in nodes]
    assert all(_ready(n) for n in kwok), [n.metadata.name for n in kwok if not _ready(n)]
    zones = {n.metadata.labels["topology.kubernetes.io/zone"] for n in kwok}
    assert len(zones) == 3, zones
    for n in kwok:
        assert n.metadata.labels["kubernetes.io/hostname"] == n.metadata.name
        taints = {(t.key, t.value, t.effect) for t in n.spec.taints or []}
        assert ("kwok.x-k8s.io/node", "fake", "NoSchedule") in taints
        assert parse_quantity(n.status.allocatable["pods"]) >= 1000  # type: ignore[no-untyped-call]

    assert len(real) >= 1, "no node labelled sandman.io/node-kind=real"
    node = real[0]
    assert _ready(node), node.status.conditions
    assert node.status.node_info.container_runtime_version.startswith("containerd://")
    assert node.status.node_info.kubelet_version.startswith("v1.")
    assert not [t for t in node.spec.taints or [] if t.effect == "NoSchedule"]


def test_task_image_runs_python_on_real_node(core_v1: Any, namespace: str) -> None:
    script = (
        "import http.server, socketserver, sys\n"
        "print('sandman-hello', 6 * 7, sys.version_info[:2], flush=True)\n"
        "socketserver.TCPServer.allow_reuse_address = True\n"
        "http.server.HTTPServer(('0.0.0.0', 8080), http.server.SimpleHTTPRequestHandler)"
        ".serve_forever()\n"
    )
    pod = _pod(
        "py",
        {
            "nodeSelector": REAL_NODE_SELECTOR,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": TASK_BASE_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-c", script],
                    "workingDir": "/etc",
                    "ports": [{"containerPort": 8080}],
                    "readinessProbe": {
                        "httpGet": {"path": "/hostname", "port": 8080},
                        "periodSeconds": 1,
                    },
                    "resources": {"requests": {"cpu": "50m", "memory": "32Mi"}},
                }
            ],
        },
    )
    core_v1.create_namespaced_pod(namespace, pod)
    wait_until(lambda: _pod_ready(core_v1, namespace, "py"), 120, what="pod py Ready")

    live = core_v1.read_namespaced_pod("py", namespace)
    node = core_v1.read_node(live.spec.node_name)
    assert node.metadata.labels.get("sandman.io/node-kind") == "real"
    logs = core_v1.read_namespaced_pod_log("py", namespace, container="main")
    assert "sandman-hello 42 (3, 11)" in logs, logs

    # Sandboxes are addressed by pod IP: the host reaches it directly over the bridge.
    pod_ip = live.status.pod_ip
    node_ip = next(a.address for a in node.status.addresses if a.type == "InternalIP")
    assert pod_ip and pod_ip.rsplit(".", 1)[0] == node_ip.rsplit(".", 1)[0], (pod_ip, node_ip)
    with urllib.request.urlopen(f"http://{pod_ip}:8080/hostname", timeout=10) as resp:
        assert resp.status == 200
        assert resp.read().decode().strip() == "py"  # kubelet-managed /etc/hostname


def test_swe_task_image_reference_patch_fixes_failing_test(core_v1: Any, namespace: str) -> None:
    spec = json.loads((SWE_TASK_DIR / "task.json").read_text())
    patch = (SWE_TASK_DIR / spec["reference_patch"]).read_text()
    core_v1.create_namespaced_config_map(
        namespace, {"metadata": {"name": "patch"}, "data": {"fix.patch": patch}}
    )
    script = f"""
set -u
cd {spec["repo_path"]}
echo "HEAD=$(git rev-parse HEAD)"
{spec["test_command"]} >/tmp/before.txt 2>&1; echo "BEFORE_RC=$?"
git apply /patch/fix.patch && echo APPLIED
{spec["test_command"]} >/tmp/after.txt 2>&1; echo "AFTER_RC=$?"
cat /tmp/before.txt /tmp/after.txt
"""
    pod = _pod(
        "swe",
        {
            "nodeSelector": REAL_NODE_SELECTOR,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": spec["image"],
                    "imagePullPolicy": "Never",
                    "command": ["bash", "-c", script],
                    "volumeMounts": [{"name": "patch", "mountPath": "/patch"}],
                }
            ],
            "volumes": [{"name": "patch", "configMap": {"name": "patch"}}],
        },
    )
    assert spec["image"] == SWE_TASK_IMAGE
    core_v1.create_namespaced_pod(namespace, pod)
    phase = wait_until(
        lambda: (
            _phase(core_v1, namespace, "swe") in ("Succeeded", "Failed")
            and _phase(core_v1, namespace, "swe")
        ),
        120,
        what="swe pod to finish",
    )
    logs = core_v1.read_namespaced_pod_log("swe", namespace)
    assert phase == "Succeeded", logs
    assert f"HEAD={spec['base_commit']}" in logs, logs
    assert "BEFORE_RC=1" in logs and "APPLIED" in logs and "AFTER_RC=0" in logs, logs
    for test_id in spec["FAIL_TO_PASS"]:
        method, cls = test_id.split(".")[-1], test_id.split(".")[-2]
        assert f"{method} (tests.test_stats.{cls}" in logs, (test_id, logs)


def test_deleting_owner_cascades_to_dependent_pod(core_v1: Any, namespace: str) -> None:
    owner = core_v1.create_namespaced_config_map(
        namespace, {"metadata": {"name": "owner"}, "data": {"k": "v"}}
    )
    pod = _pod(
        "dependent",
        {
            "nodeSelector": KWOK_NODE_SELECTOR,
            "tolerations": [KWOK_TOLERATION],
            "containers": [{"name": "main", "image": TASK_BASE_IMAGE}],
        },
    )
    pod["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": "owner",
            "uid": owner.metadata.uid,
        }
    ]
    core_v1.create_namespaced_pod(namespace, pod)
    wait_until(lambda: _phase(core_v1, namespace, "dependent") == "Running", 60, what="Running")

    core_v1.delete_namespaced_config_map("owner", namespace, propagation_policy="Background")

    def pod_gone() -> bool:
        return not core_v1.list_namespaced_pod(
            namespace, field_selector="metadata.name=dependent"
        ).items

    wait_until(pod_gone, 90, what="garbage collector to delete the dependent pod")


def test_topology_spread_over_kwok_nodes(core_v1: Any, namespace: str) -> None:
    kwok_nodes = core_v1.list_node(label_selector="type=kwok").items
    count = 2 * len(kwok_nodes)
    labels = {"app": "spread"}
    for i in range(count):
        pod = _pod(
            f"spread-{i}",
            {
                "nodeSelector": KWOK_NODE_SELECTOR,
                "tolerations": [KWOK_TOLERATION],
                "topologySpreadConstraints": [
                    {
                        "maxSkew": 1,
                        "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "DoNotSchedule",
                        "labelSelector": {"matchLabels": labels},
                    }
                ],
                "containers": [{"name": "main", "image": TASK_BASE_IMAGE}],
            },
            labels=labels,
        )
        core_v1.create_namespaced_pod(namespace, pod)

    def all_running() -> list[Any] | None:
        pods = core_v1.list_namespaced_pod(namespace, label_selector="app=spread").items
        if len(pods) == count and all(p.status.phase == "Running" for p in pods):
            return list(pods)
        return None

    pods = wait_until(all_running, 120, what=f"{count} spread pods Running")
    per_node = Counter(p.spec.node_name for p in pods)
    assert set(per_node) == {n.metadata.name for n in kwok_nodes}, per_node
    assert max(per_node.values()) - min(per_node.values()) <= 1, per_node
    assert all(p.status.pod_ip for p in pods)
