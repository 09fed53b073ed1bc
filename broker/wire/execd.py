"""The execd HTTP protocol, spoken once: request shapes, the one reply decoder, ExecResult.

Every caller of a sandbox's daemon (the sync and async trainer clients, the direct
grading sandbox, checked reuse and the readiness poll) goes through this module, so a
status means the same thing everywhere:

    200                      the reply document
    401 / 403                ExecAuthError   (wrong or missing token: ours, not the agent's)
    403 ``permission_denied``  ExecError      (the sandbox's file system refused: the agent's)
    429                      ExecBusy        (its bound of runs or sessions is reached: retry)
    404 ``no_session``       ExecSessionNotFound
    410 ``reclaimed``        SandboxReclaimed (idle past its job's timeout: acquire another)
    4xx ``unknown_user``, ``cannot_switch_user``  ExecUserError
    5xx, non-JSON, no answer SandboxLost     (infrastructure: mask the sample)
    any other 4xx            ExecError       (execd refused the input; ``error_code`` is its code)

Streamed runs (``/v1/run/stream``) answer 200 with NDJSON frames: output chunks,
keepalives (skipped here), then one ``result`` frame, or an ``error`` frame decoded like
a status above; a stream that ends without either is a lost sandbox.

The shapes (``Call``) and the decoder are pure; ``Endpoint.send`` and ``send_async`` are
the only two places that put a ``Call`` on the network, over a caller-owned httpx
client so keep-alive pools are shared. The server side lives in ``execd/api.py``.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import codecs
import functools
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, TypedDict, Unpack

import httpx

from broker.errors import (
    ExecAuthError,
    ExecBusy,
    ExecError,
    ExecSessionNotFound,
    ExecUserError,
    InvalidRequest,
    SandboxLost,
    SandboxReclaimed,
    SandmanError,
)
from broker.wire.validation import json_object

CALL_TIMEOUT_S = 60.0  # file and state calls: bounded by execd's own work, not the agent's
EXEC_SLACK_S = 15.0  # the HTTP wait of an exec outlives the command's own timeout by this
RUN_UNBOUNDED = 7 * 24 * 3600.0 + EXEC_SLACK_S  # a run without a timeout: execd's own maximum
STREAM_READ_S = 60.0  # a stream silent this long (keepalives come every few seconds) is lost


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
class RunResult:
    """One one-shot run's outcome (``Sandbox.run``): like ExecResult, without a session.

    ``exit_code`` is None exactly when ``timed_out`` (the run's whole process tree was
    killed); a signal death is 128+N as in bash. ``stdout_bytes``/``stderr_bytes`` hold
    the raw bytes when the run asked for ``binary``, else None.
    """

    exit_code: int | None
    stdout: str
    stderr: str
    truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0
    stdout_bytes: bytes | None = None
    stderr_bytes: bytes | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_reply(cls, data: dict[str, Any]) -> RunResult:
        """Raw bytes from ``*_b64`` when present; fields a newer execd adds are ignored."""
        known = {f.name for f in fields(cls)} - {"stdout_bytes", "stderr_bytes"}
        doc: dict[str, Any] = {k: v for k, v in data.items() if k in known}
        for stream in STREAMS:
            if isinstance(data.get(f"{stream}_b64"), str):
                doc[f"{stream}_bytes"] = base64.b64decode(data[f"{stream}_b64"])
        return cls(**doc)


@dataclass(frozen=True)
class RunChunk:
    """A piece of a streamed run's output, as it came (``Sandbox.run_stream``).

    ``text`` is decoded incrementally (a UTF-8 sequence split between chunks is never
    mangled); ``data`` holds the raw bytes when the run asked for ``binary``.
    """

    stream: Literal["stdout", "stderr"]
    text: str
    data: bytes | None = None


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


def session_exec_call(
    command: str,
    *,
    timeout: float = 60.0,
    max_output_bytes: int | None = None,
    session: str | None = None,
) -> Call:
    """An exec in the default session (``session`` None) or in a named one."""
    call = exec_call(command, timeout=timeout, max_output_bytes=max_output_bytes)
    if session is None:
        return call
    assert call.body is not None
    return Call(call.method, call.path, {**call.body, "session": session}, call.timeout)


def open_session_call(name: str) -> Call:
    return Call("POST", "/v1/sessions/open", {"name": name}, CALL_TIMEOUT_S)


def close_session_call(name: str) -> Call:
    return Call("POST", "/v1/sessions/close", {"name": name}, CALL_TIMEOUT_S)


class RunOptions(TypedDict, total=False):
    """The keyword arguments of ``run`` and ``run_stream`` (sync and async alike)."""

    input: bytes | str | None  # stdin; None: /dev/null
    cwd: str | None  # relative: to execd's workdir
    env: Mapping[str, str] | None  # added to execd's environment (reserved names refused)
    user: str | None  # a name or numeric uid (needs execd as root with CAP_SETUID)
    timeout: float | None  # None: execd's maximum (7 days)
    max_output_bytes: int | None  # per stream; default 1 MiB
    binary: bool  # also return the raw bytes


def run_call(
    cmd: str | Sequence[str], *, stream: bool = False, **options: Unpack[RunOptions]
) -> Call:
    """A one-shot run: a string is a ``bash -c`` script, a sequence an argv (no shell).

    ``timeout`` None lets the run go on as long as execd allows (7 days) and the HTTP
    wait is then unbounded too; otherwise the wait outlives the run by EXEC_SLACK_S.
    """
    body: dict[str, Any] = {}
    if isinstance(cmd, str):
        body["cmd"] = cmd
    else:
        argv = list(cmd)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise InvalidRequest("run needs a non-empty argv of strings", field="cmd")
        body["argv"] = argv
    stdin = options.get("input")
    if stdin is not None:
        raw = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        body["stdin_b64"] = base64.b64encode(raw).decode()
    env = options.get("env")
    optional = {
        "cwd": options.get("cwd"),
        "env": dict(env) if env is not None else None,
        "user": options.get("user"),
        "timeout": options.get("timeout"),
        "max_output_bytes": options.get("max_output_bytes"),
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if options.get("binary"):
        body["binary"] = True
    path = "/v1/run/stream" if stream else "/v1/run"
    timeout = options.get("timeout")
    wait = RUN_UNBOUNDED if timeout is None else timeout + EXEC_SLACK_S
    return Call("POST", path, body, wait)


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


def reclaim_call(idle_timeout_s: float, held_s: float) -> Call:
    """The broker's idle check (execd/activity.py): reclaimed now, or how long idle."""
    body = {"idle_timeout_s": idle_timeout_s, "held_s": max(held_s, 0.0)}
    return Call("POST", "/v1/reclaim", body, 10.0)


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
    raise refusal(status, data.get("error") or {}, call)


