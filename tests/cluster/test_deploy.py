"""Install manifests (deploy/k8s) against a real API server, and a real in-cluster broker.

* every overlay passes a server-side dry run (admission, schema, PodSecurity warnings);
* the broker's ServiceAccount has exactly the rights the Role promises (`kubectl auth can-i`);
* the localcluster overlay, deployed on the local cluster's real node with the broker image
  built from this checkout, serves an acquire, an exec and a release to a client outside
  the cluster (Redis on the host network, execd at the pod IP).

Tests create what they need and delete it; namespaces they did not create are left alone.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import IN_CI, REAL_NODE_SELECTOR, TASK_BASE_IMAGE
from tests.support.wait import wait_until

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("dev", "prod", "localcluster")
SYSTEM_NS = "sandman-system"
SANDBOX_NS = "sandman-sandboxes"
BROKER_SA = f"system:serviceaccount:{SYSTEM_NS}:sandman-broker"
BUILD_SCRIPT = REPO / "deploy" / "broker-image" / "build.sh"
# Fixed in deploy/k8s/overlays/localcluster (host network on the real node).
LC_REDIS_URL = "redis://:local-cluster-only@127.0.0.1:26379/0"
LC_DATABASE_URL = "postgresql+psycopg://sandman:local-cluster-only@127.0.0.1:25432/sandman"
LC_WEB = "http://127.0.0.1:28000"


def _unavailable(message: str) -> None:
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def kubectl(kubeconfig_path: str) -> Any:
    """Run kubectl against the test cluster; returns a CompletedProcess."""
    binary = shutil.which("kubectl")
    cached = Path(os.environ.get("SANDMAN_CACHE_DIR", Path.home() / ".cache" / "sandman"))
    fallback = cached / "k8s-v1.37.2" / "bin" / "kubectl"
    if binary is None and fallback.is_file():
        binary = str(fallback)
    if binary is None:
        _unavailable("kubectl is not installed (and not in the local cluster's cache)")

    def run(
        *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(binary), "--kubeconfig", kubeconfig_path, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            pytest.fail(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    return run


def _rendered(kubectl: Any, overlay: str) -> list[dict[str, Any]]:
    out = kubectl("kustomize", str(K8S / "overlays" / overlay)).stdout
    import yaml

    return [d for d in yaml.safe_load_all(out) if d]


def _namespace_gone(kubectl: Any, name: str) -> bool:
    return kubectl("get", "namespace", name, check=False).returncode != 0


def _wait_namespaces_gone(kubectl: Any, names: list[str], timeout: float = 300) -> None:
    for name in names:
        wait_until(
            lambda n=name: _namespace_gone(kubectl, n), timeout, 1.0, f"namespace {name} deleted"
        )


def _settle_namespaces(kubectl: Any, names: list[str], timeout: float = 120) -> None:
    """Give deleted namespaces a while to go. Everything in them goes with them; a busy
    namespace controller can take minutes to finalize, and the next install waits for
    that (``_wait_namespaces_gone``), so a slow finalization is not a failure here."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(_namespace_gone(kubectl, n) for n in names):
        time.sleep(2)


@pytest.fixture(scope="module")
def install_namespaces(kubectl: Any) -> Iterator[list[str]]:
    """The overlay's namespaces, created for real (with their labels) when missing, and
    deleted at the end of the module if this fixture created them."""
    import yaml

    namespaces = [d for d in _rendered(kubectl, "prod") if d["kind"] == "Namespace"]
    _wait_namespaces_gone(
        kubectl, [n["metadata"]["name"] for n in namespaces if _terminating(kubectl, n)]
    )
    created = [
        n["metadata"]["name"] for n in namespaces if _namespace_gone(kubectl, n["metadata"]["name"])
    ]
    kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(namespaces), timeout=60)
    wait_until(
        lambda: all(
            kubectl("get", "serviceaccount", "default", "-n", n, check=False).returncode == 0
            for n in created
        ),
        60,
        0.5,
        "default ServiceAccounts",
    )
    yield [n["metadata"]["name"] for n in namespaces]
    for name in created:
        kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=false", check=False)
    _settle_namespaces(kubectl, created)


def _terminating(kubectl: Any, ns: dict[str, Any]) -> bool:
    proc = kubectl(
        "get", "namespace", ns["metadata"]["name"], "-o", "jsonpath={.status.phase}", check=False
    )
    return proc.returncode == 0 and proc.stdout.strip() == "Terminating"


