"""Baseline, state check and restore: what makes reusing a sandbox safe.

A baseline records the workspace tree (kind, mode, owner, size, times, SHA-256),
optional watched paths outside it, the processes below execd, and the
session's cwd, exported environment and shape. The check classifies each
difference:

restorable (restore undoes it exactly)
    files:     entries added in the workspace (removed), mode/owner changes,
               mtime-only changes (content hash equal), deleted directories
               and changed or deleted symlinks (recreated from the record)
    processes: processes that were not there (killed, with their trees)
    session:   cwd, exported variables, functions/aliases/options/traps
               (bash is restarted and the baseline cwd and env re-applied)
not restorable (the broker must delete the sandbox)
    files:     modified or deleted regular files, type changes (the content
               was never saved), anything changed under a watched path
               outside the workspace, which execd never touches
    processes: baseline processes that are gone

``clean`` is true only when no difference at all remains.
"""

from __future__ import annotations

import os
import threading
import time

from . import errors, proc, sessionstate, treescan, validate
from .shell import Shell

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Dict, List, NamedTuple, Optional, Set, Tuple

    from .validate import Doc
else:
    from .records import NamedTuple

MAX_ITEMS = 200


class Baseline(NamedTuple):
    """What ``/v1/baseline`` recorded; the check and the restore compare against it.

    (A NamedTuple, not a dataclass: ``dataclasses`` costs every sandbox 1 MiB at start.)"""

    root: str
    watch: List[str]
    skip: Dict[str, List[str]]
    tree: treescan.Tree
    watched: Dict[str, treescan.Tree]
    procs: Dict[Tuple[int, int], str]
    session: sessionstate.SessionState


