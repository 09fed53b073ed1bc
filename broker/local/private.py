"""Files only their owner may read, in dirs only their owner may enter.

The embedded services keep the ledger, Redis's AOF and RDB (every sandbox's token), the
passwords and the logs in the state dir; on a shared machine all of it must be private
(dirs 0700, files 0600), including what the servers themselves create (``PRIVATE_UMASK``)
and what older installations left with looser modes (``tighten``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

# Files a server creates (AOF, RDB, logs, pid files) are born 0600 and its dirs 0700.
PRIVATE_UMASK = 0o077


def private_dir(path: Path, traverse_gid: int | None = None) -> Path:
    """``mkdir -p`` whose last dir only its owner may enter (0700), tightening an old one.

    ``traverse_gid``: a group that keeps (never gains) a traverse bit on ``path``, for the
    PostgreSQL system user that must walk through the state dir to its data dir."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    keep = (
        st.st_mode & stat.S_IXGRP if traverse_gid is not None and st.st_gid == traverse_gid else 0
    )
    want = 0o700 | keep
    if stat.S_IMODE(st.st_mode) != want:
        path.chmod(want)
    return path


def tighten(path: Path) -> None:
    """Strip group/other bits from every file and dir under ``path`` (data of older
    installations, made before the state dir was private). Sockets are left alone: the
    0700 dir they sit in is what closes them."""
    for dirpath, _dirs, files in os.walk(path):
        for name in [dirpath, *(os.path.join(dirpath, f) for f in files)]:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(name)
                regular = stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)
                if regular and st.st_mode & 0o077:
                    os.chmod(name, stat.S_IMODE(st.st_mode) & 0o700)


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` atomically with a file only its owner can read (it holds passwords)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
