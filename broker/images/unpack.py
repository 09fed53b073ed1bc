"""Apply image layers, in order, to a directory: the image's root filesystem.

What a container runtime does, with nothing trusted from the archive:
- whiteouts: ``.wh.NAME`` deletes NAME of the layers below, ``.wh..wh..opq`` empties its
  directory of them. They are applied in a first pass over each layer, before its own
  entries, because they only ever refer to lower layers (and a tar is in no set order).
- owners, modes (setuid bits included) and mtimes as recorded; ownership only when this
  process is root (it is for the broker; an unprivileged import keeps its own uid).
- symlinks are created as they are (absolute targets point inside the sandbox, where
  they are resolved) and never followed here; hard links must name an entry of the root.
- refused with ImageInvalid: absolute names, ``..``, a name whose parent directory is a
  symlink (the classic "link to /etc, then write through it"), hard links outside the
  root, and device nodes (a block device in a rootfs is a host disk). Extended attributes
  (file capabilities) are dropped: sandboxes run with every capability dropped anyway.
"""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
from pathlib import Path
from typing import IO

from broker.errors import ImageInvalid

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
_CHUNK = 1 << 20


def safe_name(name: str) -> str:
    """The archive name as a relative path inside the root ('' for the root itself)."""
    if name.startswith("/"):
        raise ImageInvalid(f"layer entry with an absolute path: {name!r}")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise ImageInvalid(f"layer entry escapes the root: {name!r}")
    if any("\0" in p for p in parts):
        raise ImageInvalid(f"layer entry with a NUL byte: {name!r}")
    return "/".join(parts)


def _parent_dir(root: Path, rel: str) -> Path:
    """The entry's parent inside ``root``, created as plain directories; a symlink (or a
    non-directory) anywhere on the way is refused, so nothing is ever written outside."""
    current = root
    for part in rel.split("/")[:-1]:
        current = current / part
        try:
            mode = current.lstat().st_mode
        except FileNotFoundError:
            current.mkdir(mode=0o755)
            continue
        if stat.S_ISLNK(mode):
            raise ImageInvalid(f"layer entry {rel!r} goes through the symlink {part!r}")
        if not stat.S_ISDIR(mode):
            raise ImageInvalid(f"layer entry {rel!r}: {part!r} is not a directory")
    return current


def _existing_parent(root: Path, rel: str, *, missing_ok: bool = False) -> Path | None:
    """Like _parent_dir, for an entry that refers to what lower layers made (a whiteout, a
    hard link's source): nothing is created; a symlink on the way is refused."""
    current = root
    for part in rel.split("/")[:-1]:
        current = current / part
        if missing_ok and not os.path.lexists(current):
            return None
        if current.is_symlink() or not current.is_dir():
            raise ImageInvalid(f"layer entry {rel!r} does not stay inside the root")
    return current


def _remove(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        path.unlink()


def _apply_whiteouts(root: Path, members: list[tarfile.TarInfo]) -> None:
    for member in members:
        rel = safe_name(member.name)
        base = rel.rsplit("/", 1)[-1]
        if not base.startswith(WHITEOUT):
            continue
        parent = _existing_parent(root, rel, missing_ok=True)
        if parent is None:
            continue  # nothing below to hide
        if base == OPAQUE:
            for child in list(parent.iterdir()):
                _remove(child)
        else:
            target = base[len(WHITEOUT) :]
            if target in ("", ".", ".."):  # ".wh..." would whiten the parent, or above it
                raise ImageInvalid(f"layer entry {member.name!r}: a whiteout of {target!r}")
            _remove(parent / target)


def _set_meta(path: Path, member: tarfile.TarInfo, *, as_root: bool) -> None:
    if as_root:
        os.chown(path, member.uid, member.gid, follow_symlinks=False)
    if not member.issym():
        os.chmod(path, member.mode & 0o7777)
    os.utime(path, (member.mtime, member.mtime), follow_symlinks=False)


def _extract(root: Path, member: tarfile.TarInfo, data: IO[bytes] | None, *, as_root: bool) -> None:
    rel = safe_name(member.name)
    if not rel:  # the root directory itself: keep ours, take its mode
        os.chmod(root, (member.mode & 0o7777) or 0o755)
        return
    target = _parent_dir(root, rel) / rel.rsplit("/", 1)[-1]
    if member.isdir():
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            _remove(target)
        target.mkdir(exist_ok=True)
    elif member.isreg():
        _remove(target)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            if data is not None:
                shutil.copyfileobj(data, out, _CHUNK)
    elif member.issym():
        _remove(target)
        os.symlink(member.linkname, target)
    elif member.islnk():
        linked = safe_name(member.linkname)
        parent = _existing_parent(root, linked)
        assert parent is not None
        source = parent / linked.rsplit("/", 1)[-1]
        if not linked or not os.path.lexists(source) or source.is_dir():
            raise ImageInvalid(f"hard link {rel!r} to a missing entry {member.linkname!r}")
        _remove(target)
        os.link(source, target, follow_symlinks=False)
        return  # a hard link shares the inode (and the metadata) of its source
    elif member.isfifo():
        _remove(target)
        os.mkfifo(target)
    else:
        raise ImageInvalid(f"layer entry {rel!r} is a device node or of an unknown type")
    _set_meta(target, member, as_root=as_root)


def apply_layer(root: Path, layer: Path) -> None:
    """Apply one layer (plain, gzip, bzip2 or xz tar) on top of ``root``."""
    try:
        with tarfile.open(layer, "r:*") as tar:
            members = tar.getmembers()
            _apply_whiteouts(root, members)
            as_root = os.geteuid() == 0
            for member in members:
                if member.name.rsplit("/", 1)[-1].startswith(WHITEOUT):
                    continue
                data = tar.extractfile(member) if member.isreg() else None
                _extract(root, member, data, as_root=as_root)
    except (tarfile.TarError, EOFError) as exc:
        raise ImageInvalid(f"layer {layer.name} is not a readable tar: {exc}") from exc


def unpack(root: Path, layers: list[Path]) -> None:
    """Apply ``layers`` (lowest first) to the empty directory ``root``."""
    for layer in layers:
        apply_layer(root, layer)
