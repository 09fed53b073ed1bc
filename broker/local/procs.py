"""Whether a process recorded in the state dir still runs: one answer for every caller.

The embedded services' pid files and the stack's marker are trusted only while their
process lives; a PermissionError means it lives under another user, which still counts.
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
