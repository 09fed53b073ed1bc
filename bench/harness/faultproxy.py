"""A fault-injecting HTTP proxy in front of the Kubernetes API server.

Clients speak plain HTTP to 127.0.0.1:<port>; the proxy forwards over TLS with the admin
client certificate. Faults are HTTP-level, which is the point: "500 after the server
stored the object" and "connection reset after the request was sent" are the windows in
which a create's outcome is unknown, and only a proxy that sees whole requests and
responses can open them on purpose.

Rule actions:
  error_after      forward, discard the real answer, reply 500   (object stored, caller unsure)
  reset_after      forward, then drop the client connection       (same, at the transport)
  reset_before     drop the connection without forwarding         (nothing stored)
  throttle         reply 429 with Retry-After, without forwarding
  delay            sleep ``seconds`` then forward

``blackout(seconds)`` emulates an API server restart without restarting the real one
(which every other test shares): every open connection (watch streams included) is cut,
and for ``seconds`` every new request is dropped before it is forwarded, so clients see
transport errors exactly as they would while the server is down.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import random
import re
import socket
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml  # type: ignore[import-untyped]

HOP_HEADERS = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "upgrade",
    "proxy-connection",
    "te",
    "trailer",
}


@dataclass
class Rule:
    action: str
    method: str = "POST"
    path: str = r"/api/v1/namespaces/[^/]+/pods$"
    probability: float = 1.0
    times: int | None = 1  # None: unlimited
    seconds: float = 0.0
    retry_after: int = 1
    hits: int = 0

    def matches(self, method: str, path: str, rng: random.Random) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        if self.method not in ("*", method) or not re.search(
            self.path, path.split("?", maxsplit=1)[0]
        ):
            return False
        return rng.random() < self.probability


@dataclass
class Upstream:
    host: str
    port: int
    ssl_context: ssl.SSLContext


@dataclass
class FaultProxy:
    """Threaded proxy; ``add(rule)`` arms a fault, ``counts`` says what was injected."""

    upstream: Upstream
    listen_port: int = 0
    seed: int = 0
    rules: list[Rule] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _blackout_until: float = 0.0
    _open: set[socket.socket] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", self.listen_port), Handler)
        self._server.daemon_threads = True
        # Clients dropping connections is what this proxy is for: no tracebacks on stderr.
        self._server.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
        self.listen_port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def blackout(self, seconds: float) -> None:
        """Cut every open connection and drop new ones for ``seconds`` ("API server down")."""
        with self._lock:
            self._blackout_until = max(self._blackout_until, time.monotonic() + seconds)
            self.counts["blackout"] = self.counts.get("blackout", 0) + 1
            victims = list(self._open)
        for sock in victims:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    @property
    def blacked_out(self) -> bool:
        return time.monotonic() < self._blackout_until

    def pick(self, method: str, path: str) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                if rule.matches(method, path, self._rng):
                    if rule.times is not None:
                        rule.times -= 1
                    rule.hits += 1
                    self.counts[rule.action] = self.counts.get(rule.action, 0) + 1
                    return rule
        return None

    def write_kubeconfig(self, path: Path) -> Path:
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "proxy",
                    "clusters": [{"name": "proxy", "cluster": {"server": self.url}}],
                    "users": [{"name": "proxy", "user": {}}],
                    "contexts": [
                        {"name": "proxy", "context": {"cluster": "proxy", "user": "proxy"}}
                    ],
                }
            )
        )
        return path

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str | Path, **kwargs: Any) -> FaultProxy:
        """Upstream address and admin credentials taken from a kubeconfig with client certs."""
        cfg = yaml.safe_load(Path(kubeconfig).read_text())
        context = next(c["context"] for c in cfg["contexts"] if c["name"] == cfg["current-context"])
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in cfg["users"] if u["name"] == context["user"])
        server = urlsplit(cluster["server"])
        tmp = Path(tempfile.mkdtemp(prefix="faultproxy-"))

        def material(key: str, data_key: str, name: str) -> str:
            if key in cluster or key in user:
                return str(cluster.get(key) or user.get(key))
            target = tmp / name
            target.write_bytes(base64.b64decode(cluster.get(data_key) or user[data_key]))
            target.chmod(0o600)
            return str(target)

        ctx = ssl.create_default_context(
            cafile=material("certificate-authority", "certificate-authority-data", "ca.crt")
        )
        ctx.load_cert_chain(
            material("client-certificate", "client-certificate-data", "c.crt"),
            material("client-key", "client-key-data", "c.key"),
        )
        return cls(Upstream(server.hostname or "127.0.0.1", server.port or 443, ctx), **kwargs)


class _Handler(BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            self.connection.close()
        except OSError:
            pass

    def _proxy(self) -> None:
        if self.owner.blacked_out:
            return self._drop()
        with self.owner._lock:
            self.owner._open.add(self.connection)
        try:
            self._forward()
        finally:
            with self.owner._lock:
                self.owner._open.discard(self.connection)

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        rule = self.owner.pick(self.command, self.path)
        if rule and rule.action == "reset_before":
            return self._drop()
        if rule and rule.action == "throttle":
            return self._reply(
                429,
                b'{"kind":"Status","code":429,"reason":"TooManyRequests"}',
                {"Retry-After": str(rule.retry_after)},
            )
        if rule and rule.action == "delay":
            time.sleep(rule.seconds)
        up = self.owner.upstream
        conn = http.client.HTTPSConnection(up.host, up.port, context=up.ssl_context, timeout=300)
        headers = {
            k: v
            for k, v in self.headers.items()
            if k.lower() not in HOP_HEADERS and k.lower() != "host"
        }
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            if rule and rule.action in ("error_after", "reset_after"):
                resp.read()
                if rule.action == "reset_after":
                    return self._drop()
                return self._reply(
                    500,
                    b'{"kind":"Status","code":500,"reason":"InternalError"'
                    b',"message":"injected after store"}',
                    {},
                )
            self._relay(resp)
        except (OSError, http.client.HTTPException):
            self._drop()
        finally:
            conn.close()

    def _reply(self, status: int, payload: bytes, extra: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for k, v in extra.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(payload)

    def _relay(self, resp: http.client.HTTPResponse) -> None:
        self.send_response(resp.status, resp.reason)
        streaming = resp.getheader("Content-Length") is None
        for k, v in resp.getheaders():
            if k.lower() not in HOP_HEADERS:
                self.send_header(k, v)
        if streaming:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if not streaming:
            self.wfile.write(resp.read())
            return
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _proxy  # noqa: N815
