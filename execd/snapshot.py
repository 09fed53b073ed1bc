"""Snapshot capture and restore of the workspace roots: files, modes, symlinks, shell state.

Why execd walks the tree (and the broker does not read the overlay's upper dir): on the
local backend the workdir is a bind-mounted directory outside the overlay, so the upper
dir does not hold the workspace's changes at all, and on Kubernetes the broker cannot
reach a pod's filesystem. execd sees exactly what the agent sees, on every backend.

What a snapshot is: the complete listing of each root (kind, mode, size, SHA-256 or link
target) and the shell's cwd and exported variables; running processes are not captured.
A restore makes each root of a fresh sandbox equal to that listing: extra entries are
deleted (so deletions survive without whiteouts), missing or different files are written
from the blobs the broker streams in (``put``, verified against their SHA-256 while they
are written), directories and symlinks are recreated, modes set, and then the whole tree
is scanned again and compared, so a restore that does not match fails loudly.

The calls, in order: ``capture`` (listing), ``blob`` (raw bytes of one file, streamed);
on the fresh sandbox ``prepare`` (deletions, directories, which files need content),
``put`` (all the files to write, one streamed pack) or, where the backend can place the
blobs in a directory bound read-only into the sandbox (the local backend), ``copy``
(the same files read from there: no HTTP body, no worker in the data path), then
``finish`` (links, modes, verify, shell state).
Owners, times and special files (FIFOs, sockets, devices) are not restored, nor the
variables that name the sandbox itself (``OWN_VARS``: the new sandbox keeps its own).
"""

from __future__ import annotations

import json
import os
import stat

from . import errors, files, sessionstate, treescan
from .errors import suppress
from .server import Close, Request, Response
from .shell import Shell

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

    from .validate import Doc

PIECE = 1 << 20
MAX_REPORT = 50
MAX_HEAD = 65536  # one file's JSON head in a put pack
# Exported variables naming the sandbox itself, not its state: a restore keeps the new
# sandbox's own (a pod's HOSTNAME is its name; a fork must not take its source's).
OWN_VARS = frozenset({"HOSTNAME"})


def git_top(path: str) -> Optional[str]:
    """The repository ``path`` is in (the nearest ancestor holding .git), if any."""
    cur = path
    while True:
        if os.path.exists(os.path.join(cur, ".git")):
            return cur
        parent = os.path.dirname(cur)
        if parent == cur:
            return None
        cur = parent


def default_roots(workdir: str) -> List[str]:
    """The workdir and, when it is inside a git repository, that repository."""
    top = git_top(workdir)
    return [top] if top is not None and top != "/" else [workdir]


def normal_roots(roots: List[str]) -> List[str]:
    """Absolute, normalized, and none inside another (the outer one covers it)."""
    out: List[str] = []
    for root in sorted(set(os.path.normpath(r) for r in roots)):
        if root == "/":
            raise errors.BadRequest("a snapshot root cannot be /", "invalid_field")
        if not any(root == o or root.startswith(o + "/") for o in out):
            out.append(root)
    return out


def _join(root: str, rel: str) -> str:
    return root if not rel else root + "/" + rel


def _entry_doc(path: str, e: treescan.Entry) -> Doc:
    return {"p": path, "k": e.kind, "m": e.mode, "s": e.size, "d": e.digest}


