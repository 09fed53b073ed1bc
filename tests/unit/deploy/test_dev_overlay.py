"""The dev overlay commits no SANDMAN_SECRET_KEY (issue 20, item 12): the key behind every
execd token comes from a Secret each install generates, which every broker workload reads.

Rendered offline with ``kubectl kustomize`` (no API server involved)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
WORKLOADS = {"sandman-web", "sandman-worker", "sandman-beat", "sandman-migrate"}


def _render(overlay: str) -> list[dict[str, Any]]:
    cached = Path(os.environ.get("SANDMAN_CACHE_DIR", Path.home() / ".cache" / "sandman"))
    binary = shutil.which("kubectl") or str(cached / "k8s-v1.37.2" / "bin" / "kubectl")
    if not Path(binary).is_file():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("kubectl is needed to render deploy/k8s")
        pytest.skip("kubectl is not installed (nor in the local cluster's cache)")
    out = subprocess.run(
        [binary, "kustomize", str(REPO / "deploy" / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def test_the_dev_overlay_commits_no_secret_key_and_every_workload_reads_the_generated_one() -> None:
    docs = _render("dev")
    for doc in docs:
        if doc["kind"] == "Secret":
            values = {**doc.get("stringData", {}), **doc.get("data", {})}
            assert "SANDMAN_SECRET_KEY" not in values, doc["metadata"]["name"]
    readers = set()
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job"):
            container = doc["spec"]["template"]["spec"]["containers"][0]
            refs = [e.get("secretRef", {}).get("name") for e in container.get("envFrom", [])]
            if "sandman-secret-key" in refs:
                readers.add(doc["metadata"]["name"])
    assert readers == WORKLOADS


def test_only_the_broker_namespace_reaches_postgres_redis_and_execd() -> None:
    """#20 items 5 and 12: sandbox pods reach neither the services nor other sandboxes."""
    docs = _render("dev")
    namespaces = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Namespace"}
    labels = {name: ns["metadata"].get("labels", {}) for name, ns in namespaces.items()}
    assert labels["sandman-system"].get("sandman.io/execd-access") == "allowed"
    assert "sandman.io/execd-access" not in labels["sandman-sandboxes"]
    (policy,) = [
        d for d in docs
        if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "sandman-services-ingress"
    ]  # fmt: skip
    assert policy["metadata"]["namespace"] == "sandman-system"
    (selector,) = policy["spec"]["podSelector"]["matchExpressions"]
    services = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        and d["metadata"]["name"] in ("sandman-postgres", "sandman-redis")
    }
    assert set(selector["values"]) == services == {"sandman-postgres", "sandman-redis"}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {}}]  # same namespace only, no namespaceSelector
