"""Client-side logic with no service: strict parsing, error mapping, import hygiene."""

from __future__ import annotations

import subprocess
import sys

import pytest

from broker.errors import AcquireTimeout, InfrastructureError, InvalidRequest, UnknownJob
from broker.wire.errors import raise_payload_error
from broker.wire.request import request_body

pytestmark = pytest.mark.unit


def _body(**overrides: object) -> dict[str, object]:
    args: dict[str, object] = dict(
        image="python:3.12",
        cpu="500m",
        memory="512Mi",
        job="j",
        role="rollout",
        image_digest=None,
        base_commit=None,
        workdir="/",
        env=None,
        owner="me",
        timeout=30.0,
    )
    args.update(overrides)
    return request_body(**args)  # type: ignore[arg-type]


def test_client_imports_without_flask_or_kubernetes() -> None:
    code = (
        "import sys\n"
        "for name in ('flask', 'kubernetes', 'werkzeug'):\n"
        "    sys.modules[name] = None\n"
        "import broker.client.sync, broker.client.aio\n"
        "assert 'flask' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


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
