"""Test data built one way: a small pod spec, so each test names only what it is about."""

from __future__ import annotations

import dataclasses
from typing import Any

from broker.backends.base import PodSpec
from tests.support.images import TASK_IMAGE

# A small rollout pod; a test overrides the fields its assertion depends on.
SMALL_POD = PodSpec(
    name="sm-test", namespace="ns", installation="inst-test", job="j", sandbox_id="sm-test",
    nonce="n-1", role="rollout", image=TASK_IMAGE, cpu_m=500, memory_b=256 << 20,
    token="t" * 32,
)  # fmt: skip


def pod_spec(name: str, **fields: Any) -> PodSpec:
    """``SMALL_POD`` named ``name`` (its sandbox id too), with ``fields`` replaced."""
    return dataclasses.replace(SMALL_POD, name=name, sandbox_id=name, **fields)


def job(sessions: Any, name: str, **config: Any) -> str:
    """Create or update job ``name`` with ``config`` (committed); returns its name."""
    from broker.ledger import store

    with sessions.begin() as session:
        store.ensure_job(session, name, **config)
    return name