class StateKeeper:
    def __init__(self, shell: Shell, workdir: str, rundir: str) -> None:
        self.shell = shell
        self.workdir = workdir
        self.rundir = rundir
        self.base: Optional[Baseline] = None
        self._lock = threading.Lock()

    # ---- capture -----------------------------------------------------------

    def _skips(self, root: str, extra: List[str]) -> List[str]:
        skip = [e.strip("/") for e in extra]
        rel = os.path.relpath(self.rundir, root)
        if not rel.startswith(".."):
            skip.append(rel)  # our own runtime dir is never sandbox state
        return skip

    def _procs(self) -> Dict[Tuple[int, int], str]:
        table = proc.proc_table()
        session = self.shell.session
        mine = proc.descendants(table, [os.getpid()])
        if session is not None:
            mine.discard(session.pid)
        return {(p, table[p].start): proc.cmdline(p) for p in mine if p in table}

    def baseline(self, doc: Doc) -> Doc:
        root = os.path.normpath(validate.abs_path(doc, "root", self.workdir))
        watch = doc.get("watch", [])
        exclude = doc.get("exclude", [])
        for name, value in (("watch", watch), ("exclude", exclude)):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise errors.BadRequest(
                    "field %r must be a list of strings" % name, "invalid_field"
                )
        if not all(w.startswith("/") for w in watch):
            raise errors.BadRequest("field 'watch' must hold absolute paths", "relative_path")
        if not os.path.isdir(root):
            raise errors.NotFound("root is not a directory: %s" % root, "file_not_found")
        started = time.monotonic()
        with self._lock:
            skip = {root: self._skips(root, exclude)}
            skip.update({w: self._skips(w, []) for w in watch})
            tree = treescan.scan(root, skip[root])
            watched = {w: treescan.scan(w, skip[w]) for w in watch}
            session = sessionstate.capture(self.shell)
            if session is None:
                raise errors.Unavailable("could not read the session state", "session_unreadable")
            self.base = Baseline(
                root=root,
                watch=watch,
                skip=skip,
                tree=tree,
                watched=watched,
                procs=self._procs(),
                session=session,
            )
        files = [e for e in tree.values() if e.kind == "f"]
        return {
            "ok": True,
            "root": root,
            "entries": len(tree),
            "files": len(files),
            "bytes": sum(e.size for e in files),
            "processes": len(self.base.procs),
            "duration_s": round(time.monotonic() - started, 4),
        }

    # ---- compare -----------------------------------------------------------

    def _compare(self, base: Baseline) -> Tuple[List[Doc], List[Doc], Doc]:
        restorable: List[Doc] = []
        blocked: List[Doc] = []
        cur_tree = treescan.scan(base.root, base.skip[base.root], base.tree)
        for change, rel, ok in treescan.diff(base.tree, cur_tree):
            item = {"area": "files", "change": change, "path": _join(base.root, rel)}
            (restorable if ok else blocked).append(item)
        for w, wtree in base.watched.items():
            for change, rel, _ in treescan.diff(wtree, treescan.scan(w, base.skip[w], wtree)):
                blocked.append({"area": "watched", "change": change, "path": _join(w, rel)})
        procs = self._procs()
        for key in sorted(procs.keys() - base.procs.keys()):
            restorable.append(
                {"area": "processes", "change": "added", "pid": key[0], "cmdline": procs[key]}
            )
        for key in sorted(base.procs.keys() - procs.keys()):
            blocked.append(
                {"area": "processes", "change": "gone", "pid": key[0], "cmdline": base.procs[key]}
            )
        for change, what in sessionstate.diff(base.session, sessionstate.capture(self.shell)):
            restorable.append({"area": "session", "change": change, "name": what})
        return restorable, blocked, {"tree": cur_tree, "procs": procs}

    def _need_base(self) -> Baseline:
        if self.base is None:
            raise errors.Conflict("no baseline recorded: POST /v1/baseline first", "no_baseline")
        return self.base

    def check(self, _doc: Doc) -> Doc:
        started = time.monotonic()
        with self._lock:
            restorable, blocked, _ = self._compare(self._need_base())
        return _report(restorable, blocked, started)

    # ---- restore -----------------------------------------------------------

    def restore(self, _doc: Doc) -> Doc:
        started = time.monotonic()
        with self._lock:
            base = self._need_base()
            restorable, _, cur = self._compare(base)
            # Processes first (they could recreate files), then files, then the shell.
            order = {"processes": 0, "files": 1}
            items = sorted(
                (i for i in restorable if i["area"] in order), key=lambda i: order[i["area"]]
            )
            done = [self._undo(base, item, cur) for item in items]
            if any(i["area"] == "session" for i in restorable):
                done.append(self._restore_session(base))
            restorable, blocked, _ = self._compare(base)
        out = _report(restorable, blocked, started)
        out["restored"] = sum(1 for ok in done if ok)
        out["failed"] = sum(1 for ok in done if not ok)
        return out

    def _undo(self, base: Baseline, item: Doc, cur: Doc) -> bool:
        try:
            if item["area"] == "processes":
                return self._kill(item["pid"], cur["procs"])
            return _undo_file(base, item["change"], item["path"])
        except OSError:
            return False

    def _kill(self, pid: int, procs: Dict[Tuple[int, int], str]) -> bool:
        starts = {key[1] for key in procs if key[0] == pid}

        def select(table: proc.Table) -> Set[int]:
            if pid in table and table[pid].start in starts:
                return {pid} | proc.descendants(table, [pid])
            return set()

        proc.kill_tree(select)
        return True

    def _restore_session(self, base: Baseline) -> bool:
        self.shell.restart()
        fresh = sessionstate.capture(self.shell)
        if fresh is None:
            return False
        status, _ = self.shell.query(sessionstate.apply_script(base.session, fresh))
        return status == 0


def _join(root: str, rel: str) -> str:
    return root if not rel else os.path.join(root, rel)


def _undo_file(base: Baseline, change: str, path: str) -> bool:
    rel = os.path.relpath(path, base.root)
    entry = base.tree.get("" if rel == "." else rel)
    if change == "added":
        if os.path.isdir(path) and not os.path.islink(path):
            import shutil  # rare: not worth its memory at start

            shutil.rmtree(path)
        else:
            os.unlink(path)
        return True
    if entry is None:
        return False
    if change == "deleted" and entry.kind == "d":
        os.makedirs(path, exist_ok=True)
    elif change in ("deleted", "link_changed") and entry.kind == "l":
        if os.path.lexists(path):
            os.unlink(path)
        os.symlink(entry.digest, path)
        os.lchown(path, entry.uid, entry.gid)
        return True
    if change in ("deleted", "metadata_changed", "touched"):
        os.lchown(path, entry.uid, entry.gid)  # before chmod: chown clears setuid bits
        os.chmod(path, entry.mode)
        if entry.kind == "f":
            st = os.stat(path)
            os.utime(path, ns=(st.st_atime_ns, entry.mtime_ns))
        return True
    return False


def _report(restorable: List[Doc], blocked: List[Doc], started: float) -> Doc:
    return {
        "clean": not restorable and not blocked,
        "restorable_count": len(restorable),
        "unrestorable_count": len(blocked),
        "restorable": restorable[:MAX_ITEMS],
        "unrestorable": blocked[:MAX_ITEMS],
        "duration_s": round(time.monotonic() - started, 4),
    }
