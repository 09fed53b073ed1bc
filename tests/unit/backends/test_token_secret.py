"""On Kubernetes the execd token is a per-pod Secret: never a value in the pod object."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace
from typing import Any

import pytest

from broker.backends.base import LABEL_NONCE, PodSpec
from broker.backends.kube import podspec
from broker.backends.kube.backend import KubeBackend
from broker.errors import KubeConflict

pytestmark = pytest.mark.unit
TOKEN = "tok-" + "9" * 60


def _spec(nonce: str = "n-1") -> PodSpec:
    return PodSpec(
        name="sm-pod",
        namespace="ns",
        installation="inst",
        job="j",
        sandbox_id="sm-pod",
        nonce=nonce,
        role="rollout",
        image="python:3.12",
        cpu_m=500,
        memory_b=256 << 20,
        token=TOKEN,
    )


def _manifest() -> dict[str, Any]:
    return podspec.pod_manifest(
        _spec(), execd_configmap="cm", execd_keys=["a.py"], port=8080, owner_uid="u-1"
    )


def test_pod_spec_holds_no_token_anywhere() -> None:
    pod = _manifest()
    assert TOKEN not in json.dumps(pod)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert "SANDMAN_EXECD_TOKEN" not in env
    path = env["SANDMAN_EXECD_TOKEN_FILE"]["value"]
    mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert path == f"{mounts['execd-token']['mountPath']}/{podspec.TOKEN_KEY}"
    assert mounts["execd-token"]["readOnly"] is True
    secret_ref = volumes["execd-token"]["secret"]
    assert secret_ref["secretName"] == podspec.token_secret_name("sm-pod")
    assert secret_ref["defaultMode"] == 0o400


def test_token_secret_is_labelled_and_owned_like_the_pod() -> None:
    secret = podspec.token_secret(_spec(), "u-1")
    pod = _manifest()
    assert base64.b64decode(secret["data"][podspec.TOKEN_KEY]).decode() == TOKEN
    assert secret["metadata"]["labels"] == pod["metadata"]["labels"]
    assert secret["metadata"]["ownerReferences"] == pod["metadata"]["ownerReferences"]
    assert secret["metadata"]["name"] == podspec.token_secret_name("sm-pod")


class _Kube:
    """The Kube facade at its seam: pods and secrets in dicts, every call recorded."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.secrets: dict[str, dict[str, Any]] = {}
        self.policies: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []

    def get_object(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        if kind == "configmap":
            return {"metadata": {"name": name, "uid": "u-1"}}
        if kind == "networkpolicy":
            return self.policies.get(name)
        assert kind == "secret"
        return self.secrets.get(name)

    def create_object(self, kind: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        if kind == "networkpolicy":
            self.calls.append("create_policy")
            self.policies[body["metadata"]["name"]] = body
            return body
        assert kind == "secret"
        self.calls.append("create_secret")
        name = body["metadata"]["name"]
        if name in self.secrets:
            raise KubeConflict(f"{name} exists", status=409)
        body["metadata"]["uid"] = "s-" + name
        self.secrets[name] = body
        return body

    def delete_secret(self, namespace: str, name: str, *, uid: str | None) -> None:
        self.calls.append("delete_secret")
        assert uid == self.secrets[name]["metadata"]["uid"]
        del self.secrets[name]

    def create_pod(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append("create_pod")
        body["metadata"]["uid"] = "p-1"
        self.pods[body["metadata"]["name"]] = body
        return body

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.pods.get(name)

    def delete_pod(self, namespace: str, name: str, *, uid: str | None, grace_s: int = 0) -> None:
        self.calls.append("delete_pod")
        del self.pods[name]


@pytest.fixture
def kube(monkeypatch: pytest.MonkeyPatch) -> tuple[KubeBackend, _Kube]:
    fake = _Kube()
    backend = KubeBackend(fake, installation="inst")  # type: ignore[arg-type]
    monkeypatch.setattr(backend, "_ensure_execd", lambda ns: ("cm", ["a.py"]))
    # no pod watch: nothing here waits on one, it only learns which pods to follow
    monkeypatch.setattr(backend, "_watch", lambda ns: SimpleNamespace(expect=lambda name: None))
    return backend, fake


def test_create_makes_the_secret_before_the_pod_and_delete_removes_both(kube) -> None:
    backend, fake = kube
    backend.create(_spec())
    assert fake.calls == ["create_policy", "create_secret", "create_pod"]
    assert TOKEN not in json.dumps(fake.pods)
    fake.pods.clear()
    backend.create(_spec())
    assert list(fake.secrets) == [podspec.token_secret_name("sm-pod")]
    assert backend.delete("ns", "sm-pod", "n-1") is True
    assert fake.secrets == {} and fake.pods == {}


def test_a_secret_of_another_pod_is_neither_reused_nor_deleted(kube) -> None:
    backend, fake = kube
    backend.create(_spec("n-old"))
    fake.pods.clear()
    with pytest.raises(KubeConflict):
        backend.create(_spec("n-new"))
    assert backend.delete("ns", "sm-pod", "n-new") is True  # no pod: only the Secret check
    secret = fake.secrets[podspec.token_secret_name("sm-pod")]
    assert secret["metadata"]["labels"][LABEL_NONCE] == "n-old"


def test_delete_after_a_create_that_died_before_the_pod_removes_the_secret(kube) -> None:
    backend, fake = kube
    fake.create_object("secret", "ns", podspec.token_secret(_spec(), "u-1"))
    assert backend.delete("ns", "sm-pod", "n-1") is True
    assert fake.secrets == {}


def test_the_ingress_guard_exists_before_the_first_pod_and_is_made_once(kube) -> None:
    backend, fake = kube
    backend.create(_spec())
    fake.pods.clear()
    fake.secrets.clear()
    backend.create(_spec(nonce="n-2"))
    assert fake.calls.count("create_policy") == 1
    assert fake.calls.index("create_policy") < fake.calls.index("create_pod")
    policy = fake.policies[podspec.ingress_policy_name("inst")]
    assert policy["spec"]["podSelector"] == {"matchLabels": {"sandman.io/installation": "inst"}}
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8080}]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"sandman.io/execd-access": "allowed"}}}
    ]
