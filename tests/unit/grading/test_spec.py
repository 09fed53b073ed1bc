"""Task specs, the schema validator, diff parsing and test-log parsing (pure functions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from broker.grading.patchfmt import filter_patch, glob_to_regex, patch_paths
from broker.grading.spec import TaskSpecError, check_task_file, load_task, parse_task
from broker.grading.testlog import lookup, parse_output

pytestmark = pytest.mark.unit

SWE = Path(__file__).resolve().parents[3] / "deploy" / "images" / "swe-task"
BASE = "cd0583af25d6bab48aa2c08cb82ec1494d7cba34"


def minimal(**extra: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "task_id": "t",
        "image": "localhost/x:v1",
        "base_commit": BASE,
        "test_command": "pytest -rA",
        "FAIL_TO_PASS": ["a"],
        "test_files": ["tests/test_a.py"],
    }
    doc.update(extra)
    return doc


def test_demo_task_and_extra_specs_are_valid() -> None:
    task = load_task(SWE / "task.json")
    assert task.repo_path == "/repo" and task.base_commit == BASE
    assert task.reference_patch is not None and task.reference_patch.startswith(b"diff --git")
    for path in sorted((SWE / "specs").glob("*.*")):
        if path.suffix in (".json", ".yaml"):
            assert check_task_file(path) == [], path


def test_swebench_fields_json_strings_and_inline_patches() -> None:
    swe = load_task(SWE / "specs" / "swebench-style.json")
    assert swe.task_id == "sandman-demo__statlib-median-even-hardened"
    assert len(swe.fail_to_pass) == 2 and len(swe.pass_to_pass) == 4
    assert swe.test_files == ("tests/test_stats.py",)  # derived from test_patch
    assert swe.conditions.env() == {
        "PYTHONHASHSEED": "0",
        "TZ": "UTC",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
    }
    assert swe.conditions.timeout_s == 120.0


def test_every_error_is_reported_with_its_path() -> None:
    doc = minimal(
        image="Not An Image",
        base_commit="abc",
        FAIL_TO_PASS="[oops",
        PASS_TO_PASS=["a"],
        test_comand="typo",
        conditions={"memory": "2GB", "egress": "sometimes", "cpus": 0, "bogus": 1},
    )
    with pytest.raises(TaskSpecError) as info:
        parse_task(doc)
    paths = {i.path for i in info.value.issues}
    assert {
        "$.image",
        "$.base_commit",
        "$.FAIL_TO_PASS",
        "$.test_comand",
        "$.conditions.memory",
        "$.conditions.egress",
        "$.conditions.cpus",
        "$.conditions.bogus",
    } <= paths
    assert any("did you mean 'test_command'" in i.message for i in info.value.issues)


def test_semantic_checks() -> None:
    with pytest.raises(TaskSpecError) as info:
        parse_task(minimal(PASS_TO_PASS=["a"], test_files=["../escape.py"], patch="x.patch"))
    messages = [str(i) for i in info.value.issues]
    assert any("also in FAIL_TO_PASS" in m for m in messages)
    assert any("$.test_files[0]" in m for m in messages)
    assert any("needs a task file" in m for m in messages)
    with pytest.raises(TaskSpecError, match="declare test_files or a test_patch"):
        parse_task({k: v for k, v in minimal().items() if k != "test_files"})
    with pytest.raises(TaskSpecError, match="task_id"):
        parse_task({k: v for k, v in minimal().items() if k != "task_id"})


def test_yaml_and_digest(tmp_path: Path) -> None:
    digest = "sha256:" + "a" * 64
    path = tmp_path / "t.yaml"
    path.write_text(
        f"instance_id: y\nimage: reg/x@{digest}\nbase_commit: {BASE}\n"
        "test_command: pytest\nFAIL_TO_PASS: '[\"a\"]'\ntest_files: [t.py]\n"
        "reference_patch: fix.patch\n"
    )
    (tmp_path / "fix.patch").write_bytes(b"diff --git a/x b/x\n")
    task = load_task(path)
    assert task.image_digest == digest and task.image_ref.endswith(digest)
    assert task.reference_patch == b"diff --git a/x b/x\n"


def test_cli_validate_prints_each_error(tmp_path: Path) -> None:
    from broker.cli.main import main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(minimal(base_commit="nope", conditions={"tz": 3})))
    result = CliRunner().invoke(main, ["task", "validate", str(bad), str(SWE / "task.json")])
    assert result.exit_code == 1
    assert "$.base_commit:" in result.output and "$.conditions.tz:" in result.output
    assert "task.json: ok" in result.output


BINARY_AND_QUOTED = (
    b"diff --git a/src/a b.py b/src/a b.py\n"
    b"index 1..2 100644\n--- a/src/a b.py\n+++ b/src/a b.py\n@@ -1 +1 @@\n-x\n+y\n"
    b'diff --git "a/tests/t\\303\\251st.py" "b/tests/t\\303\\251st.py"\n'
    b'new file mode 100644\n--- /dev/null\n+++ "b/tests/t\\303\\251st.py"\n@@ -0,0 +1 @@\n+z\n'
    b"diff --git a/img.bin b/img.bin\nnew file mode 100644\nindex 0000000..1111111\n"
    b"GIT binary patch\nliteral 3\nKcmZ>(0{{O900000\n\nliteral 0\nHcmV?d00001\n\n"
)


def test_patch_paths_quoted_spaces_and_binary() -> None:
    assert patch_paths(BINARY_AND_QUOTED) == ["src/a b.py", "tests/tést.py", "img.bin"]
    kept, dropped = filter_patch(BINARY_AND_QUOTED, lambda p: p.startswith("tests/"))
    assert dropped == ["tests/tést.py"]
    assert patch_paths(kept) == ["src/a b.py", "img.bin"]
    assert b"GIT binary patch" in kept
    assert patch_paths(b"--- a/x.py\t2024\n+++ b/x.py\t2024\n@@ -1 +1 @@\n-a\n+b\n") == ["x.py"]
    with pytest.raises(ValueError):
        patch_paths(b"this is not a diff\n")


def test_glob_semantics() -> None:
    rx = glob_to_regex("**/conftest.py")
    assert rx.match("conftest.py") and rx.match("a/b/conftest.py")
    assert not rx.match("a/conftest.pyc")
    assert glob_to_regex("**/__pycache__/**").match("pkg/__pycache__/m.cpython-311.pyc")


UNITTEST = """test_a (pkg.tests.T.test_a) ... ok
test_b (pkg.tests.T)
Docstring first line ... FAIL
test_c (pkg.tests.T.test_c) ... noisy output
ERROR
test_d (pkg.tests.T.test_d) ... skipped 'no'
test_e (pkg.tests.T.test_e) ... expected failure

