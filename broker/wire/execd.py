"""The execd HTTP protocol, spoken once: request shapes, the one reply decoder, ExecResult.

Every caller of a sandbox's daemon (the sync and async trainer clients, the direct
grading sandbox, checked reuse and the readiness poll) goes through this module, so a
status means the same thing everywhere:

    200                      the reply document
    401 / 403                ExecAuthError   (wrong or missing token: ours, not the agent's)
    5xx, non-JSON, no answer SandboxLost     (infrastructure: mask the sample)
    any other 4xx            ExecError       (execd refused the input; ``error_code`` is its code)

The shapes (``Call``) and the decoder are pure; ``Endpoint.send`` and ``send_async`` are
the only two places that put a ``Call`` on the network, over a caller-owned httpx
client so keep-alive pools are shared. The server side lives in ``execd/api.py``.
"""

from __future__ import annotations

import atexit
import base64
import functools
from dataclasses import dataclass, fields
from typing import Any, Literal

import httpx

from broker.errors import ExecAuthError, ExecError, SandboxLost, SandmanError
from broker.wire.validation import json_object

CALL_TIMEOUT_S = 60.0  # file and state calls: bounded by execd's own work, not the agent's
EXEC_SLACK_S = 15.0  # the HTTP wait of an exec outlives the command's own timeout by this


@dataclass(frozen=True)
class ExecResult:
    """One command's outcome. A non-zero exit or a timeout is a result, never an exception."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0
    session_restarted: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_reply(cls, data: dict[str, Any]) -> ExecResult:
        """Ignore fields a newer execd adds, so old clients keep working against it."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class Call:
    """One request to execd, before any I/O: what both transports send."""

    method: Literal["GET", "POST"]
    path: str
    body: dict[str, Any] | None
    timeout: float


def exec_call(command: str, *, timeout: float = 60.0, max_output_bytes: int | None = None) -> Call:
    body: dict[str, Any] = {"command": command, "timeout": timeout}
    if max_output_bytes is not None:
        body["max_output_bytes"] = max_output_bytes
    return Call("POST", "/v1/exec", body, timeout + EXEC_SLACK_S)


def read_call(path: str) -> Call:
    return Call("POST", "/v1/files/read", {"path": path}, CALL_TIMEOUT_S)


def write_call(path: str, content: bytes | str, *, mode: int | None = None) -> Call:
    raw = content.encode() if isinstance(content, str) else content
    body: dict[str, Any] = {"path": path, "content_b64": base64.b64encode(raw).decode()}
    if mode is not None:
        body["mode"] = mode
    return Call("POST", "/v1/files/write", body, CALL_TIMEOUT_S)


def edit_call(path: str, old: str, new: str) -> Call:
    return Call("POST", "/v1/files/edit", {"path": path, "old": old, "new": new}, CALL_TIMEOUT_S)


def control_call(path: str, *, timeout: float = CALL_TIMEOUT_S) -> Call:
    """The body-less POSTs: /v1/reset, /v1/baseline, /v1/state-check, /v1/restore."""
    return Call("POST", path, {}, timeout)


def healthz_call(timeout: float) -> Call:
    return Call("GET", "/healthz", None, timeout)


def file_content(reply: dict[str, Any]) -> bytes:
    """The bytes of a /v1/files/read reply."""
    return base64.b64decode(reply["content_b64"])


def written_size(reply: dict[str, Any]) -> int:
    """The size execd reports for a /v1/files/write."""
    return int(reply["size"])


def decode(status: int, content: bytes, call: Call, who: str) -> dict[str, Any]:
    """The one reply decoder: execd's statuses become the typed error tree (module doc)."""
    data = json_object(content, SandboxLost, f"{who} answering {call.path}")
    if status == 200:
        return data
    error = data.get("error") or {}
    message = f"{call.path}: {error.get('code')}: {error.get('message')}"
    if status in (401, 403):
        raise ExecAuthError(message, status=status, error_code="auth")
    if status >= 500:
        raise SandboxLost(message)
    raise ExecError(message, status=status, error_code=str(error.get("code")))


def transport_failure(exc: httpx.HTTPError, call: Call, who: str) -> SandboxLost:
    """No answer at all: the daemon (or its pod) is gone or wedged, an infrastructure fault."""
    if isinstance(exc, httpx.TimeoutException):
        return SandboxLost(f"{who} did not answer {call.path} in {call.timeout}s")
    return SandboxLost(f"{who} is unreachable on {call.path}: {exc}")


