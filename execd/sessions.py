"""Named sessions beside the default one (SWE-ReX's ``create_session``, agents in parallel).

Each is a ``Shell`` of its own (its bash, its lock, its command file
``command-<name>`` in the runtime dir), so the default session, named sessions
and one-shot runs never wait for each other. Their number is bounded: one more
is refused at once (429). The registry's lock guards only the name table.
"""

from __future__ import annotations

import re
import threading

from . import errors
from .session import Launch
from .shell import Shell

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Dict, List, Optional

    from .validate import Doc

DEFAULT = "default"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")


class Sessions:
    def __init__(self, default: Shell, launch: Launch, runtime_dir: str, limit: int) -> None:
        self.default = default
        self.launch = launch
        self.runtime_dir = runtime_dir
        self.limit = limit
        self._named: Dict[str, Shell] = {}
        self._lock = threading.Lock()

    def get(self, name: Optional[str]) -> Shell:
        if name is None or name == DEFAULT:
            return self.default
        with self._lock:
            shell = self._named.get(name)
        if shell is None:
            raise errors.NotFound("no session %r (open it first)" % name[:100], "no_session")
        return shell

    def open(self, name: str) -> Doc:
        _check(name)
        with self._lock:
            if name in self._named:
                raise errors.Conflict("session %r is already open" % name, "session_exists")
            if len(self._named) >= self.limit:
                raise errors.TooManyRequests("%d named sessions are already open" % self.limit)
            shell = Shell(self.launch, self.runtime_dir, "command-" + name)
            shell.start()  # bash up before the name is visible: no call finds it half-made
            self._named[name] = shell
        session = shell.session
        return {"name": name, "pid": session.pid if session is not None else None}

    def close(self, name: str) -> Doc:
        _check(name)
        with self._lock:
            shell = self._named.pop(name, None)
        if shell is None:
            raise errors.NotFound("no session %r" % name[:100], "no_session")
        return {"ok": True, "killed": shell.discard()}

    def close_all(self) -> None:
        with self._lock:
            shells, self._named = list(self._named.values()), {}
        for shell in shells:
            shell.discard()

    def names(self) -> List[str]:
        with self._lock:
            return sorted(self._named)


def _check(name: str) -> None:
    if name == DEFAULT:
        raise errors.BadRequest("the default session is always open", "invalid_field")
    if not _NAME.match(name):
        raise errors.BadRequest(
            "session names match [A-Za-z0-9_.-]{1,64}: %r" % name[:100], "invalid_field"
        )