FS_REFUSED = "permission_denied"
RECLAIMED = "reclaimed"
USER_CODES = frozenset({"unknown_user", "cannot_switch_user"})


def refusal(status: int, error: dict[str, Any], call: Call) -> SandmanError:
    """The typed error for one of execd's refusals (module doc)."""
    code = str(error.get("code"))
    message = f"{call.path}: {code}: {error.get('message')}"
    if status == 403 and code == FS_REFUSED:  # EACCES/EPERM/EROFS on the agent's path
        return ExecError(message, status=status, error_code=code)
    if status in (401, 403):
        return ExecAuthError(message, status=status, error_code="auth")
    if status >= 500:
        return SandboxLost(message)
    if status == 410 and code == RECLAIMED:
        return SandboxReclaimed(f"{call.path}: {error.get('message')}")
    if status == 429:
        return ExecBusy(message, status=status, error_code=code)
    if status == 404 and code == "no_session":
        return ExecSessionNotFound(message, status=status, error_code=code)
    if code in USER_CODES:
        return ExecUserError(message, status=status, error_code=code)
    return ExecError(message, status=status, error_code=code)


class StreamDecoder:
    """Turns a streamed run's NDJSON frames into RunChunks and the final RunResult.

    Pure: both transports feed it lines. Text is decoded per stream with an incremental
    UTF-8 decoder (replacement for invalid bytes), so a character split by a chunk
    boundary comes out whole.
    """

    def __init__(self, call: Call, who: str) -> None:
        self.call = call
        self.who = who
        self.done = False
        self._text = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in STREAMS}

    def feed(self, line: bytes) -> RunChunk | RunResult | None:
        if not line.strip():
            return None
        frame = json_object(line, SandboxLost, f"{self.who} streaming {self.call.path}")
        kind = frame.get("type")
        if kind in STREAMS:
            raw = base64.b64decode(frame["b64"])
            binary = bool(self.call.body and self.call.body.get("binary"))
            text = self._text[kind].decode(raw)
            return RunChunk(kind, text, raw if binary else None)
        if kind == "result":
            self.done = True
            return RunResult.from_reply(frame)
        if kind == "error":
            raise refusal(int(frame.get("status") or 500), frame.get("error") or {}, self.call)
        return None  # keepalive, or a frame kind a newer execd added

    def end(self) -> None:
        if not self.done:
            raise SandboxLost(f"{self.who} ended the stream of {self.call.path} without a result")


