"""The typed acquire request: the one door for trainer arguments and queue messages."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from broker.errors import InvalidRequest
from broker.ledger.states import Role
from broker.wire.request import AcquireRequest, request_body

pytestmark = pytest.mark.unit


def _message(**over: Any) -> dict[str, Any]:
    now = time.time()
    base: dict[str, Any] = {"request_id": "r-1", "job": "j", "image": "python:3.12"}
    base.update({"cpu_m": 500, "memory_b": 512 << 20, "enqueued_at": now, "deadline": now + 30})
    base.update(over)
    return {k: v for k, v in base.items() if v is not ...}


def test_wire_round_trip_is_lossless() -> None:
    request = AcquireRequest.new(
        image="python:3.12",
        job="j",
        cpu="250m",
        memory="1Gi",
        role="grading",
        image_digest="sha256:" + "a" * 64,
        base_commit="abc123",
        workdir="/workspace",
        env={"A": "1"},
        owner="host:1",
        timeout=60,
    )
    assert AcquireRequest.parse(request.to_wire()) == request
    assert request.role is Role.GRADING and request.cpu_m == 250
    assert request.deadline is not None and 59 < request.deadline - request.enqueued_at <= 60


def test_request_body_is_the_wire_form_of_new() -> None:
    body = request_body(image="python:3.12", job="j", owner="me", timeout=30.0)
    assert AcquireRequest.parse(body).to_wire() == body


def test_defaults_of_a_minimal_message() -> None:
    request = AcquireRequest.parse({"request_id": "r-2", "job": "j", "image": "python:3.12"})
    assert (request.cpu_m, request.memory_b, request.role) == (1000, 1 << 30, Role.ROLLOUT)
    assert request.workdir == "/" and request.env == {} and request.deadline is None


def test_the_queue_cannot_place_a_create_in_a_pool() -> None:
    assert AcquireRequest.parse(_message(pool_key="p" + "0" * 24)).pool_key is None


def test_the_value_is_frozen() -> None:
    request = AcquireRequest.parse(_message())
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.cpu_m = 64_000  # type: ignore[misc]


BAD_MESSAGES: list[tuple[str, dict[str, Any]]] = [
    ("request_id", _message(request_id=...)),
    ("request_id", _message(request_id="r-1\n")),
    ("request_id", _message(request_id=7)),
    ("job", _message(job=...)),
    ("job", _message(job="")),
    ("job", _message(job=None)),
    ("job", _message(job="x" * 64)),
    ("image", _message(image=...)),
    ("image", _message(image="Bad Image")),
    ("image", _message(image="python:3.12\n")),
    ("cpu_m", _message(cpu_m=5)),
    ("cpu_m", _message(cpu_m=10**12)),
    ("cpu_m", _message(cpu_m="500")),
    ("cpu_m", _message(cpu_m=True)),
    ("cpu_m", _message(cpu_m=500.0)),
    ("memory_b", _message(memory_b=0)),
    ("memory_b", _message(memory_b=[1])),
    ("memory_b", _message(memory_b=10**20)),
    ("role", _message(role="admin")),
    ("role", _message(role=None)),
    ("role", _message(role=["rollout"])),
    ("image_digest", _message(image_digest="sha256:short")),
    ("image_digest", _message(image_digest="sha256:" + "a" * 64 + "\n")),
    ("base_commit", _message(base_commit=5)),
    ("base_commit", _message(base_commit="abc\n")),
    ("workdir", _message(workdir="relative/dir")),
    ("workdir", _message(workdir=3)),
    ("env", _message(env="A=1")),
    ("env", _message(env={"A": 1})),
    ("env", _message(env={"1A": "x"})),
    ("env", _message(env={"A": "x\x00"})),
    ("owner", _message(owner=3)),
    ("enqueued_at", _message(enqueued_at="yesterday")),
    ("enqueued_at", _message(enqueued_at=float("nan"))),
    ("deadline", _message(deadline="soon")),
    ("deadline", _message(deadline=True)),
    ("deadline", _message(deadline=float("inf"))),
]


@pytest.mark.parametrize(("field", "message"), BAD_MESSAGES, ids=lambda x: str(x)[:50])
def test_every_invalid_field_of_a_message_is_named(field: str, message: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as info:
        AcquireRequest.parse(message)
    assert info.value.field == field
    assert not info.value.retryable


@pytest.mark.parametrize("message", [None, [], "request", 3])
def test_a_message_that_is_not_an_object_is_refused(message: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        AcquireRequest.parse(message)
    assert info.value.field == "request"


BAD_ARGUMENTS: list[tuple[str, dict[str, Any]]] = [
    ("cpu", {"cpu": "abc"}),
    ("cpu", {"cpu": "0"}),
    ("cpu", {"cpu": True}),
    ("memory", {"memory": "lots"}),
    ("memory", {"memory": "1Pi"}),
    ("image", {"image": "Not An Image"}),
    ("job", {"job": ""}),
    ("timeout", {"timeout": 0}),
    ("timeout", {"timeout": 10**9}),
    ("timeout", {"timeout": "30"}),
    ("role", {"role": "root"}),
    ("workdir", {"workdir": "tmp"}),
    ("env", {"env": {"A B": "1"}}),
]


@pytest.mark.parametrize(("field", "over"), BAD_ARGUMENTS, ids=lambda x: str(x)[:40])
def test_every_invalid_trainer_argument_is_named(field: str, over: dict[str, Any]) -> None:
    args: dict[str, Any] = {"image": "python:3.12", "job": "j", **over}
    with pytest.raises(InvalidRequest) as info:
        AcquireRequest.new(**args)
    assert info.value.field == field


def test_direct_construction_is_checked_too() -> None:
    """There is no third, unchecked way in: the constructor holds the checks."""
    with pytest.raises(InvalidRequest) as info:
        AcquireRequest(job="j", image="python:3.12", cpu_m=0)
    assert info.value.field == "cpu_m"


# Every bad argument a trainer can pass, with the field the error must name. Each of these
# used to escape as a raw ValueError/TypeError/OverflowError, or be accepted (issue 20
# item 10): only a typed InvalidRequest naming the field tells the trainer what to fix.
BAD_ARGUMENTS: list[tuple[dict[str, Any], str]] = [
    ({"cpu": float("nan")}, "cpu"),
    ({"cpu": float("inf")}, "cpu"),
    ({"cpu": float("-inf")}, "cpu"),
    ({"cpu": 1e308}, "cpu"),
    ({"cpu": "1" * 400}, "cpu"),
    ({"cpu": ["1"]}, "cpu"),
    ({"memory": "9" * 5000}, "memory"),
    ({"memory": {"x": 1}}, "memory"),
    ({"timeout": "5"}, "timeout"),
    ({"timeout": None}, "timeout"),
    ({"timeout": float("nan")}, "timeout"),
    ({"timeout": float("inf")}, "timeout"),
    ({"image_digest": 1}, "image_digest"),
    ({"base_commit": 1}, "base_commit"),
    ({"base_commit": "a" * 65}, "base_commit"),
    ({"base_commit": "abc\x00"}, "base_commit"),
    ({"env": "abc"}, "env"),
    ({"env": [("A", "1")]}, "env"),
    ({"env": {"A": 1}}, "env"),
    ({"env": {"A": "x\x00"}}, "env"),
    ({"env": {"A": "x" * (64 * 1024)}}, "env"),
    ({"env": {f"V{i}": "x" for i in range(500)}}, "env"),
    ({"env": {f"V{i}": "x" * 30_000 for i in range(10)}}, "env"),
    ({"env": {"SANDMAN_EXECD_TOKEN": "mine"}}, "env"),
    ({"env": {"SANDMAN_ANYTHING": "1"}}, "env"),
    ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "env"),
    ({"env": {"LD_LIBRARY_PATH": "/tmp"}}, "env"),
    ({"env": {"PYTHONPATH": "/tmp"}}, "env"),
    ({"env": {"PYTHONHOME": "/tmp"}}, "env"),
    ({"env": {"BASH_ENV": "/tmp/rc"}}, "env"),
    ({"env": {"ENV": "/tmp/rc"}}, "env"),
    ({"workdir": "/repo\x00"}, "workdir"),
    ({"workdir": "/repo\n"}, "workdir"),
    ({"workdir": "/" + "a" * 5000}, "workdir"),
    ({"workdir": 1}, "workdir"),
    ({"job": 1}, "job"),
    ({"image": 1}, "image"),
    ({"role": None}, "role"),
]


@pytest.mark.parametrize("bad,field", BAD_ARGUMENTS, ids=lambda x: repr(x)[:40])
def test_every_bad_client_argument_is_a_typed_error_naming_its_field(
    bad: dict[str, Any], field: str
) -> None:
    """Through the client's own argument handling (what ``SandboxClient.open`` calls
    before anything is sent), so the client's conversions are covered too."""
    from broker.client import core

    args: dict[str, Any] = {"image": "python:3.12", "job": "j", **bad}
    with pytest.raises(InvalidRequest) as info:
        core.new_request("owner", **args)
    assert info.value.field == field


