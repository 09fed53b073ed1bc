"""execd's bytecode, compiled once by the local backend: the interpreter really loads it."""

import shutil
import subprocess
from pathlib import Path

import pytest

from broker.backends import localpyc

pytestmark = pytest.mark.unit
EXECD = Path(__file__).resolve().parents[3] / "execd"
PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else shutil.which("python3")


def code_origins(folder: Path) -> list[str]:
    """``python -v`` of importing execd.api from ``folder/execd``: where each of execd's
    code objects came from (a .pyc, or the .py compiled at import)."""
    res = subprocess.run(
        [str(PYTHON), "-S", "-B", "-v", "-c", "import execd.api"],
        cwd=folder,
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    return [
        line.split("code object from ", 1)[1].strip("'")
        for line in res.stderr.splitlines()
        if "code object from" in line and "/execd/" in line
    ]


def test_the_copy_is_loaded_from_its_bytecode(tmp_path):
    copy = localpyc.compiled_copy(tmp_path / "pods", [str(PYTHON)], EXECD, seen_at="/x/execd")
    assert copy is not None and copy.name == "execd"
    assert sorted(p.name for p in copy.glob("*.py")) == sorted(p.name for p in EXECD.glob("*.py"))
    # The sandbox sees the copy at seen_at; here it is run where it lies, and the
    # timestamp check (mtimes kept by the copy) still accepts every file.
    origins = code_origins(copy.parent)
    assert origins and all(o.endswith(".pyc") for o in origins)
    again = localpyc.compiled_copy(tmp_path / "pods", [str(PYTHON)], EXECD, seen_at="/x/execd")
    assert again == copy


def test_the_check_sees_a_copy_without_bytecode(tmp_path):
    shutil.copytree(EXECD, tmp_path / "execd")
    origins = code_origins(tmp_path)
    assert origins and all(o.endswith(".py") for o in origins)


def test_edited_sources_get_a_fresh_copy(tmp_path):
    src = tmp_path / "src" / "execd"
    shutil.copytree(EXECD, src)
    first = localpyc.compiled_copy(tmp_path / "pods", [str(PYTHON)], src)
    (src / "errors.py").write_text((src / "errors.py").read_text() + "\n# edited\n")
    second = localpyc.compiled_copy(tmp_path / "pods", [str(PYTHON)], src)
    assert first is not None and second is not None and first != second
    assert (second / "errors.py").read_text().endswith("# edited\n")


def test_an_interpreter_that_cannot_compile_leaves_execd_as_it_was(tmp_path):
    assert localpyc.compiled_copy(tmp_path / "pods", ["/bin/false"], EXECD) is None
    assert localpyc.compiled_copy(tmp_path / "pods", ["/bin/false"], EXECD) is None
    assert list((tmp_path / "pods" / ".execd-pyc").iterdir()) == []  # nothing half-made
