"""The one execd protocol module: request shapes and the status -> typed error decoder.

The HTTP seam is httpx's MockTransport (no socket); the real daemon is exercised by the
integration tier (tests/integration/client, tests/integration/grading).
"""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import pytest

from broker.errors import (
    ExecAuthError,
    ExecBusy,
    ExecError,
    ExecSessionNotFound,
    ExecUserError,
    InfrastructureError,
    InvalidRequest,
    SandboxLost,
)
from broker.wire import execd

pytestmark = pytest.mark.unit


def test_shapes_carry_optional_fields_only_when_given() -> None:
    assert execd.exec_call("ls", timeout=5).body == {"command": "ls", "timeout": 5}
    capped = execd.exec_call("ls", timeout=5, max_output_bytes=100)
    assert capped.body == {"command": "ls", "timeout": 5, "max_output_bytes": 100}
    assert capped.timeout == 5 + execd.EXEC_SLACK_S  # the HTTP wait outlives the command
    write = execd.write_call("/a", "hi", mode=0o755)
    content = base64.b64encode(b"hi").decode()
    assert write.body == {"path": "/a", "content_b64": content, "mode": 0o755}
    assert "mode" not in (execd.write_call("/a", b"hi").body or {})
    assert execd.edit_call("/a", "x", "y").body == {"path": "/a", "old": "x", "new": "y"}
    assert execd.healthz_call(1.0).method == "GET"


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (401, ExecAuthError),
        (403, ExecAuthError),
        (400, ExecError),
        (404, ExecError),
        (409, ExecError),
        (413, ExecError),
        (500, SandboxLost),
        (503, SandboxLost),
    ],
)
def test_statuses_map_onto_the_error_tree(status: int, error: type[Exception]) -> None:
    body = json.dumps({"error": {"code": "conflict", "message": "no match"}}).encode()
    with pytest.raises(error) as info:
        execd.decode(status, body, execd.edit_call("/a", "x", "y"), "execd")
    if isinstance(info.value, ExecError) and not isinstance(info.value, ExecAuthError):
        assert info.value.status == status and info.value.error_code == "conflict"
    assert isinstance(info.value, InfrastructureError) == (status >= 500)


def test_a_file_system_refusal_is_not_an_auth_error() -> None:
    """execd answers 403 ``permission_denied`` when the sandbox's file system refuses a
    path: the agent's doing (a PermissionError to harnesses), not a wrong token."""
    body = json.dumps({"error": {"code": "permission_denied", "message": "denied"}}).encode()
    with pytest.raises(ExecError) as info:
        execd.decode(403, body, execd.read_call("/a"), "execd")
    assert not isinstance(info.value, ExecAuthError)
    assert (info.value.status, info.value.error_code) == (403, "permission_denied")


def test_non_json_is_a_lost_sandbox() -> None:
    with pytest.raises(SandboxLost):
        execd.decode(200, b"<html>proxy</html>", execd.read_call("/a"), "execd")
    with pytest.raises(SandboxLost):
        execd.decode(200, b"[1]", execd.read_call("/a"), "execd")


def test_exec_result_ignores_fields_a_newer_execd_adds() -> None:
    result = execd.ExecResult.from_reply(
        {"exit_code": 0, "stdout": "x", "stderr": "", "new_field": 1}
    )
    assert result.ok and result.stdout == "x"


def test_both_sends_authenticate_and_decode_alike() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"exit_code": 0, "stdout": "hi\n", "stderr": ""})

    endpoint = execd.Endpoint("10.0.0.1:8080", "tok", who="execd of sb")
    call = execd.exec_call("echo hi", timeout=5)
    with httpx.Client(transport=httpx.MockTransport(handler)) as http:
        sync_reply = endpoint.send(http, call)

    async def run() -> dict[str, object]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as ahttp:
            return await endpoint.send_async(ahttp, call)

    assert asyncio.run(run()) == sync_reply
    assert [r.headers["authorization"] for r in seen] == ["Bearer tok"] * 2
    assert all(str(r.url) == "http://10.0.0.1:8080/v1/exec" for r in seen)


def test_no_answer_is_a_lost_sandbox() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    endpoint = execd.Endpoint("10.0.0.1:8080", "tok")
    with httpx.Client(transport=httpx.MockTransport(handler)) as http:
        with pytest.raises(SandboxLost, match="unreachable"):
            endpoint.send(http, execd.read_call("/a"))
        assert not endpoint.healthy(http, 1.0)


