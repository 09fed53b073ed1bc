"""The one backend factory and the sandbox namespace, at the Kubernetes HTTP seam.

The real kubernetes client talks to a tiny API server on 127.0.0.1 that keeps a set of
namespaces and answers like the real one (Status bodies, 404 for objects in a missing
namespace, 403 where its "RBAC" refuses). What is checked: workers create a missing
namespace, the read-only UI does not, and a refused permission or a namespace that
vanished is a NamespaceUnavailable naming both, never a bare ``kube_not_found``.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from broker.backends.factory import make_backend
from broker.backends.kube.backend import KubeBackend
from broker.backends.local import LocalBackend
from broker.errors import NamespaceUnavailable
from broker.settings import Settings

pytestmark = pytest.mark.unit
NS = "team-a-sandboxes"


class FakeApiServer(ThreadingHTTPServer):
    """Namespaces, their default ServiceAccount and ConfigMaps; ``forbid`` holds
    (method, resource) pairs answered 403, as RBAC would."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.namespaces: set[str] = set()
        self.configmaps: dict[tuple[str, str], dict[str, Any]] = {}
        self.forbid: set[tuple[str, str]] = set()
        self.requests: list[tuple[str, str]] = []


class _Handler(BaseHTTPRequestHandler):
    server: FakeApiServer

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str) -> None:
        self._reply(
            code,
            {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
             "message": f"{reason} ({self.command} {self.path})", "code": code},
        )  # fmt: skip

    def _route(self) -> None:
        srv, path = self.server, self.path.split("?", 1)[0]
        srv.requests.append((self.command, path))
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if path == "/api/v1/namespaces" and self.command == "POST":
            if ("create", "namespaces") in srv.forbid:
                return self._status(403, "Forbidden")
            srv.namespaces.add(body["metadata"]["name"])
            return self._reply(201, body)
        found = re.fullmatch(r"/api/v1/namespaces/([^/]+)/(\w+)(?:/([^/]+))?", path)
        if not found:
            return self._status(404, "NotFound")
        ns, resource, name = found.groups()
        verb = {"GET": "get", "POST": "create"}[self.command]
        if (verb, resource) in srv.forbid:
            return self._status(403, "Forbidden")
        if ns not in srv.namespaces:
            return self._status(404, "NotFound")
        if resource == "serviceaccounts":
            return self._reply(200, {"kind": "ServiceAccount", "metadata": {"name": name}})
        if resource == "configmaps" and verb == "get":
            cm = srv.configmaps.get((ns, name or ""))
            return self._reply(200, cm) if cm else self._status(404, "NotFound")
        if resource == "configmaps":
            body["metadata"]["uid"] = f"uid-{len(srv.configmaps)}"
            srv.configmaps[(ns, body["metadata"]["name"])] = body
            return self._reply(201, body)
        return self._status(404, "NotFound")

    do_GET = do_POST = _route


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def settings(api: FakeApiServer, tmp_path: Path) -> Settings:
    host, port = api.server_address[:2]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": f"http://{host}:{port}"}}],
                "users": [{"name": "fake", "user": {"token": "t"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )
    )
    return Settings(
        state_dir=tmp_path, backend="kubernetes", kubeconfig=str(kubeconfig), namespace=NS
    )


def test_workers_create_a_missing_namespace(api: FakeApiServer, settings: Settings) -> None:
    backend = make_backend(settings, ensure_namespace=True)
    assert isinstance(backend, KubeBackend)
    assert NS in api.namespaces and ("POST", "/api/v1/namespaces") in api.requests
    backend.ensure_job_owner(NS, "job-1")  # the first create's ConfigMap now lands
    assert any(ns == NS for ns, _ in api.configmaps)


def test_an_existing_namespace_is_only_read(api: FakeApiServer, settings: Settings) -> None:
    api.namespaces.add(NS)
    make_backend(settings, ensure_namespace=True)
    assert [m for m, _ in api.requests] == ["GET"]


def test_the_read_only_ui_does_not_create_it_and_says_so(
    api: FakeApiServer, settings: Settings
) -> None:
    with pytest.raises(NamespaceUnavailable) as caught:
        make_backend(settings, ensure_namespace=False)
    assert caught.value.namespace == NS and NS in str(caught.value)
    assert "workers" in str(caught.value) and caught.value.code == "namespace_unavailable"
    assert NS not in api.namespaces and all(m == "GET" for m, _ in api.requests)


@pytest.mark.parametrize(
    ("refused", "permission"),
    [
        (("create", "namespaces"), "create namespaces"),
        (("get", "serviceaccounts"), "get serviceaccounts"),
    ],
)
def test_rbac_refusing_a_call_names_the_namespace_and_the_permission(
    api: FakeApiServer, settings: Settings, refused: tuple[str, str], permission: str
) -> None:
    api.forbid.add(refused)
    with pytest.raises(NamespaceUnavailable) as caught:
        make_backend(settings, ensure_namespace=True)
    error = caught.value
    assert error.status == 403 and error.namespace == NS and permission in error.missing
    assert NS in str(error) and "Role" in str(error)


def test_a_namespace_deleted_under_a_running_broker_is_named_not_a_bare_404(
    api: FakeApiServer, settings: Settings
) -> None:
    backend = make_backend(settings, ensure_namespace=True)
    api.namespaces.discard(NS)
    with pytest.raises(NamespaceUnavailable) as caught:
        backend.ensure_job_owner(NS, "job-2")
    assert caught.value.namespace == NS and caught.value.code != "kube_not_found"
    assert "create configmap" in str(caught.value)  # the call that failed, kept as detail


def test_the_local_backend_needs_no_namespace(tmp_path: Path) -> None:
    backend = make_backend(Settings(state_dir=tmp_path), ensure_namespace=True)
    assert isinstance(backend, LocalBackend)
