"""execd's bytecode, compiled once by the local backend: the interpreter really loads it."""

import shutil
import subprocess
from pathlib import Path

import pytest

from broker.backends import localpyc

pytestmark = pytest.mark.unit
EXECD = Path(__file__).resolve().parents[3] / "execd"
PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else shutil.which("python3")


def loaded_from(tmp_path: Path, tree: Path | None) -> str:
    """``python -v`` of importing execd.api from a copy seen where it lies, with the tree
    as its pycache prefix (or none): the lines naming where code objects came from."""
    flags = ["-X", f"pycache_prefix={tree}"] if tree is not None else []
    res = subprocess.run(
        [str(PYTHON), "-S", "-B", *flags, "-v", "-c", "import execd.api"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    return "\n".join(line for line in res.stderr.splitlines() if "execd" in line)


def test_sandbox_interpreter_loads_the_compiled_tree(tmp_path):
    src = tmp_path / "execd"
    shutil.copytree(EXECD, src)
    tree = localpyc.compiled_tree(tmp_path / "pods", [str(PYTHON)], src, seen_at=str(src))
    assert tree is not None
    assert localpyc.compiled_tree(tmp_path / "pods", [str(PYTHON)], src, seen_at=str(src)) == tree
    log = loaded_from(tmp_path, tree)
    assert f"code object from '{tree}" in log
    assert "api.py" in loaded_from(tmp_path, None)  # without it: compiled from source


def test_edited_sources_get_a_fresh_tree(tmp_path):
    src = tmp_path / "execd"
    shutil.copytree(EXECD, src)
    first = localpyc.compiled_tree(tmp_path / "pods", [str(PYTHON)], src, seen_at=str(src))
    (src / "errors.py").write_text((src / "errors.py").read_text() + "\n# edited\n")
    second = localpyc.compiled_tree(tmp_path / "pods", [str(PYTHON)], src, seen_at=str(src))
    assert first is not None and second is not None and first != second


def test_an_interpreter_that_cannot_compile_leaves_execd_as_it_was(tmp_path):
    assert localpyc.compiled_tree(tmp_path / "pods", ["/bin/false"], EXECD) is None


def test_execd_flags():
    assert localpyc.execd_flags(False) == ["-S"]
    assert localpyc.execd_flags(True) == ["-S", "-X", "pycache_prefix=/sandman/pyc"]