def test_run_shapes() -> None:
    call = execd.run_call(["echo", "hi"], input="x", cwd="/w", env={"A": "1"}, timeout=5)
    assert call.path == "/v1/run" and call.timeout == 5 + execd.EXEC_SLACK_S
    assert call.body == {
        "argv": ["echo", "hi"],
        "stdin_b64": base64.b64encode(b"x").decode(),
        "cwd": "/w",
        "env": {"A": "1"},
        "timeout": 5,
    }
    streamed = execd.run_call("echo hi", user="nobody", binary=True, stream=True)
    assert streamed.path == "/v1/run/stream"
    assert streamed.body == {"cmd": "echo hi", "user": "nobody", "binary": True}
    assert streamed.timeout == execd.RUN_UNBOUNDED  # no timeout: execd's own maximum
    with pytest.raises(InvalidRequest):
        execd.run_call([])
    named = execd.session_exec_call("ls", timeout=5, session="s2")
    assert named.body == {"command": "ls", "timeout": 5, "session": "s2"}
    assert "session" not in (execd.session_exec_call("ls").body or {})
    assert execd.open_session_call("s2").body == {"name": "s2"}


@pytest.mark.parametrize(
    ("status", "code", "error"),
    [
        (429, "busy", ExecBusy),
        (404, "no_session", ExecSessionNotFound),
        (404, "not_found", ExecError),
        (400, "unknown_user", ExecUserError),
        (422, "cannot_switch_user", ExecUserError),
        (400, "reserved_env", ExecError),
    ],
)
def test_run_and_session_refusals_are_typed(status: int, code: str, error: type) -> None:
    body = json.dumps({"error": {"code": code, "message": "m"}}).encode()
    with pytest.raises(ExecError) as info:
        execd.decode(status, body, execd.run_call("true"), "execd")
    assert type(info.value) is error and info.value.error_code == code
    assert info.value.retryable == (error is ExecBusy)


def test_run_result_decodes_binary_only_when_sent() -> None:
    reply = {"exit_code": 0, "stdout": "a", "stderr": "", "stdout_total": 1, "new": 1}
    assert execd.RunResult.from_reply(reply).stdout_bytes is None
    raw = execd.RunResult.from_reply({**reply, "stdout_b64": "/w==", "stderr_b64": ""})
    assert (raw.stdout_bytes, raw.stderr_bytes) == (b"\xff", b"")


def _frame(**doc: object) -> bytes:
    return json.dumps(doc).encode()


def test_stream_decoder_joins_split_characters_and_skips_keepalives() -> None:
    decoder = execd.StreamDecoder(execd.run_call("x", stream=True), "execd")
    e_acute = "é".encode()
    items = [
        decoder.feed(_frame(type="stdout", b64=base64.b64encode(e_acute[:1]).decode())),
        decoder.feed(_frame(type="keepalive")),
        decoder.feed(_frame(type="stdout", b64=base64.b64encode(e_acute[1:]).decode())),
        decoder.feed(_frame(type="result", exit_code=0, stdout="", stderr="")),
    ]
    assert items[0] == execd.RunChunk("stdout", "") and items[1] is None
    assert items[2] == execd.RunChunk("stdout", "é")
    assert isinstance(items[3], execd.RunResult) and items[3].ok
    decoder.end()


def test_stream_errors_and_truncation_are_typed() -> None:
    decoder = execd.StreamDecoder(execd.run_call("x", stream=True), "execd")
    with pytest.raises(SandboxLost):
        decoder.feed(_frame(type="error", status=500, error={"code": "internal"}))
    cut = execd.StreamDecoder(execd.run_call("x", stream=True), "execd")
    cut.feed(_frame(type="keepalive"))
    with pytest.raises(SandboxLost, match="without a result"):
        cut.end()


def test_the_bare_health_check_is_true_only_for_a_200() -> None:
    """The async warm claim's check: a 200 is healthy; another status, a daemon that
    closes without answering and a refused connection are not (as ``healthy``)."""

    async def run() -> list[bool]:
        answers = iter([b"HTTP/1.1 200 OK\r\n\r\n{}", b"HTTP/1.1 503 Busy\r\n\r\n", b""])

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(next(answers))
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        endpoint = execd.Endpoint(f"127.0.0.1:{port}", "t" * 32)
        seen = [await endpoint.healthy_bare(5.0) for _ in range(3)]
        server.close()
        await server.wait_closed()
        seen.append(await endpoint.healthy_bare(5.0))  # nobody listens any more
        return seen

    assert asyncio.run(run()) == [True, False, False, False]