STREAMS: tuple[Literal["stdout"], Literal["stderr"]] = ("stdout", "stderr")


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

    def _stream_request(self, call: Call) -> dict[str, Any]:
        req = self._request(call)
        req["timeout"] = httpx.Timeout(STREAM_READ_S, connect=CALL_TIMEOUT_S)
        return req

    def stream(self, http: httpx.Client, call: Call) -> Iterator[RunChunk | RunResult]:
        """A streamed run's chunks, then its result (the connection closes with the loop)."""
        decoder = StreamDecoder(call, self.who)
        try:
            with http.stream(**self._stream_request(call)) as resp:
                if resp.status_code != 200:
                    resp.read()
                    decode(resp.status_code, resp.content, call, self.who)
                for line in resp.iter_lines():
                    item = decoder.feed(line.encode())
                    if item is not None:
                        yield item
        except httpx.HTTPError as exc:
            raise transport_failure(exc, call, self.who) from exc
        decoder.end()

    async def stream_async(
        self, http: httpx.AsyncClient, call: Call
    ) -> AsyncIterator[RunChunk | RunResult]:
        decoder = StreamDecoder(call, self.who)
        try:
            async with http.stream(**self._stream_request(call)) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    decode(resp.status_code, resp.content, call, self.who)
                async for line in resp.aiter_lines():
                    item = decoder.feed(line.encode())
                    if item is not None:
                        yield item
        except httpx.HTTPError as exc:
            raise transport_failure(exc, call, self.who) from exc
        decoder.end()

    def healthy(self, http: httpx.Client, timeout: float) -> bool:
        try:
            self.send(http, healthz_call(timeout))
        except SandmanError:
            return False
        return True

    async def healthy_bare(self, timeout: float) -> bool:
        """``/healthz`` on a connection of its own, without httpx: the async warm claim's
        check. A thousand claims in flight share one event loop, and httpx's work per
        request cost the trainer several times the claim itself; this is one connect, one
        write, one read. True only for a 200, like ``healthy``."""
        host, _, port = self.address.rpartition(":")
        request = b"GET /healthz HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n"
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
                try:
                    writer.write(request % host.encode())
                    answer = await reader.read()
                finally:
                    writer.close()
        except (OSError, TimeoutError, ValueError):
            return False
        return answer.split(b" ", 2)[1:2] == [b"200"]


class ExecdCalls:
    """exec/read/write/edit/reset over one endpoint: the leased and the direct sandbox.

    Subclasses provide ``_send`` (e.g. refusing calls on a released lease) and share the
    rest, so a feature added to one sandbox exists in every sync sandbox.
    """

    def _send(self, call: Call) -> dict[str, Any]:
        raise NotImplementedError

    def _stream(self, call: Call) -> Iterator[RunChunk | RunResult]:
        raise NotImplementedError

    def exec(
        self,
        command: str,
        *,
        timeout: float = 60.0,
        max_output_bytes: int | None = None,
        session: str | None = None,
    ) -> ExecResult:
        """Run in the persistent default session, or in the named ``session``."""
        call = session_exec_call(
            command, timeout=timeout, max_output_bytes=max_output_bytes, session=session
        )
        return ExecResult.from_reply(self._send(call))

    def run(self, cmd: str | Sequence[str], **options: Unpack[RunOptions]) -> RunResult:
        """A one-shot process beside the session (``run_call`` says what ``cmd`` means)."""
        return RunResult.from_reply(self._send(run_call(cmd, **options)))

    def run_stream(
        self, cmd: str | Sequence[str], **options: Unpack[RunOptions]
    ) -> Iterator[RunChunk | RunResult]:
        """Like ``run``, yielding RunChunks as output arrives, then the RunResult last."""
        return self._stream(run_call(cmd, stream=True, **options))

    def open_session(self, name: str) -> dict[str, Any]:
        """A named session beside the default one: its own bash, cwd and environment."""
        return self._send(open_session_call(name))

    def close_session(self, name: str) -> dict[str, Any]:
        return self._send(close_session_call(name))

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

    def _stream(self, call: Call) -> AsyncIterator[RunChunk | RunResult]:
        raise NotImplementedError

    async def exec(
        self,
        command: str,
        *,
        timeout: float = 60.0,
        max_output_bytes: int | None = None,
        session: str | None = None,
    ) -> ExecResult:
        call = session_exec_call(
            command, timeout=timeout, max_output_bytes=max_output_bytes, session=session
        )
        return ExecResult.from_reply(await self._send(call))

    async def run(self, cmd: str | Sequence[str], **options: Unpack[RunOptions]) -> RunResult:
        return RunResult.from_reply(await self._send(run_call(cmd, **options)))

    def run_stream(
        self, cmd: str | Sequence[str], **options: Unpack[RunOptions]
    ) -> AsyncIterator[RunChunk | RunResult]:
        """``async for item in sb.run_stream(...)``: RunChunks, then the RunResult."""
        return self._stream(run_call(cmd, stream=True, **options))

    async def open_session(self, name: str) -> dict[str, Any]:
        return await self._send(open_session_call(name))

    async def close_session(self, name: str) -> dict[str, Any]:
        return await self._send(close_session_call(name))

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