@pytest.mark.parametrize("bad,field", BAD_ARGUMENTS, ids=lambda x: repr(x)[:40])
def test_every_bad_argument_is_refused_by_the_constructor_too(
    bad: dict[str, Any], field: str
) -> None:
    args: dict[str, Any] = {"image": "python:3.12", "job": "j", **bad}
    with pytest.raises(InvalidRequest) as info:
        AcquireRequest.new(**args)
    assert info.value.field == field


def test_ordinary_env_names_and_a_64_char_commit_are_still_accepted() -> None:
    request = AcquireRequest.new(
        image="python:3.12",
        job="j",
        base_commit="a" * 64,
        env={"PYTHONHASHSEED": "0", "TZ": "UTC", "LANG": "C.UTF-8", "MY_SANDMAN": "1"},
    )
    assert request.base_commit == "a" * 64 and request.env["MY_SANDMAN"] == "1"


def test_visible_cpus_travel_to_execd_and_skip_warm_pools() -> None:
    """A request's visible_cpus crosses the queue and becomes the execd variable that
    pins every command (SANDMAN_* cannot come from the request's env itself)."""
    from broker.client import core
    from broker.names import ENV_VISIBLE_CPUS

    request = AcquireRequest.new(image="python:3.12", job="j", env={"A": "1"}, visible_cpus=2)
    assert AcquireRequest.parse(request.to_wire()) == request
    assert request.sandbox_env() == {"A": "1", ENV_VISIBLE_CPUS: "2"}
    plain = AcquireRequest.new(image="python:3.12", job="j", env={"A": "1"})
    assert plain.sandbox_env() == {"A": "1"} and plain.visible_cpus is None
    for bad in (0, -1, 1025, 1.5, "2", True):
        with pytest.raises(InvalidRequest) as info:
            AcquireRequest.parse(_message(visible_cpus=bad))
        assert info.value.field == "visible_cpus"
    with pytest.raises(InvalidRequest):
        AcquireRequest.new(image="python:3.12", job="j", env={ENV_VISIBLE_CPUS: "1"})
    # Warm pods started without the pinning: such a request always creates.
    assert not core.warm_eligible(core.new_request("me", image="i", job="j", visible_cpus=1))
    assert core.warm_eligible(core.new_request("me", image="i", job="j"))
    # ... and so do requests with env or another workdir: a warm pod has neither.
    assert not core.warm_eligible(core.new_request("me", image="i", job="j", env={"TZ": "UTC"}))
    assert not core.warm_eligible(core.new_request("me", image="i", job="j", workdir="/repo"))
    assert core.warm_eligible(core.new_request("me", image="i", job="j", env={}, workdir="/"))


