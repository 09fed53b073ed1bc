"""The closed error tree: every error says whether retrying can help, codes stay stable."""

from __future__ import annotations

import importlib

import pytest

from broker import errors
from broker.errors import PermanentError, SandmanError, TemporaryError
from broker.wire.errors import raise_payload_error

pytestmark = pytest.mark.unit

# Modules that define errors of their own (drawn in the tree's docstring).
for _module in ("broker.grading.grade", "broker.grading.harbor", "broker.grading.patch",
                "broker.grading.probe", "broker.grading.spec",
                "broker.ownership.leaks"):  # fmt: skip
    importlib.import_module(_module)

GROUPS = {SandmanError, TemporaryError, PermanentError, errors.InfrastructureError,
          errors.KubeError, errors.ExecError}  # fmt: skip


def _tree() -> set[type[SandmanError]]:
    seen: set[type[SandmanError]] = set()
    stack: list[type[SandmanError]] = [SandmanError]
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen.add(cls)
            stack.extend(cls.__subclasses__())
    return seen - {c for c in seen if c.__module__.startswith("tests.")}


def test_every_error_is_temporary_or_permanent_never_both() -> None:
    for cls in _tree() - GROUPS:
        marks = issubclass(cls, TemporaryError) + issubclass(cls, PermanentError)
        assert marks == 1, f"{cls.__qualname__} must be exactly one of Temporary/Permanent"


def test_every_error_is_drawn_in_the_tree() -> None:
    doc = errors.__doc__ or ""
    for cls in _tree() - {TemporaryError, PermanentError}:
        assert cls.__name__ in doc, f"{cls.__name__} is missing from broker.errors' drawing"


@pytest.mark.parametrize(
    ("cls", "code"),
    [
        (errors.InvalidRequest, "invalid_request"),
        (errors.UnknownJob, "unknown_job"),
        (errors.ImageNotFound, "image_not_found"),
        (errors.ImageInvalid, "image_invalid"),
        (errors.ServiceUnavailable, "service_unavailable"),
        (errors.AcquireTimeout, "acquire_timeout"),
        (errors.SandboxLost, "sandbox_lost"),
        (errors.CreateFailed, "create_failed"),
        (errors.KubeUnavailable, "kube_unavailable"),
        (errors.GuardMissing, "guard_missing"),
        (errors.ExecTimeout, "exec_timeout"),
    ],
)
def test_wire_codes_are_stable(cls: type[SandmanError], code: str) -> None:
    assert cls.code == code
    with pytest.raises(cls):
        raise_payload_error({"error": {"code": code, "message": "m"}})


def test_a_foreign_pod_reaches_an_older_client_as_create_failed() -> None:
    assert errors.ForeignPod.code == errors.CreateFailed.code
    with pytest.raises(errors.CreateFailed) as info:
        raise_payload_error({"error": {"code": errors.ForeignPod.code, "message": "not ours"}})
    assert type(info.value) is errors.CreateFailed


def test_retryable_follows_the_split() -> None:
    assert errors.KubeThrottled("slow", retry_after=2.0).retryable
    assert errors.AtCapacity("full", retry_after=None).retryable
    assert not errors.ForeignPod("x", pod_name="sm-1").retryable
    assert not errors.KubeError("bare").retryable  # a bare group counts as permanent
