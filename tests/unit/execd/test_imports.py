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


def typing_at_run_time(path: Path) -> list[int]:
    """Lines that import ``typing`` outside an ``if TYPE_CHECKING:`` block."""
    found: list[int] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name):
            guarded = guarded or node.test.id == "TYPE_CHECKING"
            for child in node.body:
                visit(child, guarded)
            for child in node.orelse:
                visit(child, False)
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        if "typing" in names and not guarded:
            found.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def test_execd_imports_typing_only_for_the_type_checker():
    """``typing`` costs every sandbox 0.6 MiB at start (execd/__init__.py)."""
    offenders = {f.name: typing_at_run_time(f) for f in sorted(EXECD.glob("*.py"))}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_typing_check_sees_an_unguarded_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "TYPE_CHECKING = False\nif TYPE_CHECKING:\n    from typing import List\n"
        "else:\n    import typing\ndef f():\n    from typing import Any\n"
    )
    assert typing_at_run_time(src) == [5, 7]
