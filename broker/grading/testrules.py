"""Which repository paths belong to the tests, and are therefore never taken from an agent.

The rule (docs/grading.md, "Test files by rule"): a path is a **test path** when

1. it is in the task's ``test_files`` (literal), or is a file the ``test_command`` names
   (a ``.py``/``.sh`` argument or a ``./script``; ``path::node`` counts as ``path``);
2. it has a ``tests`` or ``test`` directory component (``tests/__init__.py``,
   ``pkg/tests/data.json``);
3. its file name is ``test_*.py``, ``*_test.py`` or ``conftest.py``;
4. its file name is loaded by the interpreter or the test runner before the code
   under test: ``sitecustomize.py``, ``usercustomize.py``, ``*.pth`` (site hooks);
   ``pytest.ini``, ``.pytest.ini``, ``pytest.toml``, ``.pytest.toml``, ``tox.ini``,
   ``setup.cfg``, ``pyproject.toml`` (runner config), ``noxfile.py``, ``.coveragerc``
   (coverage runs as a pytest plugin / a process hook and can execute code);
5. or it matches the task's ``exclude_paths`` globs (default ``**/conftest.py``);

unless it matches one of the task's ``allow_paths`` globs. Anything under ``.git`` and
test-run by-products (``__pycache__``, ``*.pyc``) are always dropped, allowed or not.

Why whole files for ``setup.cfg``/``pyproject.toml`` and not only their test sections:
pytest reads ``[tool:pytest]`` / ``[tool.pytest.ini_options]``, but TOML also accepts the
same table as dotted keys (``tool.pytest.ini_options.addopts = ...``) or inline tables,
and INI files accept duplicate sections; a section-level check would have to agree with
every runner's parser on every such spelling, and any disagreement is a reward hole.
Dropping the whole change costs only the rare task whose fix must edit these files,
which preflight shows (the reference's ``dropped_files``) and ``allow_paths`` fixes.

Why name matching and not "what the runner actually loads": the grader cannot run the
agent's tree to find out without running the agent's code first; a syntactic rule is
decidable on the patch alone, on the broker, with no trust in the sandbox.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from functools import cache
from pathlib import PurePosixPath

from broker.grading.patchfmt import glob_to_regex

TEST_DIRS = frozenset({"tests", "test"})
TEST_NAME_GLOBS = ("test_*.py", "*_test.py", "conftest.py")
RUNNER_FILES = frozenset(
    {
        "sitecustomize.py",
        "usercustomize.py",
        "pytest.ini",
        ".pytest.ini",
        "pytest.toml",
        ".pytest.toml",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "noxfile.py",
        ".coveragerc",
    }
)
RUNNER_SUFFIXES = (".pth",)
ALWAYS_DROPPED = ("**/__pycache__/**", "**/*.pyc")  # test-run by-products, not changes


@cache
def _glob(pattern: str) -> re.Pattern[str]:
    return glob_to_regex(pattern)


def matches_any(path: str, globs: Iterable[str]) -> bool:
    """git ``:(glob)`` semantics, as the in-sandbox pathspecs use."""
    return any(_glob(g).match(path) for g in globs)


def is_test_path_by_name(path: str) -> bool:
    """Rules 2-4: decided from the path alone (no task needed)."""
    parts = PurePosixPath(path).parts
    if not parts:
        return False
    name = parts[-1]
    if TEST_DIRS & set(parts[:-1]):
        return True
    if any(_glob(g).match(name) for g in TEST_NAME_GLOBS):
        return True
    return name in RUNNER_FILES or name.endswith(RUNNER_SUFFIXES)


def command_files(test_command: str) -> list[str]:
    """Repository files a test command names (rule 1): scripts and test modules it runs."""
    try:
        words = shlex.split(test_command, comments=True)
    except ValueError:
        words = test_command.split()
    out = []
    for word in words:
        path = word.split("::", 1)[0]
        if path.startswith("-") or "=" in path or path.startswith("/"):
            continue
        if path.startswith("./") or path.endswith((".py", ".sh")):
            norm = str(PurePosixPath(path))
            if ".." not in PurePosixPath(norm).parts and norm not in out:
                out.append(norm)
    return out


def always_dropped(path: str) -> bool:
    """``.git`` internals and by-products: never taken, whatever the task allows."""
    return path == ".git" or path.startswith(".git/") or matches_any(path, ALWAYS_DROPPED)


def is_test_path(
    path: str,
    *,
    test_files: Iterable[str] = (),
    test_command: str = "",
    exclude_paths: Iterable[str] = (),
    allow_paths: Iterable[str] = (),
) -> bool:
    """The whole rule: True when an agent's change to ``path`` must be dropped."""
    if always_dropped(path):
        return True
    if matches_any(path, allow_paths):
        return False
    return (
        path in set(test_files)
        or path in command_files(test_command)
        or is_test_path_by_name(path)
        or matches_any(path, exclude_paths)
    )