class Endpoint:
    """Where one execd answers and how to authenticate: the two sends live here."""

    def __init__(self, address: str, token: str, *, who: str | None = None) -> None:
        self.address = address
        self.base = f"http://{address}"
        self.headers = {"Authorization": f"Bearer {token}"}
        self.who = who or f"execd at {address}"

    def _request(self, call: Call) -> dict[str, Any]:
        return {
            "method": call.method,
            "url": self.base + call.path,
            "json": call.body,
            "headers": self.headers,
            "timeout": call.timeout,
        }

    def send(self, http: httpx.Client, call: Call) -> dict[str, Any]:
        try:
            resp = http.request(**self._request(call))
        except httpx.HTTPError as exc:
            raise transport_failure(exc, call, self.who) from exc
        return decode(resp.status_code, resp.content, call, self.who)

    async def send_async(self, http: httpx.AsyncClient, call: Call) -> dict[str, Any]:
        try:
            resp = await http.request(**self._request(call))
        except httpx.HTTPError as exc:
            raise transport_failure(exc, call, self.who) from exc
        return decode(resp.status_code, resp.content, call, self.who)

    def healthy(self, http: httpx.Client, timeout: float) -> bool:
        try:
            self.send(http, healthz_call(timeout))
        except SandmanError:
            return False
        return True

    async def healthy_async(self, http: httpx.AsyncClient, timeout: float) -> bool:
        try:
            await self.send_async(http, healthz_call(timeout))
        except SandmanError:
            return False
        return True


class ExecdCalls:
    """exec/read/write/edit/reset over one endpoint: the leased and the direct sandbox.

    Subclasses provide ``_send`` (e.g. refusing calls on a released lease) and share the
    rest, so a feature added to one sandbox exists in every sync sandbox.
    """

    def _send(self, call: Call) -> dict[str, Any]:
        raise NotImplementedError

    def exec(
        self, command: str, *, timeout: float = 60.0, max_output_bytes: int | None = None
    ) -> ExecResult:
        call = exec_call(command, timeout=timeout, max_output_bytes=max_output_bytes)
        return ExecResult.from_reply(self._send(call))

    def read_file(self, path: str) -> bytes:
        return file_content(self._send(read_call(path)))

    def read_text(self, path: str) -> str:
        return self.read_file(path).decode()

    def write_file(self, path: str, content: bytes | str, *, mode: int | None = None) -> int:
        return written_size(self._send(write_call(path, content, mode=mode)))

    def edit(self, path: str, old: str, new: str) -> dict[str, Any]:
        return self._send(edit_call(path, old, new))

    def reset(self) -> dict[str, Any]:
        return self._send(control_call("/v1/reset"))


class AsyncExecdCalls:
    """The same calls, awaited: what ``AsyncSandbox`` offers, with the same arguments."""

    async def _send(self, call: Call) -> dict[str, Any]:
        raise NotImplementedError

    async def exec(
        self, command: str, *, timeout: float = 60.0, max_output_bytes: int | None = None
    ) -> ExecResult:
        call = exec_call(command, timeout=timeout, max_output_bytes=max_output_bytes)
        return ExecResult.from_reply(await self._send(call))

    async def read_file(self, path: str) -> bytes:
        return file_content(await self._send(read_call(path)))

    async def read_text(self, path: str) -> str:
        return (await self.read_file(path)).decode()

    async def write_file(self, path: str, content: bytes | str, *, mode: int | None = None) -> int:
        return written_size(await self._send(write_call(path, content, mode=mode)))

    async def edit(self, path: str, old: str, new: str) -> dict[str, Any]:
        return await self._send(edit_call(path, old, new))

    async def reset(self) -> dict[str, Any]:
        return await self._send(control_call("/v1/reset"))


@functools.cache
def shared_http() -> httpx.Client:
    """One keep-alive pool per server process for the broker's own execd calls.

    Building an httpx client costs milliseconds of CPU (an SSL context), which the
    readiness poll and checked reuse would otherwise pay on every call; httpx clients
    are thread-safe, so the worker's threads share this one. Closed at exit, so no
    keep-alive socket outlives the interpreter unclosed.
    """
    client = httpx.Client(timeout=CALL_TIMEOUT_S)
    atexit.register(client.close)
    return client


def execd_answers(address: str, token: str, *, timeout_s: float = 5.0) -> bool:
    """The authenticated readiness poll: Ready means the pod is Ready AND execd answers us.

    A pod's Ready condition only says the unauthenticated /healthz answered; an exec of
    ``true`` with our token proves the right daemon, with the right token, serves commands.
    """
    call = exec_call("true", timeout=timeout_s)
    call = Call(call.method, call.path, call.body, timeout_s)
    try:
        reply = Endpoint(address, token).send(shared_http(), call)
    except SandmanError:
        return False
    return bool(reply.get("exit_code") == 0)