# ---------------------------------------------------------------- dry runs


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_passes_server_side_dry_run(
    kubectl: Any, install_namespaces: list[str], overlay: str
) -> None:
    import yaml

    docs = _rendered(kubectl, overlay)
    for doc in docs:
        if doc["kind"] == "Job":
            # A Job's template is immutable: against an existing install (an earlier run,
            # or someone's real one) the dry run would only report that. Same Job, own name.
            doc["metadata"]["name"] += f"-dryrun-{secrets.token_hex(3)}"
    proc = kubectl(
        "apply", "--server-side", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump_all(docs)
    )
    kinds = {line.split("/", 1)[0] for line in proc.stdout.splitlines() if "/" in line}
    for kind in (
        "namespace",
        "serviceaccount",
        "role.rbac.authorization.k8s.io",
        "rolebinding.rbac.authorization.k8s.io",
        "configmap",
        "deployment.apps",
        "job.batch",
        "service",
        "poddisruptionbudget.policy",
    ):
        assert kind in kinds, (kind, proc.stdout)
    if overlay == "prod":
        # prod's Secret is created out of band; dry-run the documented command for it
        secret = kubectl(
            "create",
            "secret",
            "generic",
            "sandman-secrets",
            "-n",
            SYSTEM_NS,
            "--from-env-file",
            str(K8S / "overlays" / "prod" / "secrets.env.example"),
            "--dry-run=client",
            "-o",
            "yaml",
        ).stdout
        kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", stdin=secret)
        assert "secret/sandman-secrets" not in proc.stdout  # never committed
    else:
        assert "secret/sandman-secrets" in proc.stdout
    if overlay != "localcluster":
        # restricted PodSecurity in sandman-system: no warnings for the real installs
        assert "would violate PodSecurity" not in proc.stderr, proc.stderr


def test_rendered_pods_follow_the_paper_and_security_rules(kubectl: Any) -> None:
    for overlay in OVERLAYS:
        for doc in _rendered(kubectl, overlay):
            if doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
                continue
            where = f"{overlay}:{doc['kind']}/{doc['metadata']['name']}"
            pod = doc["spec"]["template"]["spec"]
            assert pod.get("enableServiceLinks") is False, where
            assert pod["securityContext"]["runAsNonRoot"] is True, where
            for c in pod["containers"]:
                if overlay != "prod" and "sandman-broker" in c["image"]:
                    # what deploy/broker-image/build.sh and deploy/kind/up.sh produce
                    assert c["image"] == "localhost/sandman-broker:dev", where
                res = c["resources"]
                assert res["limits"]["memory"] == res["requests"]["memory"], where
                assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
                assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], where
            if doc["kind"] == "Deployment" and doc["metadata"]["name"] in (
                "sandman-web",
                "sandman-worker",
            ):
                assert "livenessProbe" in pod["containers"][0], where
            if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "sandman-beat":
                assert doc["spec"]["replicas"] == 1, where
                assert doc["spec"]["strategy"]["type"] == "Recreate", where


# ---------------------------------------------------------------- RBAC matrix


def _asks(namespace: str, allowed: bool, *asks: str) -> list[tuple[str, str, str, bool]]:
    """(verb, resource, namespace, allowed) rows from "verb resource" strings."""
    pairs = (ask.split(" ", 1) for ask in asks)
    return [(verb, resource, namespace, allowed) for verb, resource in pairs]


