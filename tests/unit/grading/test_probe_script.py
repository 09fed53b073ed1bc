"""The in-pod probe script itself, run here with the oldest Python a task image may ship."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from broker.grading.probe import decide, probe_source
from broker.grading.spec import Conditions

pytestmark = pytest.mark.unit

PY38 = Path.home() / ".pyenv" / "versions" / "3.8.18" / "bin" / "python3.8"


def run_probe_script(tmp_path: Path, env: dict[str, str]) -> dict[str, object]:
    script = tmp_path / "probe.py"
    script.write_text(probe_source())
    python = str(PY38) if PY38.exists() else "python3"
    args = json.dumps({"egress_host": "sandman-probe.invalid", "egress_timeout_s": 2})
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "TZ", "LC_ALL")}
    out = subprocess.run(
        [python, str(script), args], env={**base, **env}, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("SANDMAN-PROBE "))
    report: dict[str, object] = json.loads(line.split(" ", 1)[1])
    return report


def test_probe_script_reads_this_process(tmp_path: Path) -> None:
    obs = run_probe_script(tmp_path, {"PYTHONHASHSEED": "7", "TZ": "UTC"})
    assert obs["env"]["PYTHONHASHSEED"] == "7"  # type: ignore[index]
    assert obs["egress"]["state"] == "denied"  # type: ignore[index]
    assert obs["egress"]["reason"] == "no DNS answer"  # type: ignore[index]
    assert obs["cpu"]["visible"] == len(os.sched_getaffinity(0))  # type: ignore[index]
    checks = decide(
        Conditions(pythonhashseed="7", tz="UTC", egress="denied"), obs, grader_timeout_s=60
    )
    status = {c.field: c.status for c in checks}
    assert status["pythonhashseed"] == status["tz"] == status["egress"] == "ok"
    assert status["memory"] in ("not_declared", "unreadable")


def test_unknown_zone_is_a_contradiction(tmp_path: Path) -> None:
    obs = run_probe_script(tmp_path, {"TZ": "Mars/Olympus_Mons"})
    checks = {
        c.field: c for c in decide(Conditions(tz="Mars/Olympus_Mons"), obs, grader_timeout_s=1)
    }
    assert checks["tz"].status == "contradiction"
    assert "zone data missing" in checks["tz"].detail