======================================================================
FAIL: test_b (pkg.tests.T)
----------------------------------------------------------------------
Ran 5 tests in 0.001s

FAILED (failures=1, errors=1)
"""

PYTEST = """tests/test_x.py::test_one PASSED                                [ 50%]
=========================== short test summary info ============================
PASSED tests/test_x.py::test_one
PASSED tests/test_x.py::test_param[a b]
FAILED tests/test_x.py::TestK::test_two - AssertionError: 1 != 2
ERROR tests/test_y.py - ImportError: nope
XFAIL tests/test_x.py::test_three - reason
SKIPPED [1] tests/test_x.py:12: skipped
========================= 1 failed, 2 passed in 0.10s ==========================
"""


def test_unittest_verbose_outcomes() -> None:
    out = parse_output(UNITTEST)
    assert out == {
        "pkg.tests.T.test_a": "passed",
        "pkg.tests.T.test_b": "failed",
        "pkg.tests.T.test_c": "error",
        "pkg.tests.T.test_d": "skipped",
        "pkg.tests.T.test_e": "xfail",
    }
    assert lookup(out, "test_b (pkg.tests.T)") == "failed"
    assert lookup(out, "pkg.tests.T.test_zzz") == "missing"


def test_pytest_ra_outcomes() -> None:
    out = parse_output(PYTEST)
    assert out["tests/test_x.py::test_one"] == "passed"
    assert out["tests/test_x.py::test_param[a b]"] == "passed"
    assert out["tests/test_x.py::TestK::test_two"] == "failed"
    assert out["tests/test_y.py"] == "error"
    assert out["tests/test_x.py::test_three"] == "xfail"
    assert lookup(out, "tests.test_x.TestK.test_two") == "failed"  # dotted spec, pytest id
    assert lookup(out, "tests/test_x.py::TestK::test_two") == "failed"
    assert parse_output(UNITTEST, "pytest") == {}


def test_pytest_summary_ids_with_dashes_and_brackets() -> None:
    """Regression (the SWE-bench differential check): a parametrized id containing
    ``" - "`` was cut at it (``test_p[p``), so the test was missing and a correct patch
    scored unresolved; the message separator is the first ``" - "`` after the id's
    closing bracket."""
    out = parse_output(
        "PASSED t.py::test_p[p - q]\n"
        "FAILED t.py::test_p[x[1]] - AssertionError: a - b\n"
        "FAILED t.py::test_q - assert [1] == [2]\n"
        "XFAIL t.py::test_r[a] - reason] - more\n"
        "XPASS t.py::test_s[a]] - reason\n"
    )
    assert out == {
        "t.py::test_p[p - q]": "passed",
        "t.py::test_p[x[1]]": "failed",
        "t.py::test_q": "failed",
        "t.py::test_r[a]": "xfail",
        "t.py::test_s[a]]": "xpass",
    }


def test_at_least_conditions() -> None:
    spec = parse_task(minimal(conditions={"min_cpus": 2, "min_memory": "3Gi"}))
    assert (spec.conditions.min_cpus, spec.conditions.min_memory_b) == (2.0, 3 << 30)
    assert spec.conditions.cpus is None and spec.conditions.memory_b is None
    with pytest.raises(TaskSpecError) as info:
        parse_task(
            minimal(conditions={"cpus": 1, "min_cpus": 2, "memory": "1Gi", "min_memory": "1Gi"})
        )
    assert {i.path for i in info.value.issues} == {
        "$.conditions.min_cpus",
        "$.conditions.min_memory",
    }
    with pytest.raises(TaskSpecError) as info:
        parse_task(minimal(conditions={"min_memory": "2GB", "min_cpus": 0}))
    assert {i.path for i in info.value.issues} == {
        "$.conditions.min_memory",
        "$.conditions.min_cpus",
    }
