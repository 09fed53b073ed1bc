"""Client-side logic with no service: strict parsing, error mapping, import hygiene."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from broker.client import AsyncSandboxClient, SandboxClient, core
from broker.errors import (
    AcquireTimeout,
    InfrastructureError,
    InvalidRequest,
    ServiceUnavailable,
    UnknownJob,
)
from broker.settings import Settings
from broker.wire.errors import raise_payload_error

pytestmark = pytest.mark.unit


def _body(**overrides: object) -> dict[str, object]:
    """A request as the client builds it (the defaults of ``core.ACQUIRE_DEFAULTS``)."""
    args = {"image": "python:3.12", "job": "j", "cpu": "500m", "memory": "512Mi", "timeout": 30.0}
    return core.new_request("me", **{**args, **overrides})


# What a trainer process must never load: the client knows only the wire.
SERVER_SIDE = (
    "sqlalchemy",
    "psycopg",
    "flask",
    "werkzeug",
    "kubernetes",
    "alembic",
    "broker.ledger",
    "broker.local",
    "broker.acquire",
    "broker.ownership",
    "broker.backends",
    "broker.pools",
    "workers",
    "web",
)


def test_client_imports_nothing_server_side() -> None:
    code = (
        "import sys\n"
        "import broker.client\n"
        "from broker.client import AsyncSandboxClient, ExecResult, Sandbox, SandboxClient\n"
        f"bad = {SERVER_SIDE!r}\n"
        "hit = lambda m: any(m == b or m.startswith(b + '.') for b in bad)\n"
        "print(sorted(m for m in sys.modules if hit(m)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(("cpu", "millis"), [("500m", 500), (1, 1000), ("2", 2000), (0.25, 250)])
def test_cpu_forms(cpu: object, millis: int) -> None:
    assert _body(cpu=cpu)["cpu_m"] == millis


@pytest.mark.parametrize(("memory", "size"), [("512Mi", 512 << 20), ("2Gi", 2 << 30)])
def test_memory_forms(memory: str, size: int) -> None:
    assert _body(memory=memory)["memory_b"] == size


@pytest.mark.parametrize(
    "overrides",
    [
        {"cpu": "abc"},
        {"cpu": "0"},
        {"cpu": "-1"},
        {"cpu": True},
        {"cpu": "1000"},
        {"memory": "lots"},
        {"memory": "1Pi"},
        {"memory": "100000Gi"},
        {"memory": "1"},
        {"image": "Not An Image"},
        {"job": ""},
        {"timeout": 0},
        {"timeout": -5},
        {"role": "admin"},
    ],
)
def test_nonsense_is_refused_before_anything_is_enqueued(overrides: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest):
        _body(**overrides)


def test_requests_carry_ids_and_deadlines() -> None:
    a, b = _body(), _body()
    assert a["request_id"] != b["request_id"]
    assert a["deadline"] > a["enqueued_at"]  # type: ignore[operator]


def test_worker_errors_come_back_typed() -> None:
    with pytest.raises(UnknownJob):
        raise_payload_error({"error": {"code": "unknown_job", "message": "no job x"}})
    with pytest.raises(AcquireTimeout) as info:
        raise_payload_error({"error": {"code": "acquire_timeout", "message": "late"}})
    assert isinstance(info.value, InfrastructureError)
    with pytest.raises(InfrastructureError):
        raise_payload_error({"error": {"code": "something_new"}})


def test_from_settings_never_starts_services(tmp_path: Path) -> None:
    """No URL and no embedded Redis left by `sandman up`: a clear refusal, no server."""
    settings = Settings(state_dir=tmp_path, redis_url="")
    for make in (SandboxClient.from_settings, _async_from_settings):
        with pytest.raises(ServiceUnavailable, match="sandman up"):
            make(settings)
    assert not (tmp_path / "redis").exists()  # nothing was started or prepared


def test_from_settings_refuses_a_redis_that_does_not_answer(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    secret = tmp_path / "secrets" / "redis.password"
    secret.parent.mkdir()
    secret.write_text("pw\n")
    settings = Settings(state_dir=tmp_path, redis_url="", embedded_redis_port=port)
    for make in (SandboxClient.from_settings, _async_from_settings):
        with pytest.raises(ServiceUnavailable, match="SANDMAN_REDIS_URL") as info:
            make(settings)
        assert "pw" not in str(info.value)  # never the password


def _async_from_settings(settings: Settings) -> None:
    async def run() -> None:
        client = await AsyncSandboxClient.from_settings(settings)
        await client.aclose()

    asyncio.run(run())