def test_a_sandbox_egress_crosses_the_queue_and_skips_warm_pools() -> None:
    from broker.client import core

    for egress in ("deny", "allow", None):
        request = AcquireRequest.new(image="python:3.12", job="j", egress=egress)
        assert AcquireRequest.parse(request.to_wire()) == request
        assert request.egress == egress
    for bad in ("denied", "", "DENY", 1, True):
        with pytest.raises(InvalidRequest) as info:
            AcquireRequest.parse(_message(egress=bad))
        assert info.value.field == "egress"
    assert not core.warm_eligible(core.new_request("me", image="i", job="j", egress="deny"))
    assert not core.warm_eligible(core.new_request("me", image="i", job="j", egress="allow"))


@pytest.mark.parametrize(
    ("job_egress", "requested", "denied"),
    [
        ("allow", None, False),
        ("allow", "allow", False),
        ("allow", "deny", True),  # narrowed: guarded like a denying job's pods
        ("deny", None, True),
        ("deny", "deny", True),
        ("allowlist", None, True),
        ("deny", "allow", None),  # widening: refused
        ("allowlist", "allow", None),
    ],
)
def test_a_request_narrows_its_jobs_egress_never_widens_it(
    job_egress: str, requested: str | None, denied: bool | None
) -> None:
    from broker.errors import EgressNotPermitted
    from broker.ledger.models import Job
    from broker.ownership.provider import sandbox_egress_denied

    job = Job(name="j", egress=job_egress)
    if denied is None:
        with pytest.raises(EgressNotPermitted, match="never widen"):
            sandbox_egress_denied(job, requested)
    else:
        assert sandbox_egress_denied(job, requested) is denied