class Snapshots:
    """The snapshot routes of one execd."""

    def __init__(self, shell: Shell, workdir: str, rundir: str, umask: int) -> None:
        self.shell = shell
        self.workdir = workdir
        self.rundir = rundir
        self.umask = umask
        # What prepare saw and put wrote (absolute paths): finish's verify re-hashes only
        # files whose stat changed since (the state-check's carry-over), so a restore
        # hashes each byte it writes once, not twice.
        self._known: Dict[str, treescan.Entry] = {}

    def _skip(self, root: str) -> List[str]:
        rel = os.path.relpath(self.rundir, root)
        return [] if rel.startswith("..") else [rel]

    def _scan(
        self, roots: List[str], known: Optional[Dict[str, treescan.Entry]] = None
    ) -> Dict[str, treescan.Entry]:
        tree: Dict[str, treescan.Entry] = {}
        for root in roots:
            prev = None
            if known:
                prefix = root + "/"
                prev = {p[len(prefix) :]: e for p, e in known.items() if p.startswith(prefix)}
            for rel, e in treescan.scan(root, self._skip(root), prev).items():
                tree[_join(root, rel)] = e
        return tree

    def _roots(self, doc: Doc) -> List[str]:
        roots = doc.get("roots")
        if roots is None:
            return normal_roots(default_roots(self.workdir))  # a workdir of / is refused
        if (
            not isinstance(roots, list)
            or not roots
            or not all(isinstance(r, str) and r.startswith("/") for r in roots)
        ):
            raise errors.BadRequest("'roots' must be a list of absolute paths", "invalid_field")
        return normal_roots(roots)

    # ---- capture -----------------------------------------------------------

    def capture(self, doc: Doc) -> Doc:
        roots = self._roots(doc)
        for root in roots:
            if not os.path.isdir(root):
                raise errors.NotFound("snapshot root is not a directory: %s" % root)
        entries = []
        for path, e in sorted(self._scan(roots).items()):
            if e.kind == "o":
                continue  # FIFOs, sockets, devices: not state a restore can recreate
            if e.digest == "unreadable":
                raise errors.Unprocessable("cannot read %s" % path, "unreadable")
            entries.append(_entry_doc(path, e))
        session = sessionstate.capture(self.shell)
        if session is None:
            raise errors.Unavailable("could not read the session state", "session_unreadable")
        return {
            "roots": roots,
            "entries": entries,
            "session": {"cwd": session["cwd"], "env": session["env"]},
        }

    def blob(self, doc: Doc) -> Response:
        """One file's raw bytes (the caller hashes them: a file changed since the capture
        no longer matches its listing and the capture is refused there)."""
        path = doc.get("path")
        if not isinstance(path, str) or not path.startswith("/"):
            raise errors.BadRequest("'path' must be an absolute path", "invalid_field")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise files.os_error(exc, path) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise errors.BadRequest("not a regular file: %s" % path, "not_regular_file")
        return Response(200, chunks=_raw(fd, st.st_size), length=st.st_size)

    # ---- restore -----------------------------------------------------------

    def prepare(self, doc: Doc) -> Doc:
        """Delete what the listing lacks, create its directories; list the files to put."""
        roots, want = _listing(doc)
        for root in roots:
            os.makedirs(root, exist_ok=True)
        cur = self._scan(roots)
        gone: Set[str] = set()
        for path in sorted(cur):  # parents first: a removed directory takes its children
            e = cur[path]
            w = want.get(path)
            if (w is not None and w["k"] == e.kind) or _under(path, gone):
                continue
            _remove(path, e.kind)
            gone.add(path)
        need = []
        for path in sorted(want):
            w = want[path]
            if w["k"] == "d":
                os.makedirs(path, exist_ok=True)
                os.chmod(path, 0o700 | w["m"])  # writable until finish sets its mode
            elif w["k"] == "f":
                old = None if path in gone or _under(path, gone) else cur.get(path)
                if old is None or old.digest != w["d"] or old.size != w["s"]:
                    if old is not None:
                        os.unlink(path)  # a read-only old version must not block the put
                    need.append({"p": path, "d": w["d"], "s": w["s"]})
        self._known = {p: e for p, e in cur.items() if p not in gone and not _under(p, gone)}
        return {"need": need, "deleted": len(gone)}

    def put(self, req: Request, stream: Any) -> Doc:
        """Write files from one raw body, a pack: per file a JSON line ``{"p": path,
        "s": size, "d": sha256, "m": mode}`` and then exactly ``s`` bytes. One request for
        all of a restore's files (a request per file cost more than small files' bytes);
        each file is written atomically and its size and SHA-256 verified as it lands."""
        raw = req.headers.get("content-length", "")
        if not raw.isdigit():
            raise errors.LengthRequired("Content-Length is required")
        left = int(raw)
        req.body = b""  # read below; a failure part way closes the connection
        written = 0
        try:
            while left > 0:
                line = stream.readline(MAX_HEAD + 1)
                left -= len(line)
                path, size, sha, mode = _pack_head(line, left)
                left -= size
                self._write_one(_body(stream, size), path, size, sha, mode)
                written += 1
        except errors.Unprocessable:
            req.keep_alive = req.keep_alive and left == 0  # the body was read to its end
            raise
        except BaseException:
            req.keep_alive = False  # the rest of the body is unread: the framing is lost
            raise
        return {"ok": True, "files": written}

    def copy(self, doc: Doc) -> Doc:
        """Write files from blobs the backend placed in a local directory (``dir``, one
        file per SHA-256, bound read-only into this sandbox), the same files a ``put``
        pack would carry: ``files`` is a list of ``{"p", "s", "d", "m"}``. Each blob is
        read once, hashed and written in the same pass; its size and SHA-256 are checked
        exactly as for a put, so a corrupted store is still caught here."""
        src, todo = doc.get("dir"), doc.get("files")
        if not isinstance(src, str) or not src.startswith("/") or not isinstance(todo, list):
            raise errors.BadRequest("'dir' (absolute) and 'files' are required", "invalid_field")
        buf = bytearray(PIECE)
        for item in todo:
            path, size, sha, mode = _file_head(item, 1 << 62)
            try:
                fd = os.open(
                    os.path.join(src, sha),
                    os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                )
            except OSError as exc:
                raise files.os_error(exc, os.path.join(src, sha)) from None
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise errors.BadRequest("blob %s is not a regular file" % sha, "invalid_pack")
                self._write_one(_pieces(fd, size, buf), path, size, sha, mode)
            finally:
                os.close(fd)
        return {"ok": True, "files": len(todo)}

    def _write_one(self, pieces: Iterator[Any], path: str, size: int, sha: str, mode: int) -> None:
        """One restored file: written beside its place, hashed on the way, renamed in only
        when size and SHA-256 match. Not fsynced: a restored sandbox does not outlive its
        host, so durability would cost the disk's bandwidth and buy nothing."""
        if os.path.islink(path):
            os.unlink(path)  # never write through a link the listing does not have
        parent = os.path.dirname(path)
        tmp = os.path.join(
            parent, ".%s.restore-%s" % (os.path.basename(path)[:64], os.urandom(6).hex())
        )
        try:
            os.makedirs(parent, exist_ok=True)
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
            )
        except OSError as exc:
            raise files.os_error(exc, path) from None
        import hashlib  # loads libcrypto (3 MiB): only when a restore writes

        digest, got = hashlib.sha256(), 0
        try:
            try:
                for piece in pieces:
                    digest.update(piece)
                    got += len(piece)
                    view = memoryview(piece)
                    while view:
                        view = view[os.write(fd, view) :]
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
            if got != size or digest.hexdigest() != sha:
                raise errors.Unprocessable(
                    "blob for %s does not match its listing (%d bytes, sha256 %s; expected"
                    " %d bytes, %s)" % (path, got, digest.hexdigest(), size, sha),
                    "blob_mismatch",
                )
            os.rename(tmp, path)
        except BaseException as exc:
            with suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, OSError):
                raise files.os_error(exc, path) from None
            raise
        st = os.lstat(path)
        self._known[path] = treescan.Entry(
            "f", stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ctime_ns,
            st.st_ino, st.st_uid, st.st_gid, sha,
        )  # fmt: skip

    def finish(self, doc: Doc) -> Doc:
        """Symlinks, modes, then a full rescan compared with the listing; then the shell."""
        roots, want = _listing(doc)
        for path in sorted(want):
            w = want[path]
            if w["k"] == "l":
                if os.path.lexists(path):
                    if os.path.islink(path) and os.readlink(path) == w["d"]:
                        continue
                    _remove(path, "d" if os.path.isdir(path) and not os.path.islink(path) else "f")
                os.symlink(w["d"], path)
            elif w["k"] == "f" and stat.S_IMODE(os.lstat(path).st_mode) != w["m"]:
                os.chmod(path, w["m"])  # only when needed: a chmod costs the verify a re-hash
        for path in sorted(want, key=len, reverse=True):  # a read-only parent last
            if want[path]["k"] == "d":
                os.chmod(path, want[path]["m"])
        wrong = _compare(want, self._scan(roots, self._known))
        self._known = {}
        if wrong:
            raise errors.Unprocessable(
                "restored tree differs from the snapshot at %d paths: %s"
                % (len(wrong), "; ".join(wrong[:MAX_REPORT])),
                "restore_mismatch",
            )
        session = doc.get("session")
        if isinstance(session, dict):
            self._restore_session(session)
        return {"ok": True, "entries": len(want)}

    def _restore_session(self, saved: Doc) -> None:
        fresh = sessionstate.capture(self.shell)
        if fresh is None:
            raise errors.Unavailable("could not read the session state", "session_unreadable")
        env = {k: v for k, v in saved.get("env", {}).items() if k not in OWN_VARS}
        env.update((k, v) for k, v in fresh["env"].items() if k in OWN_VARS)
        base = sessionstate.SessionState(cwd=saved.get("cwd", "/"), env=env)
        status, _ = self.shell.query(sessionstate.apply_script(base, fresh))
        if status != 0:
            raise errors.Unprocessable("could not restore the shell's cwd and environment")


