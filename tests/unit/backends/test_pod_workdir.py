"""A pod's working directory: the request's, never ``/`` (a snapshot's default root)."""

from __future__ import annotations

import dataclasses

import pytest

from broker.backends.kube import podspec
from tests.unit.backends.test_token_secret import _spec

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("requested", "workdir"), [("/", "/workspace"), ("//", "/workspace"), ("/repo", "/repo")]
)
def test_the_pod_workdir_is_never_root_and_execd_makes_it(requested: str, workdir: str) -> None:
    """The request's default / becomes /workspace, as on the local backend: a snapshot's
    default root is the workdir, never the whole filesystem."""
    spec = dataclasses.replace(_spec(), workdir=requested)
    pod = podspec.pod_manifest(
        spec, execd_configmap="cm", execd_keys=["a.py"], port=8080, owner_uid="u-1"
    )
    command = pod["spec"]["containers"][0]["command"]
    assert command[command.index("--workdir") + 1] == workdir
    assert "--make-workdir" in command
