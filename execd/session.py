"""One persistent bash process and the pump thread that drains its pipes.

The pump thread reads stdout, stderr and the control fd at all times, so a
background job that prints between calls never blocks on a full pipe (its
output is dropped then; during a call it is attributed to that call, as in a
terminal). The request thread only writes the call line and waits on an
event; completion is the control line "<id> <status>" or the death of bash,
which the reaper reports through ``_on_exit``.
"""

import contextlib
import fcntl
import logging
import os
import select
import signal
import threading
import time
from typing import Dict, List, Optional, Set

from . import bashproto, proc
from .output import BoundedCapture
from .reaper import Reaper

log = logging.getLogger("execd.session")

F_SETPIPE_SZ = 1031
ABORT_GRACE_S = 2.0
_SIGDEF = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGUSR1, signal.SIGINT, signal.SIGTERM)


class Call:
    """One command's result as it accumulates."""

    def __init__(self, call_id: int, cap: int) -> None:
        self.id = call_id
        self.out = BoundedCapture(cap)
        self.err = BoundedCapture(cap)
        self.done = threading.Event()
        self.exit_code: Optional[int] = None
        self.timed_out = False
        self.session_died = False


class SessionError(RuntimeError):
    pass


class Session:
    def __init__(
        self, bash: str, workdir: str, env: Dict[str, str], script: str, reaper: Reaper
    ) -> None:
        self.script = script
        self.dead = False
        self.exit_status: Optional[int] = None
        self.started = time.time()
        self._mu = threading.Lock()
        self._call: Optional[Call] = None
        proto_r, self._proto_w = os.pipe()
        self._out_r, out_w = os.pipe()
        self._err_r, err_w = os.pipe()
        self._ctl_r, ctl_w = os.pipe()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._out_r, self._err_r):
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, F_SETPIPE_SZ, 1 << 20)
        for fd in (self._out_r, self._err_r, self._ctl_r, self._wake_r):
            os.set_blocking(fd, False)
        actions = [
            (os.POSIX_SPAWN_DUP2, proto_r, 0),
            (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
            (os.POSIX_SPAWN_OPEN, 2, "/dev/null", os.O_WRONLY, 0),
            (os.POSIX_SPAWN_DUP2, out_w, bashproto.OUT_FD),
            (os.POSIX_SPAWN_DUP2, err_w, bashproto.ERR_FD),
            (os.POSIX_SPAWN_DUP2, ctl_w, bashproto.CTL_FD),
        ]
        try:
            self.pid = reaper.spawn(
                bash,
                [bash, "--noprofile", "--norc"],
                env,
                self._on_exit,
                file_actions=actions,
                setsid=True,
                setsigdef=_SIGDEF,
                setsigmask=(),
            )
        finally:
            for fd in (proto_r, out_w, err_w, ctl_w):
                os.close(fd)
        self._ready = Call(0, 4096)
        self._call = self._ready
        threading.Thread(target=self._pump, name="pump-%d" % self.pid, daemon=True).start()
        self._send(bashproto.init_script(workdir, script))
        if not self._ready.done.wait(10) or self.dead:
            self.kill()
            raise SessionError("bash did not start: %s" % self._ready.err.text().strip())
        if self._ready.err.total:
            log.warning("session start: %s", self._ready.err.text().strip())
        self._call = None

    # ---- running commands -------------------------------------------------

    def run(self, call_id: int, command: str, timeout: float, cap: int) -> Call:
        call = Call(call_id, cap)
        with self._mu:
            self._call = call
        try:
            before = proc.direct_children(self.pid)
            self._write_script(command)
            self._send(bashproto.call_line(call_id))
            if not call.done.wait(timeout):
                call.timed_out = True
                self._abort(call, before)
        finally:
            with self._mu:
                self._call = None
        return call

    def _write_script(self, command: str) -> None:
        data = command.encode("utf-8", "surrogateescape")
        try:
            fd = os.open(self.script, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:  # a command removed our runtime dir (rm -rf /tmp/*)
            os.makedirs(os.path.dirname(self.script), mode=0o700, exist_ok=True)
            fd = os.open(self.script, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def _send(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._proto_w, view) :]
        except OSError:  # bash is gone; the reaper's report finishes the call
            pass

    def _abort(self, call: Call, before: Set[int]) -> None:
        """Kill what the call started and unwind bash out of it, keeping the shell."""
        marker = ("%s=%d" % (bashproto.CALL_VAR, call.id)).encode()
        deadline = time.monotonic() + ABORT_GRACE_S
        pause = 0.02
        while not call.done.is_set():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGUSR1)
            proc.kill_tree(lambda table: self._call_procs(table, before, marker))
            if call.done.wait(pause):
                return
            pause = min(pause * 2, 0.2)
            if time.monotonic() > deadline:
                log.warning("call %d did not unwind; killing the session", call.id)
                self.kill()
                call.done.wait(5)
                return

    def _call_procs(self, table, before: Set[int], marker: bytes) -> Set[int]:
        old = {p for p in before if p in table and table[p].ppid == self.pid}
        old |= proc.descendants(table, old)
        targets = proc.descendants(table, [self.pid]) - old
        for pid in proc.descendants(table, [os.getpid()]) - targets - old - {self.pid}:
            if table[pid].ppid != self.pid and proc.environ_has(pid, marker):
                targets.add(pid)
                targets |= proc.descendants(table, [pid])
        targets.discard(self.pid)
        return targets

    def kill(self) -> int:
        """Kill bash and everything below it; returns how many processes."""
        if self.dead:
            return 0
        return proc.kill_tree(lambda t: proc.descendants(t, [self.pid]) | {self.pid} & set(t))

    def close(self) -> None:
        """Release the write ends once bash is dead and the pump has finished."""
        for fd in (self._proto_w, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ---- the pump ------------------------------------------------------------

    def _on_exit(self, code: int) -> None:  # reaper thread
        self.exit_status = code
        self.dead = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _pump(self) -> None:
        poller = select.poll()
        fds: List[int] = [self._out_r, self._err_r, self._ctl_r, self._wake_r]
        for fd in fds:
            poller.register(fd, select.POLLIN)
        ctl = b""
        while True:
            events = dict(poller.poll())
            for fd in (self._out_r, self._err_r):
                if fd in events and not self._drain(fd):
                    poller.unregister(fd)
            if self._ctl_r in events:
                data = self._read(self._ctl_r)
                if data is None or data == b"":
                    poller.unregister(self._ctl_r)
                else:
                    ctl += data
                    while b"\n" in ctl:
                        line, ctl = ctl.split(b"\n", 1)
                        self._complete(line)
            if self._wake_r in events and self.dead:
                self._drain(self._out_r)
                self._drain(self._err_r)
                with self._mu:
                    call = self._call
                    if call is not None and not call.done.is_set():
                        call.exit_code = self.exit_status
                        call.session_died = True
                        call.done.set()
                for fd in fds:  # write ends stay open until close(): no fd reuse races
                    os.close(fd)
                return

    def _complete(self, line: bytes) -> None:
        parts = line.split()
        if len(parts) != 2:
            return
        self._drain(self._out_r)
        self._drain(self._err_r)
        with self._mu:
            call = self._call
            if call is not None and str(call.id).encode() == parts[0]:
                try:
                    call.exit_code = int(parts[1])
                except ValueError:
                    call.exit_code = None
                call.done.set()

    def _read(self, fd: int) -> Optional[bytes]:
        try:
            return os.read(fd, 65536)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _drain(self, fd: int) -> bool:
        """Read what is there now; False at end of file."""
        while True:
            data = self._read(fd)
            if data is None:
                return True
            if not data:
                return False
            with self._mu:
                call = self._call
                if call is not None and not call.done.is_set():
                    (call.out if fd == self._out_r else call.err).feed(data)
