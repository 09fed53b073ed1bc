"""execd runs inside unmodified task images: it may import only the standard library."""

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

EXECD = Path(__file__).resolve().parents[3] / "execd"


def imported_top_levels(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_execd_imports_only_stdlib_and_itself():
    files = sorted(EXECD.glob("*.py"))
    assert files, "execd sources not found"
    allowed = set(sys.stdlib_module_names) | {"execd", "__future__"}
    offenders = {f.name: sorted(imported_top_levels(f) - allowed) for f in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_check_catches_a_third_party_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nimport requests\nfrom yaml import safe_load\n")
    assert imported_top_levels(bad) - set(sys.stdlib_module_names) == {"requests", "yaml"}
