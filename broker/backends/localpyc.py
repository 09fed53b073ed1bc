"""Byte-compiled execd for local sandboxes: compiled once per source version, bound in.

execd is mounted read-only at /sandman/execd and never writes bytecode next to itself,
so without this every sandbox compiles its ~25 modules from source at start: 50 ms of
CPU and 1.4 MiB of resident memory that the compiler leaves fragmented in each
daemon's heap, for as long as the sandbox lives. Here the broker compiles them once,
with the interpreter the sandbox will run, into
``<state>/local-pods/.execd-pyc/<key>/sandman/execd/*.pyc``; the backend binds that
tree read-only at /sandman/pyc and starts ``python3 -X pycache_prefix=/sandman/pyc``.
An interpreter of another version (an image's own python) finds no file with its tag
and compiles from source as before: nothing breaks, it only saves nothing.

``key`` hashes the interpreter and every source's name, size and mtime, so an edited
execd gets a fresh tree (and Python's own timestamp check would skip a stale file).
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

MOUNT = "/sandman/pyc"  # inside the sandbox; execd's sources are at /sandman/execd
SOURCE_MOUNT = "/sandman/execd"

# Run by the sandbox's interpreter: compile argv[1]/*.py as if they lived at argv[2].
_COMPILE = """
import importlib.util, os, py_compile, sys
src, virtual, out = sys.argv[1:4]
for name in sorted(os.listdir(src)):
    if name.endswith(".py"):
        cached = importlib.util.cache_from_source(os.path.join(virtual, name))
        py_compile.compile(
            os.path.join(src, name),
            cfile=os.path.join(out, cached.lstrip("/")),
            dfile=os.path.join(virtual, name),
            doraise=True,
        )
"""


def _key(python: list[str], execd_dir: Path) -> str:
    h = hashlib.sha256("\0".join(python).encode())
    for entry in sorted(os.scandir(execd_dir), key=lambda e: e.name):
        if entry.name.endswith(".py"):
            st = entry.stat()
            h.update(f"\0{entry.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def compiled_tree(
    root: Path, python: list[str], execd_dir: Path, *, seen_at: str = SOURCE_MOUNT
) -> Path | None:
    """The tree to bind at MOUNT for execd started by ``python`` (argv prefix) from
    sources the sandbox sees at ``seen_at``, compiled now if this source version has
    none yet; None if it cannot be made (execd then compiles from source, as it always
    could)."""
    base = root / ".execd-pyc"
    try:
        tree = base / _key([*python, seen_at], execd_dir)
        if tree.is_dir():
            return tree
        base.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=base))
        # With pycache_prefix set, the cache of /sandman/execd/x.py is MOUNT/sandman/execd/...
        # (cache_from_source under the prefix set here gives exactly that layout).
        args = [str(execd_dir), seen_at, str(work)]
        subprocess.run(
            [*python, "-S", "-X", f"pycache_prefix={MOUNT}", "-c", _COMPILE, *args],
            check=True,
            capture_output=True,
            timeout=60,
        )
        inner = work / MOUNT.lstrip("/")
        try:
            inner.rename(tree)  # atomic; another process may have won the race
        except OSError:
            if not tree.is_dir():
                raise
        shutil.rmtree(work, ignore_errors=True)
        return tree
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("execd bytecode not prepared (sandboxes compile it themselves): %s", exc)
        return None


def execd_flags(with_pyc: bool) -> list[str]:
    """The interpreter's flags for execd: ``-S`` (no ``site``: execd needs no
    site-packages, and site's imports and path scans cost every sandbox memory and start
    time) and, with a compiled tree bound, where to find it."""
    return ["-S", "-X", f"pycache_prefix={MOUNT}"] if with_pyc else ["-S"]