def _listing(doc: Doc) -> Tuple[List[str], Dict[str, Doc]]:
    roots, entries = doc.get("roots"), doc.get("entries")
    if not isinstance(roots, list) or not isinstance(entries, list):
        raise errors.BadRequest("'roots' and 'entries' are required", "invalid_field")
    roots = normal_roots([str(r) for r in roots])
    want: Dict[str, Doc] = {}
    for e in entries:
        path = e.get("p") if isinstance(e, dict) else None
        if not isinstance(path, str) or not any(
            path == r or path.startswith(r + "/") for r in roots
        ):
            raise errors.BadRequest("entry outside the roots: %r" % (path,), "invalid_field")
        if e.get("k") not in ("f", "d", "l"):
            raise errors.BadRequest("entry of unknown kind: %r" % (path,), "invalid_field")
        want[os.path.normpath(path)] = e
    return roots, want


def _pack_head(line: bytes, left: int) -> Tuple[str, int, str, int]:
    """One file's head in a put pack: (path, size, sha256, mode), checked."""
    if not line.endswith(b"\n") or len(line) > MAX_HEAD:
        raise errors.BadRequest("a pack head must be one JSON line", "invalid_pack")
    try:
        head = json.loads(line.decode("utf-8", "surrogateescape"))
    except ValueError:
        raise errors.BadRequest("a pack head needs p, s, d and m", "invalid_pack") from None
    return _file_head(head, left)


