"""``preflight --sensitivity`` on the local backend (issue #16 item 2): real bubblewrap
sandboxes in the SWE task image, served by a real worker.

Each task is the SWE demo plus one test that depends on one run condition, the way
real tasks do by accident: a hash value pinned under ``PYTHONHASHSEED=0``, a local time
that is only right in UTC, a parallel helper that needs two CPUs. Perturbing that
condition must flip the reference and name it in ``load_bearing`` (with the flipped
test); the plain demo task must get ``[]``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker.client.sync import SandboxClient
from broker.grading import GradingClient, PreflightOptions, run_preflight
from broker.grading.preflight import write_reports
from broker.grading.spec import Conditions, TaskSpec, load_task
from broker.settings import Settings
from tests.integration.grading.test_grading_local_backend import CFG, JOB, SWE, _env, client
from tests.support.images import REPO
from tests.support.tampering import make_test_patch

pytestmark = pytest.mark.integration
__all__ = ["client"]  # the module fixture, shared with the local-backend grading tests

ENV_TEST = """\
import os
import subprocess
import sys
import time
import unittest


class EnvTests(unittest.TestCase):
    def test_env(self):
{body}
"""
BODIES = {
    # The value a fixture recorded under PYTHONHASHSEED=0 (computed here the same way).
    "seed": "        pinned = subprocess.run([sys.executable, '-c', 'print(hash(\"sandman\"))'],\n"
    "            env={'PYTHONHASHSEED': '0'}, capture_output=True, text=True).stdout\n"
    "        self.assertEqual(str(hash('sandman')), pinned.strip())",
    "tz": "        self.assertEqual(time.localtime().tm_gmtoff, 0)",
    "cpus": "        self.assertGreaterEqual(len(os.sched_getaffinity(0)), 2)",
}
NAME = "tests.test_env.EnvTests.test_env"


def condition_task(scratch: Path, kind: str, conditions: Conditions) -> TaskSpec:
    base = load_task(SWE / "task.json")
    text = ENV_TEST.format(body=BODIES[kind])
    return dataclasses.replace(
        base,
        task_id=f"sensitivity/{kind}",
        test_command="python3 -m unittest -v tests.test_stats tests.test_env",
        test_patch=make_test_patch(scratch / kind, {"tests/test_env.py": text}),
        test_files=("tests/test_stats.py", "tests/test_env.py"),
        pass_to_pass=(*base.pass_to_pass, NAME),
        conditions=conditions,
    )


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the CPU task needs two host CPUs")
def test_sensitivity_names_each_load_bearing_condition(
    client: SandboxClient, tmp_path: Path
) -> None:
    tasks = [
        condition_task(tmp_path, "seed", Conditions(pythonhashseed="0")),
        condition_task(tmp_path, "tz", Conditions()),  # depends on TZ, does not declare it
        condition_task(tmp_path, "cpus", Conditions(visible_cpus=2)),
        load_task(SWE / "task.json"),  # depends on nothing
    ]
    grader = GradingClient(client, job=JOB, config=CFG).grader
    entries = run_preflight(grader, tasks, parallel=2, options=PreflightOptions(sensitivity=True))
    got = {e.task_id: e for e in entries}
    for e in entries:
        assert e.status == "ok", (e.task_id, e.reference, e.empty, e.errors)
    seed, tz, cpus = got["sensitivity/seed"], got["sensitivity/tz"], got["sensitivity/cpus"]
    plain = got["sandman-demo/statlib-median-even"]
    assert seed.load_bearing == ["pythonhashseed"], seed.sensitivity
    assert tz.load_bearing == ["tz"], tz.sensitivity
    assert cpus.load_bearing == ["visible_cpus"], cpus.sensitivity
    assert plain.load_bearing == [], plain.sensitivity
    for e in (seed, tz, cpus):
        assert e.load_bearing_tests == {e.load_bearing[0]: [NAME]}  # type: ignore[index]
    assert tz.undeclared_dependency == ["tz"]
    assert seed.undeclared_dependency == cpus.undeclared_dependency == []
    assert plain.undeclared_dependency == []
    # Every seed flips the pinned hash, unset included; egress cannot be perturbed here.
    runs = sorted((r["key"], r["value"], r["status"]) for r in seed.sensitivity or [])
    assert ("pythonhashseed", "unset", "flipped") in runs
    assert ("pythonhashseed", "1", "flipped") in runs
    # Egress: the opposite ("allowed") is asked for; on a host without a route out the
    # probe contradicts it (not_tested, with the reason); with one, it changes nothing.
    (egress,) = [r for r in plain.sensitivity or [] if r["key"] == "egress"]
    assert egress["value"] == "allowed"
    assert egress["status"] == "same" or (
        egress["status"] == "not_tested" and "egress" in egress["reason"]
    ), egress

    paths = write_reports(entries, tmp_path / "out", meta={}, exclude_file=tmp_path / "ex.txt")
    doc = json.loads(paths["json"].read_text())
    by_id = {t["task_id"]: t for t in doc["tasks"]}
    assert by_id["sensitivity/tz"]["load_bearing"] == ["tz"]
    assert by_id["sensitivity/tz"]["undeclared_dependency"] == ["tz"]
    assert by_id["sandman-demo/statlib-median-even"]["load_bearing"] == []
    md = paths["markdown"].read_text()
    assert "| tz (undeclared) |" in md
    assert f"load-bearing `visible_cpus`: flipped at 1; tests: `{NAME}`" in md


def test_cli_sensitivity_flags_an_undeclared_dependency(
    stack: Settings, client: SandboxClient, tmp_path: Path
) -> None:
    task = condition_task(tmp_path, "tz", Conditions())
    doc = json.loads((SWE / "task.json").read_text())
    doc.update(
        task_id=task.task_id,
        test_command=task.test_command,
        test_patch=task.test_patch.decode(),
        test_files=list(task.test_files),
        PASS_TO_PASS=list(task.pass_to_pass),
        reference_patch=(SWE / "reference.patch").read_text(),
    )
    spec = tmp_path / "tz-task.json"
    spec.write_text(json.dumps(doc))
    out = tmp_path / "report"
    preflight = subprocess.run(
        [str(Path(sys.executable).parent / "sandman"), "preflight", str(spec), "--sensitivity",
         "--job", JOB, "--out", str(out), "--cpu", "0.5", "--memory", "512Mi"],
        cwd=REPO, env=_env(stack), capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert preflight.returncode == 1, preflight.stdout + preflight.stderr  # flagged, not ok
    assert "load_bearing=tz undeclared_dependency=tz" in preflight.stdout, preflight.stdout
    report = json.loads((out / "preflight.json").read_text())
    (entry,) = report["tasks"]
    assert entry["status"] == "ok" and not entry["excluded"]
    assert report["meta"]["sensitivity"] is True
