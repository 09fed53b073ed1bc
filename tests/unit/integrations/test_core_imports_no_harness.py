"""The core install stays small: importing the broker (client, grading, the adapters'
shared helpers, the CLI) loads no harness package; only its own adapter module does."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit
HARNESSES = ("inspect_ai", "minisweagent", "swerex", "openenv")
# What harnesses drag in: the core must not either.
HEAVY = ("gradio", "fastapi")


def _loaded_after(imports: str, watched: tuple[str, ...] = HARNESSES) -> set[str]:
    code = f"import sys\n{imports}\nprint(','.join(m for m in {watched!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    last = out.splitlines()[-1] if out else ""  # a harness may print a banner first
    return set(filter(None, last.split(",")))


def test_the_core_loads_no_harness() -> None:
    core = (
        "import broker, broker.client, broker.grading, broker.cli.main, "
        "broker.integrations, broker.integrations.common"
    )
    assert _loaded_after(core, HARNESSES + HEAVY) == set()


@pytest.mark.parametrize(
    ("module", "harness"),
    [
        ("inspectai", "inspect_ai"),
        ("minisweagent", "minisweagent"),
        ("swerex", "swerex"),
        ("openenv", "openenv"),
    ],
)
def test_each_adapter_loads_only_its_own_harness(module: str, harness: str) -> None:
    assert _loaded_after(f"import broker.integrations.{module}") == {harness}