# (verb, resource[/name], namespace, allowed); "resource:subresource" for subresources
# (`kubectl auth can-i create pods/exec` would ask about a pod NAMED exec).
RBAC_MATRIX = [
    *_asks(
        SANDBOX_NS,
        True,
        *(f"{verb} pods" for verb in ("create", "delete", "get", "list", "watch")),
        "create configmaps",
        "delete configmaps",
        "create networkpolicies.networking.k8s.io",
        "list events",
        "get serviceaccounts/default",
        # each pod's execd token Secret: made before the pod, deleted with it
        "create secrets",
        "get secrets",
        "delete secrets",
        # pre-pull DaemonSets (broker/pools/prepull.py)
        *(f"{verb} daemonsets.apps" for verb in ("create", "get", "list", "delete")),
    ),
    # nothing beyond that in the sandbox namespace
    *_asks(
        SANDBOX_NS,
        False,
        "patch pods",
        "update pods",
        "create pods:exec",
        "update configmaps",
        "get serviceaccounts/other",
        "create serviceaccounts:token",
        "create pods:eviction",
        "create rolebindings.rbac.authorization.k8s.io",
        "list secrets",
        "watch secrets",
        "update secrets",
        "update daemonsets.apps",
        "patch daemonsets.apps",
        "create deployments.apps",
    ),
    # no other namespace, including its own
    *_asks("default", False, "create pods", "delete pods", "create configmaps"),
    *_asks("kube-system", False, "create pods", "list secrets"),
    *_asks(SYSTEM_NS, False, "create pods", "list pods", "get secrets"),
    # nothing cluster-wide
    *_asks(
        "",
        False,
        "create validatingwebhookconfigurations.admissionregistration.k8s.io",
        "delete mutatingwebhookconfigurations.admissionregistration.k8s.io",
        "patch validatingadmissionpolicies.admissionregistration.k8s.io",
        "create clusterrolebindings.rbac.authorization.k8s.io",
        "delete namespaces",
        "list nodes",
    ),
]


@pytest.fixture
def base_rbac(kubectl: Any, install_namespaces: list[str]) -> Iterator[None]:
    """The ServiceAccount, Role and RoleBinding of base/ (via the prod overlay), for real."""
    import yaml

    docs = [
        d
        for d in _rendered(kubectl, "prod")
        if d["kind"] in ("ServiceAccount", "Role", "RoleBinding")
    ]
    body = yaml.safe_dump_all(docs)
    kubectl("apply", "--server-side", "-f", "-", stdin=body)
    yield
    kubectl("delete", "--ignore-not-found", "-f", "-", stdin=body, check=False)


def test_broker_service_account_rbac_matrix(kubectl: Any, base_rbac: None) -> None:
    wrong = []
    for verb, resource, namespace, allowed in RBAC_MATRIX:
        kind, _, sub = resource.partition(":")
        args = ["auth", "can-i", verb, kind, f"--as={BROKER_SA}"]
        args += [f"--subresource={sub}"] if sub else []
        args += ["-n", namespace] if namespace else ["--all-namespaces"]
        proc = kubectl(*args, check=False)
        answer = proc.stdout.strip()
        if answer not in ("yes", "no"):
            pytest.fail(f"kubectl {' '.join(args)}: {proc.stdout!r} {proc.stderr!r}")
        if (answer == "yes") != allowed:
            wrong.append(f"{verb} {resource} in {namespace or '(cluster)'}: {answer}")
    assert not wrong, "RBAC differs from the promised matrix:\n" + "\n".join(wrong)


# ---------------------------------------------------------------- in-cluster broker


def _build_and_import_image() -> float:
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [str(BUILD_SCRIPT), "--import"],
            capture_output=True,
            text=True,
            timeout=int(os.environ.get("SANDMAN_BROKER_IMAGE_TIMEOUT", "1800")),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        _unavailable(f"the broker image could not be built: {exc}")
        raise
    if proc.returncode != 0:
        _unavailable(
            f"deploy/broker-image/build.sh --import failed (rc={proc.returncode}):\n"
            f"{proc.stderr[-4000:]}"
        )
    return time.monotonic() - t0


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:  # local, fixed URL
            return bool(resp.status == 200)
    except OSError:
        return False


def _exec(kubectl: Any, target: str, *cmd: str, timeout: float = 120) -> str:
    return str(kubectl("exec", "-n", SYSTEM_NS, target, "--", *cmd, timeout=timeout).stdout)


@pytest.fixture
def localcluster_install(kubectl: Any, core_v1: Any) -> Iterator[dict[str, float]]:
    """The localcluster overlay applied for real, then deleted with its namespaces."""
    nodes = core_v1.list_node(label_selector="sandman.io/node-kind=real").items
    if not nodes:
        _unavailable(
            "no node labelled sandman.io/node-kind=real: the localcluster overlay needs the "
            "local cluster (deploy/localcluster), not the cluster in SANDMAN_TEST_KUBECONFIG"
        )
    timings = {"image_s": _build_and_import_image()}
    namespaces = [SYSTEM_NS, SANDBOX_NS]
    _wait_namespaces_gone(
        kubectl,
        [
            n
            for n in namespaces
            if kubectl("get", "ns", n, "-o", "jsonpath={.status.phase}", check=False).stdout
            == "Terminating"
        ],
    )
    overlay = str(K8S / "overlays" / "localcluster")
    t0 = time.monotonic()
    kubectl("apply", "--server-side", "-k", overlay)
    try:
        yield timings
    finally:
        timings["deploy_s"] = timings.get("deploy_s", time.monotonic() - t0)
        kubectl("delete", "-k", overlay, "--ignore-not-found", "--wait=false", check=False)
        _settle_namespaces(kubectl, namespaces)


