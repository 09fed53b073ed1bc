"""Egress uplinks (slirp4netns) of local sandboxes, from the kernel's process list alone.

Read independently of the backend's own scan (``broker.backends.localprocs``), so a test
can check what really runs: an uplink's argv[0] is
``SANDMAN_SANDBOX=<state>/local-pods/<installation>/<namespace>/<name>/<nonce>``.
"""

from __future__ import annotations

import os
from pathlib import Path


def uplinks(state_dir: Path) -> dict[str, list[int]]:
    """Pod name -> PIDs (sorted) of the live uplinks of ``state_dir``'s sandboxes."""
    prefix = b"SANDMAN_SANDBOX=" + os.fsencode(str(state_dir.resolve() / "local-pods")) + b"/"
    found: dict[str, list[int]] = {}
    for entry in sorted(os.listdir("/proc")):
        if not entry.isdigit():
            continue
        try:
            argv0 = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        parts = argv0[len(prefix) :].split(b"/")
        if argv0.startswith(prefix) and len(parts) == 4:
            found.setdefault(os.fsdecode(parts[2]), []).append(int(entry))
    return {name: sorted(pids) for name, pids in found.items()}
