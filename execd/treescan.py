"""A fast, hashed snapshot of a directory tree, and the diff of two snapshots.

Speed matters (the baseline is taken at create time, the check at every
release): one ``lstat`` per entry via ``os.scandir``, and a file is hashed
again only when its size, mtime, ctime or inode changed since the previous
snapshot; otherwise its digest is carried over. The tree never leaves its
filesystem (no descent into /proc or mounts below the root).
"""

from __future__ import annotations

import os
import stat

from .files import sha256

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Dict, Iterable, List, NamedTuple, Optional, Set, Tuple
else:
    from .records import NamedTuple

HASH_CHUNK = 1 << 20
HASH_THREADS = 4


class Entry(NamedTuple):
    kind: str  # "f" file, "d" dir, "l" symlink, "o" other
    mode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    uid: int
    gid: int
    digest: str  # sha256 for files, link target for symlinks, "" otherwise

    def same_stat(self, other: "Entry") -> bool:
        return (self.kind, self.size, self.mtime_ns, self.ctime_ns, self.ino) == (
            other.kind,
            other.size,
            other.mtime_ns,
            other.ctime_ns,
            other.ino,
        )


if TYPE_CHECKING:
    Tree = Dict[str, Entry]


def file_digest(path: str, buf: bytearray) -> str:
    h = sha256()
    view = memoryview(buf)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return "unreadable"
    try:
        while True:
            n = os.readv(fd, [buf])
            if not n:
                break
            h.update(view[:n])
    except OSError:
        return "unreadable"
    finally:
        os.close(fd)
    return h.hexdigest()


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "f"
    if stat.S_ISDIR(mode):
        return "d"
    if stat.S_ISLNK(mode):
        return "l"
    return "o"


def scan(root: str, skip: Iterable[str] = (), prev: Optional[Tree] = None) -> Tree:
    """Snapshot ``root`` (keys are paths relative to it; "" is the root itself).

    ``skip`` holds relative paths not to record or descend into. Files whose
    hash cannot be carried over are hashed after the walk, in one thread:
    measured on 2 cores, hashing threads were slower for source trees (many
    small files, GIL hand-offs) than one thread with a reused 1 MiB buffer.
    """
    todo: List[Tuple[str, str]] = []
    tree = _walk(root, set(skip), prev or {}, todo)
    buf = bytearray(HASH_CHUNK)
    for rel, path in todo:
        tree[rel] = tree[rel]._replace(digest=file_digest(path, buf))
    return tree


def _walk(root: str, skipped: Set[str], prev: Tree, todo: List[Tuple[str, str]]) -> Tree:
    tree: Tree = {}
    try:
        st = os.lstat(root)
    except OSError:
        return tree
    tree[""] = _entry(root, st, "", prev, todo)
    if not stat.S_ISDIR(st.st_mode):
        return tree
    dev = st.st_dev
    stack: List[Tuple[str, str]] = [(root, "")]
    while stack:
        path, rel = stack.pop()
        try:
            with os.scandir(path) as it:
                entries = list(it)
        except OSError:
            continue
        for de in entries:
            child_rel = de.name if not rel else rel + "/" + de.name
            if child_rel in skipped:
                continue
            try:
                cst = de.stat(follow_symlinks=False)
            except OSError:
                continue
            tree[child_rel] = _entry(de.path, cst, child_rel, prev, todo)
            if stat.S_ISDIR(cst.st_mode) and cst.st_dev == dev:
                stack.append((de.path, child_rel))
    return tree


def _entry(
    path: str, st: os.stat_result, rel: str, prev: Tree, todo: List[Tuple[str, str]]
) -> Entry:
    kind = _kind(st.st_mode)
    digest = ""
    entry = Entry(
        kind,
        stat.S_IMODE(st.st_mode),
        st.st_size if kind != "d" else 0,
        st.st_mtime_ns,
        st.st_ctime_ns,
        st.st_ino,
        st.st_uid,
        st.st_gid,
        "",
    )
    if kind == "f":
        old = prev.get(rel)
        if old is not None and old.same_stat(entry) and old.digest != "unreadable":
            digest = old.digest  # unchanged metadata: carry the hash over
        else:
            todo.append((rel, path))  # hashed after the walk
    elif kind == "l":
        try:
            digest = os.readlink(path)
        except OSError:
            digest = "unreadable"
    return entry._replace(digest=digest)


def diff(base: Tree, cur: Tree) -> List[Tuple[str, str, bool]]:
    """(change, relpath, restorable) for each difference, parents before children.

    Added entries are restorable (they can be removed); an added directory is
    reported once, not with everything inside it. A deleted or modified file
    is not (its content was never saved); metadata-only changes, deleted
    directories and symlinks are (their recorded state suffices).
    """
    out: List[Tuple[str, str, bool]] = []
    added_dirs: List[str] = []
    for rel in sorted(cur.keys() - base.keys()):
        if any(rel.startswith(d + "/") for d in added_dirs[-1:]):
            continue
        out.append(("added", rel, True))
        if cur[rel].kind == "d":
            added_dirs.append(rel)
    for rel in sorted(base.keys() - cur.keys()):
        out.append(("deleted", rel, base[rel].kind in ("d", "l")))
    for rel in sorted(base.keys() & cur.keys()):
        b, c = base[rel], cur[rel]
        if b.kind != c.kind:
            out.append(("type_changed", rel, False))
        elif b.digest != c.digest:
            out.append(("modified" if b.kind == "f" else "link_changed", rel, b.kind == "l"))
        elif (b.mode, b.uid, b.gid) != (c.mode, c.uid, c.gid):
            out.append(("metadata_changed", rel, True))
        elif b.kind == "f" and b.mtime_ns != c.mtime_ns:
            out.append(("touched", rel, True))
    return out
