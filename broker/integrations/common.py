"""What every harness adapter shares, importing no harness: file errors, big payloads, and
the held-sandbox registry that releases what a dying process still holds.

- ``INFRASTRUCTURE``: the errors that must reach a harness as its infrastructure error.
- ``file_error``: execd's file refusals as the ``OSError`` subclasses Python's own ``open``
  raises (every harness's local environment surfaces those, so callers catch them).
- ``write_large`` / ``BODY_CHUNK``: one execd request body is bounded (``--max-body-bytes``,
  64 MiB, about 48 MiB of base64 payload), so a bigger file or stdin travels as parts
  joined inside the sandbox.
- ``HeldSandboxes``: sandboxes an adapter holds, released by ``atexit`` when the process
  ends without its harness's cleanup having run (an uncaught exception or Ctrl-C at
  top level). A SIGKILLed process runs nothing: its leases stop being renewed and the
  GC reclaims the sandboxes (tests/integration/integrations/test_harness_kill.py).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import posixpath
import secrets
import shlex
import threading
from typing import Any

from broker.client import AsyncSandbox, core
from broker.errors import (
    ExecAuthError,
    ExecBusy,
    ExecError,
    ExecTimeout,
    InfrastructureError,
)

log = logging.getLogger(__name__)

# Failures of the infrastructure rather than of the call's input or command: every adapter
# hands these to its harness as that harness's infrastructure error (a masked sample), never
# as a command result. execd refusing our token, our HTTP call timing out and execd's run
# bound being full are ExecErrors by type but the trainer's side's trouble, not the agent's.
INFRASTRUCTURE: tuple[type[Exception], ...] = (
    InfrastructureError,
    ExecAuthError,
    ExecTimeout,
    ExecBusy,
)

BODY_CHUNK = 16 * 1024 * 1024  # raw bytes per execd write: well inside one request body


def file_error(exc: ExecError, path: str) -> Exception:
    """execd's refusal of a file call as the OSError a local ``open`` raises (else itself)."""
    if exc.status == 404:
        return FileNotFoundError(errno.ENOENT, "No such file or directory", path)
    if exc.status == 403:
        return PermissionError(errno.EACCES, "Permission denied", path)
    if exc.error_code == "is_directory" or (exc.status == 400 and "directory" in str(exc)):
        return IsADirectoryError(errno.EISDIR, "Is a directory", path)
    if exc.error_code == "bad_parent":
        return NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
    return exc


async def write_large(
    sandbox: AsyncSandbox, path: str, data: bytes, *, mode: int | None = None
) -> None:
    """Write ``data`` to ``path`` whatever its size; execd's errors become OSErrors.

    Up to BODY_CHUNK it is one atomic execd write. Beyond, the first part is written to
    ``path`` itself (so a directory or a refused path fails exactly as a small write), the
    rest as sibling part files, then appended in order and removed by one run.
    """
    try:
        await sandbox.write_file(path, data[:BODY_CHUNK], mode=mode)
        if len(data) <= BODY_CHUNK:
            return
        stem = posixpath.join(posixpath.dirname(path), f".sandman-part-{secrets.token_hex(6)}")
        parts = []
        for n, at in enumerate(range(BODY_CHUNK, len(data), BODY_CHUNK)):
            parts.append(f"{stem}-{n}")
            await sandbox.write_file(parts[-1], data[at : at + BODY_CHUNK], mode=0o600)
    except ExecError as exc:
        raise file_error(exc, path) from exc
    quoted = " ".join(shlex.quote(p) for p in parts)
    joined = await sandbox.run(
        f"cat -- {quoted} >> {shlex.quote(path)}; s=$?; rm -f -- {quoted}; exit $s"
    )
    if joined.exit_code != 0:
        raise OSError(errno.EIO, f"joining the parts failed: {joined.stderr.strip()}", path)


class HeldSandboxes:
    """Sandbox ids an adapter holds, with the client that can release them.

    ``release_all`` (registered with ``atexit`` once) queues a release for each through the
    client's synchronous Celery producer, which needs no event loop: at interpreter exit
    the harness's loop is gone. Releasing twice is harmless (the worker ignores a second).
    """

    def __init__(self) -> None:
        self._held: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._registered = False

    def add(self, sandbox_id: str, client: Any) -> None:
        with self._lock:
            self._held[sandbox_id] = client
            if not self._registered:
                atexit.register(self.release_all)
                self._registered = True

    def discard(self, sandbox_id: str) -> None:
        with self._lock:
            self._held.pop(sandbox_id, None)

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self._held

    def release_all(self) -> None:
        with self._lock:
            held, self._held = self._held, {}
        for sandbox_id, client in held.items():
            with contextlib.suppress(Exception):  # best effort: the process is ending
                client.enqueuer.send(*core.release_message(sandbox_id, "harness-exit"))
                log.warning("released sandbox %s at exit (its harness did not)", sandbox_id)


HELD = HeldSandboxes()
