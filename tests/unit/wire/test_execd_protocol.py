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

from broker.errors import ExecAuthError, ExecError, InfrastructureError, SandboxLost
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
