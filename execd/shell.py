"""One shell (the default session or a named one): serialises its calls, replaces a dead bash.

Calls into one shell are serialised by its lock, so concurrent requests never
mix their output; other shells and one-shot runs have their own. When bash
dies (``exit``, ``set -e``, ``exec``, an unwinding timeout that had to kill it),
the call that killed it still returns the status, and the next call starts a
fresh session in the starting directory and reports ``session_restarted: true``.
"""

from __future__ import annotations

import os
import threading
import time

from . import bashproto, errors, logs, proc
from .session import Call, Launch, Session, SessionError

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Optional, Tuple

    from .validate import Doc

log = logs.getLogger("execd.shell")


class Shell:
    def __init__(self, launch: Launch, runtime_dir: str, script_name: str = "command") -> None:
        self.launch = launch
        self.runtime_dir = runtime_dir
        self.script_name = script_name
        self.lock = threading.Lock()
        self.session: Optional[Session] = None
        self._restart_pending = False
        self.calls = 0
        self.restarts = 0

    def _ensure(self, consume: bool = True) -> Tuple[Session, bool]:
        session = self.session
        if session is not None and session.dead:
            self._discard()
            session = None
        if session is None:
            # One path for every session (they never overlap): the session's
            # shape (its alias text) must not differ after a restart.
            script = os.path.join(self.runtime_dir, self.script_name)
            try:
                session = Session(self.launch, script)
            except (SessionError, OSError) as exc:  # e.g. out of pids or memory
                raise errors.Unavailable("cannot start bash: %s" % exc, "session_failed") from None
            self.session = session
            restarted = self._restart_pending
            if restarted:
                self.restarts += 1
            # An internal query keeps the news for the next user call.
            self._restart_pending = restarted and not consume
            return session, restarted
        return session, False

    def _discard(self) -> None:
        session, self.session = self.session, None
        if session is None:
            return
        if not session.dead:
            session.kill()
            deadline = time.monotonic() + 5
            while not session.dead and time.monotonic() < deadline:
                time.sleep(0.002)
        session.close()
        self._restart_pending = True

    def start(self) -> None:
        with self.lock:
            self._ensure()

    def _run(
        self, command: str, timeout: float, cap: int, consume: bool = True
    ) -> Tuple[Call, bool]:
        session, restarted = self._ensure(consume)
        self.calls += 1
        call = session.run(bashproto.next_call_id(), command, timeout, cap)
        if session.dead:
            self._discard()
        return call, restarted

    def run(self, command: str, timeout: float, cap: int) -> Doc:
        with self.lock:
            started = time.monotonic()
            call, restarted = self._run(command, timeout, cap)
            return {
                "exit_code": None if call.timed_out else call.exit_code,
                "stdout": call.out.text(),
                "stderr": call.err.text(),
                "timed_out": call.timed_out,
                "truncated": call.out.truncated or call.err.truncated,
                "stdout_bytes": call.out.total,
                "stderr_bytes": call.err.total,
                "duration_s": round(time.monotonic() - started, 6),
                "session_restarted": restarted,
            }

    def query(self, command: str, timeout: float = 10.0) -> Tuple[Optional[int], bytes]:
        """Run an internal command (state capture); returns (status, raw stdout)."""
        with self.lock:
            call, _ = self._run(command, timeout, 64 * 1024 * 1024, consume=False)
        return (None if call.timed_out else call.exit_code), call.out.raw()

    def reset(self) -> int:
        """Kill every process below execd and start a fresh bash in the workdir.

        The killing happens before taking the lock: a command still running
        (with a long timeout) ends at once because its bash dies, instead of
        holding the reset back until it times out.
        """
        me = os.getpid()
        killed = proc.kill_tree(lambda t: proc.descendants(t, [me]))
        with self.lock:
            killed += proc.kill_tree(lambda t: proc.descendants(t, [me]))
            self._discard()
            self._restart_pending = False
            self._ensure()
            return max(0, killed - 1)  # the old bash itself is not counted

    def close(self) -> None:
        """At shutdown: kill everything below execd, start nothing."""
        with self.lock:
            me = os.getpid()
            proc.kill_tree(lambda t: proc.descendants(t, [me]))
            self._discard()

    def discard(self) -> int:
        """Kill this shell's bash and everything below it, for good (a named session's
        close). The kill comes first, so a running call ends now, not at its timeout."""
        session = self.session
        killed = session.kill() if session is not None else 0
        with self.lock:
            self._discard()
        return max(0, killed - 1)  # bash itself is not counted

    def restart(self) -> None:
        """Fresh bash, same processes otherwise (used by restore)."""
        with self.lock:
            self._discard()
            self._restart_pending = False
            self._ensure()

    def info(self) -> Doc:
        session = self.session
        return {
            "session_pid": None if session is None or session.dead else session.pid,
            "session_restarts": self.restarts,
            "calls": self.calls,
        }
