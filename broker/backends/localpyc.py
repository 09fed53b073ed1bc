"""Byte-compiled execd for local sandboxes: compiled once per source version, bound in.

execd is mounted read-only at /sandman/execd and never writes bytecode next to itself,
so without this every sandbox compiles its ~25 modules from source at start: 50 ms of
CPU and 1.4 MiB of resident memory that the compiler leaves fragmented in each
daemon's heap, for as long as the sandbox lives. Here the broker copies the sources
(mtimes kept) into ``<state>/local-pods/.execd-pyc/<key>/execd/`` and compiles them
there, once, with the interpreter the sandbox will run, into the usual ``__pycache__``;
the backend binds that copy read-only at /sandman/execd instead of the repository's
folder. An interpreter of another version (an image's own python) finds no file with
its tag and compiles from source as before: nothing breaks, it only saves nothing.

Why not ``-X pycache_prefix``: with a prefix Python looks for *every* module's bytecode
under it, so the standard library would be compiled from source in each sandbox
(2 MiB more, not less).

``key`` hashes the interpreter and every source's name, size and mtime, so an edited
execd gets a fresh copy on the next create (Python's own timestamp check would skip a
stale file too).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
_failed: set[str] = set()  # keys this process could not compile: not retried per create

SOURCE_MOUNT = "/sandman/execd"  # where the sandbox sees execd

# Run by the sandbox's interpreter: compile argv[1]/*.py, naming them as at argv[2].
_COMPILE = """
import os, py_compile, sys
src, seen_at = sys.argv[1:3]
for name in sorted(os.listdir(src)):
    if name.endswith(".py"):
        py_compile.compile(
            os.path.join(src, name), dfile=os.path.join(seen_at, name), doraise=True
        )
"""


def _key(python: list[str], execd_dir: Path) -> str:
    h = hashlib.sha256("\0".join(python).encode())
    for entry in sorted(os.scandir(execd_dir), key=lambda e: e.name):
        if entry.name.endswith(".py"):
            st = entry.stat()
            h.update(f"\0{entry.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def _compile_into(copy: Path, python: list[str], execd_dir: Path, seen_at: str) -> None:
    copy.mkdir()
    for src in execd_dir.glob("*.py"):
        shutil.copy2(src, copy / src.name)  # the mtime is what the bytecode records
    subprocess.run(
        [*python, "-S", "-c", _COMPILE, str(copy), seen_at],
        check=True,
        capture_output=True,
        timeout=60,
    )


def compiled_copy(
    root: Path, python: list[str], execd_dir: Path, *, seen_at: str = SOURCE_MOUNT
) -> Path | None:
    """A copy of ``execd_dir`` with its bytecode, for ``python`` (argv prefix) that sees
    it at ``seen_at``: made now if this source version has none yet; None if it cannot
    be made (the caller binds ``execd_dir`` itself, which compiles at start as always)."""
    base = root / ".execd-pyc"
    try:
        key = _key([*python, seen_at], execd_dir)
        done = base / key / "execd"
        if done.is_dir():
            return done
        if key in _failed:
            return None
        _failed.add(key)  # until it is made
        base.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=base))
        try:
            _compile_into(work / "execd", python, execd_dir, seen_at)
            work.rename(base / key)  # atomic; another process may have won the race
        except OSError:
            if not done.is_dir():
                raise
        finally:
            shutil.rmtree(work, ignore_errors=True)  # gone already when renamed
        _failed.discard(key)
        return done
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("execd bytecode not prepared (sandboxes compile it themselves): %s", exc)
        return None
