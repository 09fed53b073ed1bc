"""The one place that waits for children: reaps orphans, dispatches owned exits.

execd is usually PID 1, and otherwise registers as a child subreaper, so every
orphan of the session is re-parented to it and must be reaped or zombies pile
up. A second ``waitpid`` anywhere else would race this loop and could steal the
exit status of the bash session. So this thread is the only caller of
``waitpid`` in the process: it reaps everything, and for pids registered by
``spawn`` it hands the status to the owner's callback instead of dropping it.
Spawning and registering happen under the same lock the loop takes before
classifying a pid, so a child that exits instantly is still recognised.
"""

from __future__ import annotations

import os
import threading
import types

from . import logs

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Mapping

log = logs.getLogger("execd.reaper")

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Adopt orphans of our descendants (not needed, and harmless, as PID 1)."""
    if os.getpid() == 1:
        return True
    try:
        errno = libc_call("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (ImportError, OSError, AttributeError) as exc:
        log.warning("cannot become a child subreaper: %s", exc)
        return False
    if errno:
        log.warning("prctl(PR_SET_CHILD_SUBREAPER) failed: errno %d", errno)
        return False
    return True


def libc_call(name: str, *args: int) -> int:
    """Call the C library's ``int name(...)`` with int arguments: 0 if it returned 0,
    else its errno (-1 if it set none).

    Through ``_ctypes``, the C half of ``ctypes``: the Python half (``ctypes/__init__``,
    its dozens of classes, ``struct``) would cost every sandbox 0.3 MiB more at start,
    for this one call. These few lines are what ``ctypes.CDLL(None, use_errno=True)``
    and its ``c_int`` result type amount to.
    """
    import _ctypes

    # (typeshed describes these as ctypes' own classes use them: hence the ignores)
    class CInt(_ctypes._SimpleCData):  # type: ignore[type-arg]
        _type_ = "i"

    class Function(_ctypes.CFuncPtr):
        _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
        _restype_ = CInt

    handle = _ctypes.dlopen(None, _ctypes.RTLD_LOCAL)  # type: ignore[arg-type]
    libc = types.SimpleNamespace(_handle=handle)
    function = Function((name, libc))  # type: ignore[arg-type]  # CDLL(None)[name]
    if function(*args) == 0:
        return 0
    return _ctypes.get_errno() or -1


def exit_code(status: int) -> int:
    """Shell convention: the exit status, or 128 + N for death by signal N."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return 255


class Reaper:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owned: Dict[int, Callable[[int], None]] = {}
        self._have_children = threading.Event()
        self.orphans_reaped = 0

    def start(self) -> None:
        threading.Thread(target=self._loop, name="reaper", daemon=True).start()

    def spawn(
        self,
        path: str,
        argv: List[str],
        env: Mapping[str, str],
        on_exit: Callable[[int], None],
        **kwargs: Any,
    ) -> int:
        """posix_spawn a child whose exit status goes to ``on_exit(code)``."""
        return self.own(lambda: os.posix_spawn(path, argv, env, **kwargs), on_exit)

    def own(self, launch: Callable[[], int], on_exit: Callable[[int], None]) -> int:
        """Start a child with ``launch()`` (returns its pid) and own its exit status.

        ``launch`` runs under the lock the loop takes before classifying a pid,
        so a child that exits at once is still handed to ``on_exit``.
        """
        with self._lock:
            pid = launch()
            self._owned[pid] = on_exit
        self._have_children.set()
        return pid

    def _loop(self) -> None:
        while True:
            # Cleared before waiting: a spawn after this point either is seen by
            # waitpid or sets the event again, so no child waits 0.5 s unseen.
            self._have_children.clear()
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                self._have_children.wait(0.5)
                continue
            except OSError as exc:  # never let the reaper die
                log.error("waitpid failed: %s", exc)
                self._have_children.wait(0.1)
                continue
            with self._lock:
                callback = self._owned.pop(pid, None)
            if callback is None:
                self.orphans_reaped += 1
                continue
            try:
                callback(exit_code(status))
            except Exception:  # a broken callback must not stop reaping
                log.exception("exit callback for pid %d failed", pid)
