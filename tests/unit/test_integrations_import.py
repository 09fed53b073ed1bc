"""Importing the package never imports a harness: each is an optional extra."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit
HARNESSES = ("openenv", "swerex", "gradio", "fastapi")


def test_importing_broker_imports_no_harness() -> None:
    code = (
        "import sys\n"
        "import broker, broker.client, broker.errors, broker.integrations\n"
        f"bad = {HARNESSES!r}\n"
        "hit = lambda m: any(m == b or m.startswith(b + '.') for b in bad)\n"
        "print(sorted(m for m in sys.modules if hit(m)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[]"
