"""Every leak kind the broker writes is a ``LeakKind``, so the admin API's filter (which
refuses any other value with a 400) can select each of them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from broker.names import LeakKind

pytestmark = pytest.mark.unit

BROKER = Path(__file__).resolve().parents[3] / "broker"
# call name -> index of the positional argument that is the leak kind
KIND_ARG = {"record_leak": 1, "_open_leak": 2, "_act": 4}


def _kinds_written() -> set[str]:
    found = set()
    for path in BROKER.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            index = KIND_ARG.get(name)
            if index is None or len(node.args) <= index:
                continue
            arg = node.args[index]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value)
    return found


def test_every_kind_the_broker_records_is_a_leak_kind() -> None:
    written = _kinds_written()
    assert {"unowned_pod", "stuck_create", "late_pod"} <= written  # the scan sees the GC
    assert written <= {k.value for k in LeakKind}
