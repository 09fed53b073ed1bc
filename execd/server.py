"""A small HTTP/1.1 server: keep-alive, TCP_NODELAY, JSON errors, bounded reads.

Why not ``http.server``: its error pages are HTML, it reads bodies the
caller never limited, and it answers malformed requests its own way. Here
every refusal is a JSON error with a fitting status, the body limit is checked
from Content-Length before a byte of the body is read, and each response goes
out in one ``sendall`` (with TCP_NODELAY, keep-alive calls never stall on
delayed ACKs). One daemon thread per connection.

Who may hold the daemon: a connection that has not shown the token is pending
in the ``Gate`` (a short TOTAL deadline for its first request head, a small
cap, the oldest cut first when it is full) and gets exactly one request
answered (``/healthz`` or a 401) before it is closed. Only a connection whose
head carries the token takes one of the server's slots and may stay open
(keep-alive, idle timeout). So strangers can neither fill the slots nor
slow-loris a head, and the trainer is always read.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time

from . import errors, logs
from .gate import Gate

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Iterable, Optional, Tuple

log = logs.getLogger("execd.http")

MAX_LINE = 65536
MAX_HEADERS = 100
REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    411: "Length Required",
    413: "Payload Too Large",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class Request:
    __slots__ = ("body", "headers", "keep_alive", "method", "path", "stream")

    def __init__(self, method: str, path: str, headers: Dict[str, str], keep_alive: bool) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.keep_alive = keep_alive
        self.body: Optional[bytes] = b""  # None: not read (yet)
        self.stream: Any = None  # the connection's reader, for routes that stream a body


class Response:
    """A JSON body, or chunks of an already-encoded body of known length, or (``length``
    None) a stream of NDJSON lines of unknown length, sent chunked as they come."""

    __slots__ = ("chunks", "length", "status")

    def __init__(
        self,
        status: int,
        body: Any = None,
        chunks: Optional[Iterable[bytes]] = None,
        length: Optional[int] = 0,
    ) -> None:
        self.status = status
        if chunks is None:
            data = json.dumps(body, separators=(",", ":")).encode()
            chunks, length = (data,), len(data)
        self.chunks = chunks
        self.length = length


if TYPE_CHECKING:
    # How the app reads a request's body once it has accepted the route: (request, limit).
    BodyReader = Callable[[Request, int], bytes]
    Application = Callable[[Request, BodyReader], Response]
    # Whether a request's head carries the token (decided from the headers alone).
    Authorizer = Callable[[Request], bool]


def error_response(exc: errors.ExecdError) -> Response:
    return Response(exc.status, {"error": {"code": exc.code, "message": exc.message}})


class Close(Exception):
    """The connection cannot go on (unparseable framing, timeout, peer gone)."""


class Handler(socketserver.StreamRequestHandler):
    server: "Server"
    wbufsize = 0
    authed = False  # holds one of the server's slots (its first head carried the token)

    def setup(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.request.settimeout(self.server.idle_timeout)
        super().setup()

    def handle(self) -> None:
        try:
            while self._one():
                pass
        except (Close, OSError):
            pass
        finally:
            self.server.gate.leave(self.request)
            if self.authed:
                self.server.slots.release()

    def _one(self) -> bool:
        try:
            req = self._read_head()
        except errors.ExecdError as exc:
            self._send(error_response(exc), keep_alive=False)
            return False
        if req is None:
            return False
        if not self.server.authorized(req):
            req.keep_alive = False  # one answer (healthz or 401), then the door closes
        elif not self.authed:
            if not self.server.gate.admit(self.request):
                return False  # cut at its deadline while the head was being parsed
            if not self.server.slots.acquire(blocking=False):
                self._send(error_response(errors.Unavailable("every slot is taken")), False)
                return False
            self.authed = True
        started = time.monotonic()
        try:
            resp = self.server.app(req, self._read_body)
        except errors.ExecdError as exc:
            resp = error_response(exc)
        except Close:
            raise
        except Exception:
            log.exception("internal error on %s %s", req.method, req.path)
            resp = error_response(errors.ExecdError("internal error"))
        if req.body is None:  # refused before reading the body: skip it or close
            req.keep_alive = req.keep_alive and self._skip_body(req)
        self._send(resp, req.keep_alive)
        log.info(
            "%s %s %d %.1fms",
            req.method[:16],
            req.path[:200],
            resp.status,
            (time.monotonic() - started) * 1000,
        )
        return req.keep_alive

    def _readline(self) -> bytes:
        line = self.rfile.readline(MAX_LINE + 1)
        if len(line) > MAX_LINE:
            raise errors.HeadersTooLarge("request line or header too long")
        return line

    def _read_head(self) -> Optional[Request]:
        self.request.settimeout(self.server.idle_timeout)  # waiting between requests
        line = self._readline()
        while line in (b"\r\n", b"\n"):  # tolerate stray CRLF between requests
            line = self._readline()
        if not line:
            return None
        self.request.settimeout(self.server.request_timeout)
        parts = line.split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            raise errors.BadRequest("malformed request line")
        headers: Dict[str, str] = {}
        for _ in range(MAX_HEADERS + 1):
            line = self._readline()
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise Close()
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep or not name or name != name.strip():
                raise errors.BadRequest("malformed header line")
            name = name.lower()
            value = value.strip()
            if name == "content-length" and headers.get(name, value) != value:
                raise errors.BadRequest("conflicting Content-Length headers")
            headers[name] = value
        else:
            raise errors.HeadersTooLarge("too many headers")
        version = parts[2].decode("latin-1")
        conn = headers.get("connection", "").lower()
        keep = "close" not in conn if version != "HTTP/1.0" else "keep-alive" in conn
        target = parts[1].decode("latin-1")
        req = Request(parts[0].decode("latin-1"), target.split("?", 1)[0], headers, keep)
        req.body = None  # unread until _read_body
        req.stream = self.rfile
        return req

    def _read_body(self, req: Request, limit: int) -> bytes:
        """Read the body after the route and auth were accepted."""
        if "transfer-encoding" in req.headers:
            raise errors.LengthRequired("chunked bodies are not accepted: send Content-Length")
        raw = req.headers.get("content-length")
        if raw is None:
            if req.method in ("GET", "HEAD", "DELETE"):
                req.body = b""
                return b""
            raise errors.LengthRequired("Content-Length is required")
        if not raw.isdigit() or len(raw) > 18:
            raise errors.BadRequest("invalid Content-Length")
        length = int(raw)
        if length > limit:
            raise errors.PayloadTooLarge(
                "body of %d bytes is over the %d-byte limit" % (length, limit)
            )
        if req.headers.get("expect", "").lower() == "100-continue":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = self.rfile.read(length)
        if len(body) != length:
            raise Close()
        req.body = body
        return body

    def _skip_body(self, req: Request) -> bool:
        raw = req.headers.get("content-length", "0" if req.method == "GET" else "")
        if "transfer-encoding" in req.headers or not raw.isdigit() or int(raw) > MAX_LINE:
            return False
        if req.headers.get("expect", "").lower() == "100-continue":
            return False  # the client waits for our verdict and sends no body
        return len(self.rfile.read(int(raw))) == int(raw)

    def _send(self, resp: Response, keep_alive: bool) -> None:
        if resp.length is None:
            self._send_stream(resp, keep_alive)
            return
        head = (
            "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            "Connection: %s\r\n\r\n"
            % (
                resp.status,
                REASONS.get(resp.status, "Unknown"),
                resp.length,
                "keep-alive" if keep_alive else "close",
            )
        ).encode()
        first = True
        for chunk in resp.chunks:
            if first and len(chunk) < 65536:
                self.wfile.write(head + chunk)
            else:
                if first:
                    self.wfile.write(head)
                self.wfile.write(chunk)
            first = False
        if first:
            self.wfile.write(head)

    def _send_stream(self, resp: Response, keep_alive: bool) -> None:
        """Chunked transfer, one chunk per line as the producer yields it. The producer is
        closed whatever happens, so a client that went away ends what it was streaming."""
        self.wfile.write(
            (
                "HTTP/1.1 %d %s\r\nContent-Type: application/x-ndjson\r\n"
                "Transfer-Encoding: chunked\r\nConnection: %s\r\n\r\n"
                % (
                    resp.status,
                    REASONS.get(resp.status, "Unknown"),
                    "keep-alive" if keep_alive else "close",
                )
            ).encode()
        )
        chunks = iter(resp.chunks)
        try:
            for chunk in chunks:
                if chunk:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()


class Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    block_on_close = False

    def __init__(
        self,
        address: Tuple[str, int],
        app: Application,
        authorized: Authorizer,
        *,
        idle_timeout: float = 300.0,
        request_timeout: float = 60.0,
        max_connections: int = 256,
        head_timeout: float = 10.0,
        max_pending: int = 64,
        listen_fd: Optional[int] = None,
    ) -> None:
        """``listen_fd``: serve on this already bound and listening socket, inherited from
        whoever started execd (the local backend binds it in the host's network namespace
        and runs execd in the sandbox's own, where nothing else could reach it);
        ``address`` is then ignored."""
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.app = app
        self.authorized = authorized
        self.idle_timeout = idle_timeout
        self.request_timeout = request_timeout
        # A stranger never waits longer than a caller with the token would be let idle or stall.
        self.gate = Gate(max_pending, min(head_timeout, idle_timeout, request_timeout))
        self.slots = threading.BoundedSemaphore(max_connections)
        if listen_fd is None:
            super().__init__(address, Handler)
            return
        super().__init__(address, Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = adopt_listener(listen_fd)
        self.address_family = self.socket.family
        self.server_address = self.socket.getsockname()
        self.socket.listen(self.request_queue_size)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.gate.enter(request)  # before the thread exists: the cap holds at once
        super().process_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.exception("connection from %s failed", client_address[0])


def adopt_listener(fd: int) -> socket.socket:
    """The inherited listening socket ``fd``, made close-on-exec: a command started in
    the sandbox must not inherit it (it could accept the trainer's connections, or keep
    the port open after execd is gone)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise SystemExit("execd: --listen-fd %d is not a socket: %s" % (fd, exc)) from None
    if sock.type != socket.SOCK_STREAM:
        sock.detach()
        raise SystemExit("execd: --listen-fd %d is not a stream socket" % fd)
    sock.set_inheritable(False)
    return sock
