"""Fixtures for the cluster tier: a real Kubernetes API server.

By default the session brings up the local cluster with ``deploy/localcluster/up.sh``
(idempotent; fast when it is already running). Set ``SANDMAN_TEST_KUBECONFIG`` to use
another cluster instead. Under ``CI=true`` a cluster that cannot be reached FAILS the
run; on a developer machine the cluster tests are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import kwok
from tests.support.wait import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
UP_SCRIPT = REPO_ROOT / "deploy" / "localcluster" / "up.sh"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
UP_TIMEOUT_S = int(os.environ.get("SANDMAN_CLUSTER_UP_TIMEOUT", "5400"))

# Images built by deploy/images/build.sh and imported by up.sh.
TASK_BASE_IMAGE = "localhost/sandman-task-base:v1"
SWE_TASK_IMAGE = "localhost/sandman-swe-task:v1"
REAL_NODE_SELECTOR = {"sandman.io/node-kind": "real"}
KWOK_NODE_SELECTOR = kwok.KWOK_SELECTOR
KWOK_TOLERATION = kwok.KWOK_TOLERATION


POLICY_ENGINE = "kube-network-policies"


def cluster_settings(kubeconfig: str, namespace: str, state_dir: Path, **extra: Any) -> Any:
    """Settings of a broker on the test cluster: its own installation id per test."""
    from broker.settings import Settings

    return Settings(
        state_dir=state_dir,
        backend="kubernetes",
        kubeconfig=kubeconfig,
        namespace=namespace,
        installation_id=f"test-{secrets.token_hex(4)}",
        **extra,
    )


def _unavailable(message: str) -> None:
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def cluster_state_dir() -> Path:
    """Where up.sh keeps the local cluster's state (pid files, lock) for this state dir."""
    base = os.environ.get("SANDMAN_STATE_DIR") or Path.home() / ".local" / "state" / "sandman"
    return Path(base) / "cluster"


def policy_engine_pid() -> int | None:
    """The NetworkPolicy engine's PID from up.sh's pid file, if it still runs that binary."""
    try:
        pid_s, exe = (cluster_state_dir() / "pids" / f"{POLICY_ENGINE}.pid").read_text().split()
        pid = int(pid_s)
        if Path(f"/proc/{pid}/exe").resolve() == Path(exe).resolve():
            return pid
    except (OSError, ValueError):
        pass
    return None


@pytest.fixture(scope="module")
def enforcing_kube(kubeconfig_path: str) -> Iterator[Any]:
    """The broker's Kube facade on a cluster whose NetworkPolicies are enforced."""
    from broker.backends.kube.api import Kube, load_api_client

    if os.environ.get("SANDMAN_TEST_KUBECONFIG"):
        _unavailable("NetworkPolicy enforcement tests need the local cluster's policy engine")
    if policy_engine_pid() is None:
        _unavailable(f"{POLICY_ENGINE} is not running (deploy/localcluster/up.sh starts it)")
    api = load_api_client(kubeconfig_path, qps_pool=4)
    yield Kube(api)
    api.close()  # type: ignore[no-untyped-call]


@pytest.fixture(scope="session")
def kubeconfig_path() -> str:
    """Path of an admin kubeconfig for a running cluster."""
    explicit = os.environ.get("SANDMAN_TEST_KUBECONFIG")
    if explicit:
        if not Path(explicit).is_file():
            _unavailable(f"SANDMAN_TEST_KUBECONFIG={explicit} does not exist")
        return explicit
    # A cold start builds Kubernetes (tens of minutes), far beyond pytest-timeout's per-test
    # budget: pause its ITIMER_REAL alarm (signal method) while up.sh runs, then resume it.
    saved = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        proc = subprocess.run(
            [str(UP_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=UP_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        _unavailable(f"local cluster could not be started: {exc}")
        raise  # unreachable, keeps type checkers happy
    finally:
        if saved[0] > 0:
            signal.setitimer(signal.ITIMER_REAL, *saved)
    if proc.returncode != 0:
        _unavailable(
            f"deploy/localcluster/up.sh failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    path = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if not path or not Path(path).is_file():
        _unavailable(f"up.sh printed no kubeconfig path (stdout={proc.stdout!r})")
    return path


@pytest.fixture(scope="session")
def k8s_api_client(kubeconfig_path: str) -> Iterator[Any]:
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=kubeconfig_path)  # type: ignore[no-untyped-call]
    try:
        client.VersionApi(api).get_code(_request_timeout=10)
    except Exception as exc:
        _unavailable(f"Kubernetes API at {kubeconfig_path} is not answering: {exc}")
    yield api
    api.close()


@pytest.fixture(scope="session")
def core_v1(k8s_api_client: Any) -> Any:
    from kubernetes import client

    return client.CoreV1Api(k8s_api_client)


def default_sa_exists(core_v1: Any, namespace: str) -> bool:
    """The controller-manager has created ``namespace``'s "default" ServiceAccount."""
    from kubernetes.client.exceptions import ApiException

    try:
        core_v1.read_namespaced_service_account("default", namespace)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


@pytest.fixture
def namespace(core_v1: Any, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards."""
    with fresh_namespace(core_v1, request.node.name) as name:
        yield name


@pytest.fixture(scope="session")
def registry_setting(kubeconfig_path: str) -> str:
    """``SANDMAN_REGISTRIES`` for the local cluster's loopback registry (up.sh writes it
    beside the kubeconfig): the broker resolves ``localhost/...`` tags to digests there."""
    path = Path(kubeconfig_path).parent / "registries"
    assert path.is_file(), f"up.sh writes {path}"
    return path.read_text().strip()


def image_tarball(ref: str) -> Path:
    """The docker-archive deploy/images/build.sh made for ``ref`` (to push elsewhere)."""
    from broker.settings import Settings

    index = Settings().cache_dir / "images/index.tsv"
    for line in index.read_text().splitlines():
        name, _, tarball = line.partition("\t")
        if name == ref:
            return Path(tarball)
    raise AssertionError(f"{ref} is not in {index}")


@contextlib.contextmanager
def fresh_namespace(core_v1: Any, base: str) -> Iterator[str]:
    """A namespace named after ``base`` (made unique), deleted afterwards."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    base = re.sub(r"[^a-z0-9]+", "-", base.lower())[:40].strip("-")
    name = f"lc-{base}-{secrets.token_hex(3)}"
    core_v1.create_namespace(
        client.V1Namespace(
            metadata=client.V1ObjectMeta(name=name, labels={"sandman.io/test": "localcluster"})
        )
    )

    # ServiceAccount admission rejects pods until the controller-manager has created
    # the namespace's "default" ServiceAccount (even with automountServiceAccountToken
    # false), so wait for it.
    wait_until(lambda: default_sa_exists(core_v1, name), 60, what=f"serviceaccount {name}/default")
    try:
        yield name
    finally:
        try:
            core_v1.delete_namespace(name, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != 404:
                raise