def test_localcluster_overlay_serves_acquire_exec_release(
    kubectl: Any, core_v1: Any, localcluster_install: dict[str, float]
) -> None:
    t0 = time.monotonic()
    kubectl(
        "wait", "-n", SYSTEM_NS, "--for=condition=complete", "job/sandman-migrate",
        "--timeout=240s", timeout=260,
    )  # fmt: skip
    for name in ("sandman-postgres", "sandman-redis", "sandman-worker", "sandman-web"):
        kubectl(
            "rollout", "status", "-n", SYSTEM_NS, f"deployment/{name}", "--timeout=180s",
            timeout=200,
        )  # fmt: skip
    deployed_s = time.monotonic() - t0

    # The kubelet injects KUBERNETES_SERVICE_HOST=10.96.0.1 (no kube-proxy here); the
    # overlay's value must win, or the in-cluster client cannot reach the API server.
    env = _exec(kubectl, "deploy/sandman-worker", "sh", "-c", "env | sort")
    assert "KUBERNETES_SERVICE_HOST=127.0.0.1\n" in env, env
    assert "KUBERNETES_SERVICE_PORT=16443\n" in env, env
    assert _exec(kubectl, "deploy/sandman-worker", "id", "-u").strip() == "10001"
    assert "database at head" in _exec(kubectl, "deploy/sandman-worker", "sandman", "db", "upgrade")
    wait_until(lambda: _http_ok(LC_WEB + "/healthz"), 60, 1.0, "web /healthz")

    job = f"deploy-e2e-{secrets.token_hex(3)}"
    created = json.loads(_exec(kubectl, "deploy/sandman-worker", "sandman", "job", "create", job))
    assert created["job"] == job
    # The sandbox must land on the real node (the kwok nodes run no containers).
    from broker.ledger import store
    from broker.ledger.db import make_engine, make_session_factory

    engine = make_engine(LC_DATABASE_URL, pool_size=1, max_overflow=0)
    try:
        with make_session_factory(engine).begin() as session:
            store.ensure_job(session, job, node_selector=dict(REAL_NODE_SELECTOR))
    finally:
        engine.dispose()

    from broker.client.sync import SandboxClient

    client = SandboxClient(LC_REDIS_URL, heartbeat_s=None)
    try:
        t1 = time.monotonic()
        with client.acquire(
            image=TASK_BASE_IMAGE, job=job, cpu="100m", memory="256Mi", timeout=180
        ) as sb:
            acquire_s = time.monotonic() - t1
            pod = core_v1.read_namespaced_pod(sb.lease.pod_name, SANDBOX_NS)
            real = core_v1.list_node(label_selector="sandman.io/node-kind=real").items
            assert pod.spec.node_name in {n.metadata.name for n in real}
            r = sb.exec("echo hello from $(hostname) && python3 -c 'print(6*7)'", timeout=60)
            assert r.exit_code == 0, r
            assert "hello from" in r.stdout and "42" in r.stdout, r
            sb.write_file("/tmp/deploy-e2e.txt", b"persisted")
            assert sb.read_file("/tmp/deploy-e2e.txt") == b"persisted"
            pod_name = sb.lease.pod_name
        wait_until(
            lambda: (
                not core_v1.list_namespaced_pod(
                    SANDBOX_NS, field_selector=f"metadata.name={pod_name}"
                ).items
            ),
            120,
            1.0,
            f"pod {pod_name} deleted after release",
        )
    finally:
        client.close()
    localcluster_install["deploy_s"] = deployed_s
    print(
        f"\nbroker image {localcluster_install['image_s']:.1f}s, deploy {deployed_s:.1f}s, "
        f"acquire {acquire_s:.1f}s, total {time.monotonic() - t0:.1f}s"
    )