def _file_head(head: Any, left: int) -> Tuple[str, int, str, int]:
    """One file to write (a pack head or a copy item): (path, size, sha256, mode)."""
    try:
        path, size, sha, mode = head["p"], head["s"], head["d"], head["m"]
    except (KeyError, TypeError):
        raise errors.BadRequest("a file to write needs p, s, d and m", "invalid_pack") from None
    if not (
        isinstance(path, str)
        and path.startswith("/")
        and isinstance(size, int)
        and 0 <= size <= left
        and isinstance(sha, str)
        and len(sha) == 64
        and all(c in "0123456789abcdef" for c in sha)
        and isinstance(mode, int)
    ):
        raise errors.BadRequest("a file head is malformed or runs past the body", "invalid_pack")
    return path, size, sha, mode & 0o7777


def _under(path: str, dirs: Set[str]) -> bool:
    """Whether an ancestor of ``path`` is in ``dirs``."""
    cur = os.path.dirname(path)
    while cur not in ("/", ""):
        if cur in dirs:
            return True
        cur = os.path.dirname(cur)
    return False


def _compare(want: Dict[str, Doc], cur: Dict[str, treescan.Entry]) -> List[str]:
    wrong = ["extra %s" % p for p in sorted(cur.keys() - want.keys()) if cur[p].kind != "o"]
    for path in sorted(want):
        w, e = want[path], cur.get(path)
        if e is None:
            wrong.append("missing %s" % path)
        elif (e.kind, e.mode, e.digest) != (w["k"], w["m"], w["d"]) or (
            e.kind == "f" and e.size != w["s"]
        ):
            wrong.append("differs %s" % path)
    return wrong


def _remove(path: str, kind: str) -> None:
    if kind == "d":
        for sub, dirs, _ in os.walk(path):  # read-only directories would stop rmtree
            for d in dirs:
                p = os.path.join(sub, d)
                if not os.path.islink(p):
                    os.chmod(p, 0o700)
        os.chmod(path, 0o700)
        import shutil  # rare: not worth its memory at start

        shutil.rmtree(path)
    else:
        os.unlink(path)


def _raw(fd: int, size: int) -> Iterator[bytes]:
    try:
        left = size
        while left:
            data = os.read(fd, min(PIECE, left))
            if not data:
                raise Close()  # the file shrank: the promised length is a lie now
            left -= len(data)
            yield data
    finally:
        os.close(fd)


def _pieces(fd: int, size: int, buf: bytearray) -> Iterator[Any]:
    """``size`` bytes of ``fd`` (a blob), in one reused buffer; a short blob stops early
    and the size check reports it."""
    view = memoryview(buf)
    left = size
    while left:
        n = os.readv(fd, [view[: min(PIECE, left)]])
        if not n:
            return
        left -= n
        yield view[:n]
    if os.read(fd, 1):
        yield b"\0"  # longer than listed: the size check fails


def _body(stream: Any, size: int) -> Iterator[bytes]:
    left = size
    while left:
        data = stream.read(min(PIECE, left))
        if not data:
            raise Close()
        left -= len(data)
        yield data
