"""Kubernetes failures become typed errors at the HTTP seam, with the real client.

A tiny HTTP server on 127.0.0.1 answers every request with one chosen status and a
Kubernetes ``Status`` body (or drops the connection, or is not there at all); the real
kubernetes client, loaded from a kubeconfig that points at it, makes the calls through
``broker.backends.kube.api``. Checked for each failure: the error class (what callers
branch on), and its retry class: reads are replayed when the outcome is unknown or
throttled (5xx, transport, 429), never on a definite answer (404, 409, 4xx), and writes
are never replayed, so a POST cannot be repeated underneath the ownership protocol.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from broker import errors
from broker.backends.kube.api import READ_ATTEMPTS, Kube, load_api_client

pytestmark = pytest.mark.unit

REASONS = {
    400: "BadRequest",
    403: "Forbidden",
    404: "NotFound",
    409: "AlreadyExists",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
}
DROP = 0  # "status" meaning: close the connection without an answer


@dataclass
class Answer:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)


def _status_body(code: int) -> bytes:
    return json.dumps(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f"the test server says {code}",
            "reason": REASONS.get(code, "Unknown"),
            "details": {"name": "p", "kind": "pods"},
            "code": code,
        }
    ).encode()


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def _answer(self) -> None:
        answer = self.server.answer
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        answer.requests.append(self.command)
        if answer.status == DROP:
            self.close_connection = True
            return
        body = _status_body(answer.status)
        self.send_response(answer.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in answer.headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    answer = Answer()


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        json.dumps(
            {  # JSON is YAML: the loader reads it as a kubeconfig
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "seam",
                "clusters": [{"name": "seam", "cluster": {"server": server}}],
                "users": [{"name": "seam", "user": {"token": "test-token"}}],
                "contexts": [{"name": "seam", "context": {"cluster": "seam", "user": "seam"}}],
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def running_server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join()


@pytest.fixture
def server(running_server: _Server) -> _Server:
    running_server.answer = Answer()  # each test starts with a clean record
    return running_server


@pytest.fixture(scope="module")
def kube(running_server: _Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    host, port = running_server.server_address[:2]
    config = _kubeconfig(tmp_path_factory.mktemp("kube") / "kubeconfig", f"http://{host}:{port}")
    api = load_api_client(str(config))
    yield Kube(api)
    api.close()


POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}

# status -> (error class, replayed on a read)
CASES = {
    400: (errors.KubeInvalid, False),
    403: (errors.KubeError, False),
    409: (errors.KubeConflict, False),
    422: (errors.KubeInvalid, False),
    429: (errors.KubeThrottled, True),
    500: (errors.KubeUnavailable, True),
    503: (errors.KubeUnavailable, True),
    DROP: (errors.KubeUnavailable, True),
}


@pytest.mark.parametrize("status", sorted(CASES), ids=lambda s: str(s or "dropped"))
def test_a_read_maps_the_status_and_is_replayed_only_when_the_outcome_is_unknown(
    kube: Kube, server: _Server, status: int
) -> None:
    server.answer.status = status
    error, replayed = CASES[status]
    with pytest.raises(errors.KubeError) as caught:
        kube.get_object("configmap", "ns", "p")
    assert type(caught.value) is error
    assert server.answer.requests == ["GET"] * (READ_ATTEMPTS if replayed else 1)
    if status:
        assert caught.value.status == status
        assert f"HTTP {status}" in str(caught.value)


@pytest.mark.parametrize("status", sorted(CASES), ids=lambda s: str(s or "dropped"))
def test_a_write_maps_the_status_and_is_never_replayed(
    kube: Kube, server: _Server, status: int
) -> None:
    server.answer.status = status
    with pytest.raises(errors.KubeError) as caught:
        kube.create_pod("ns", POD)
    assert type(caught.value) is CASES[status][0]
    assert server.answer.requests == ["POST"]


def test_not_found_on_a_read_is_an_answer_not_an_error(kube: Kube, server: _Server) -> None:
    server.answer.status = 404
    assert kube.get_pod("ns", "p") is None
    assert server.answer.requests == ["GET"]


def test_not_found_on_a_write_is_kube_not_found(kube: Kube, server: _Server) -> None:
    server.answer.status = 404
    with pytest.raises(errors.KubeNotFound, match="create configmap: HTTP 404"):
        kube.create_object("configmap", "missing-ns", {"metadata": {"name": "c"}})


def test_invalid_carries_the_servers_message_and_throttled_its_retry_after(
    kube: Kube, server: _Server
) -> None:
    server.answer.status = 422
    with pytest.raises(errors.KubeInvalid, match="the test server says 422"):
        kube.create_pod("ns", POD)
    server.answer.status = 429
    server.answer.headers = {"Retry-After": "0.05"}
    with pytest.raises(errors.KubeThrottled) as caught:
        kube.create_pod("ns", POD)
    assert caught.value.retry_after == pytest.approx(0.05)


def test_nobody_listening_is_unavailable(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port that was free a moment ago and is closed now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    api = load_api_client(str(_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")))
    try:
        with pytest.raises(errors.KubeUnavailable, match="create pod"):
            Kube(api).create_pod("ns", POD)
    finally:
        api.close()
