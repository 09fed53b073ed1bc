"""One persistent bash process, the calls run in it, and the reading of its pipes.

A call writes the command file, sends bash one line and reads stdout, stderr
and the control fd in the request thread until the control line
"<id> <status>" arrives or the reaper reports bash's death (``_on_exit``).
Between calls a pump thread drains the pipes so that background jobs never
stay blocked on a full pipe (their output is dropped then; during a call it is
attributed to that call, as in a terminal). On timeout the call's processes are
killed and bash is unwound out of the command (see bashproto).
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import threading
import time

from . import bashproto, logs, proc
from .errors import suppress
from .output import BoundedCapture, read_pipe
from .reaper import Reaper

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Dict, List, NamedTuple, Optional, Set, Tuple
else:
    from .records import NamedTuple

log = logs.getLogger("execd.session")

F_SETPIPE_SZ = 1031
ABORT_GRACE_S = 2.0
FAST_WINDOW_S = 0.002
PUMP_DELAY_S = 0.05
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


class Launch(NamedTuple):
    """How every bash of one execd starts: the binary, its starting directory and
    environment, and the reaper that learns of its exit (one per shell, reused for
    each fresh session after a dead one)."""

    bash: str
    workdir: str
    env: Dict[str, str]
    reaper: Reaper


class Session:
    def __init__(self, launch: Launch, script: str) -> None:
        bash, workdir, env, reaper = launch
        self.script = script
        self.dead = False
        self.exit_status: Optional[int] = None
        self.started = time.time()
        self._mu = threading.RLock()
        self._call: Optional[Call] = None
        proto_r, self._proto_w = os.pipe()
        self._out_r, out_w = os.pipe()
        self._err_r, err_w = os.pipe()
        self._ctl_r, ctl_w = os.pipe()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._out_r, self._err_r):
            with suppress(OSError):
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
        self._script_fd: Optional[int] = None
        self._script_len = -1
        self._done_r, self._done_w = os.pipe()
        os.set_blocking(self._done_r, False)
        self._resume = threading.Event()
        self._paused = False
        self._pump_polling = False
        self._last_call_end = 0.0
        self._children_stale = True
        self._children_before: Set[int] = set()
        self._ctl = b""
        self._eof: Set[int] = set()
        self._poller = self._new_poller(self._done_r)
        self._fast_poller = select.poll()
        for fd in (self._ctl_r, self._done_r):
            self._fast_poller.register(fd, select.POLLIN)
        self._ready = Call(0, 4096)
        self._call = self._ready
        self._pump_thread = threading.Thread(
            target=self._pump, name="pump-%d" % self.pid, daemon=True
        )
        self._pump_thread.start()
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
            before = self._children_before  # refreshed by the pump, off the hot path
            self._write_script(command)
            self._send(bashproto.call_line(call_id))
            self._pause_pump()
            try:
                if not self._read_until(call, time.monotonic() + timeout):
                    call.timed_out = True
                    self._abort(call, before)
            finally:
                self._resume_pump()
        finally:
            with self._mu:
                self._call = None
        return call

    def _write_script(self, command: str) -> None:
        """Overwrite the command file in place through a kept-open descriptor."""
        data = command.encode("utf-8", "surrogateescape")
        for attempt in (0, 1):
            try:
                if self._script_fd is None:
                    self._script_fd = os.open(
                        self.script, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
                    )
                    self._script_len = -1
                os.pwrite(self._script_fd, data, 0)
                if len(data) != self._script_len:
                    os.ftruncate(self._script_fd, len(data))
                    self._script_len = len(data)
                if os.fstat(self._script_fd).st_nlink:
                    return
            except FileNotFoundError:
                pass
            # A command removed our runtime dir (rm -rf /tmp/*): make it again.
            if self._script_fd is not None:
                os.close(self._script_fd)
                self._script_fd = None
            if attempt == 0:
                os.makedirs(os.path.dirname(self.script), mode=0o700, exist_ok=True)
        raise SessionError("cannot write the command file %s" % self.script)

    def _send(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._proto_w, view) :]
        except OSError:  # bash is gone; the reaper's report finishes the call
            pass

    def _abort(self, call: Call, before: Set[int]) -> None:
        """Kill what the call started and unwind bash out of it, keeping the shell."""
        deadline = time.monotonic() + ABORT_GRACE_S
        pause = 0.02
        while not call.done.is_set():
            with suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGUSR1)
            proc.kill_tree(lambda table: self._call_procs(table, before, call.id))
            if self._read_until(call, time.monotonic() + pause):
                return
            pause = min(pause * 2, 0.2)
            if time.monotonic() > deadline:
                log.warning("call %d did not unwind; killing the session", call.id)
                self.kill()
                self._read_until(call, time.monotonic() + 5)
                return

    def _call_procs(self, table: proc.Table, before: Set[int], call_id: int) -> Set[int]:
        """The processes a call started, wherever they went.

        A process carrying this call's SANDMAN_EXECD_CALL is the call's; one
        carrying another call's value is an earlier background job and is
        spared; one without any (it cleared its environment) is the call's if
        it is below bash but not below a child bash had before the call.
        """
        name = bashproto.CALL_VAR.encode()
        mine = str(call_id).encode()
        old = {p for p in before if p in table and table[p].ppid == self.pid}
        old |= proc.descendants(table, old)
        under_bash = proc.descendants(table, [self.pid])
        targets: Set[int] = set()
        for pid in proc.descendants(table, [os.getpid()]) - {self.pid}:
            value = proc.environ_value(pid, name)
            if value == mine or (value is None and pid in under_bash and pid not in old):
                targets.add(pid)
        targets |= proc.descendants(table, targets)
        targets.discard(self.pid)
        return targets

    def kill(self) -> int:
        """Kill bash and everything below it; returns how many processes."""
        if self.dead:
            return 0
        count = proc.kill_tree(lambda t: proc.descendants(t, [self.pid]) | {self.pid} & set(t))
        with suppress(OSError):  # also works without /proc: bash leads its group
            os.killpg(self.pid, signal.SIGKILL)
        return count

    def close(self) -> None:
        """Release the pipes once bash is dead (the pump has stopped reading)."""
        self._resume.set()
        self._pump_thread.join(5)
        if self._pump_thread.is_alive():  # never close fds a live reader could see reused
            log.error("pump of session %d did not stop; leaking its pipes", self.pid)
            return
        fds = [
            self._proto_w,
            self._wake_w,
            self._out_r,
            self._err_r,
            self._ctl_r,
            self._wake_r,
            self._done_r,
            self._done_w,
        ]
        if self._script_fd is not None:
            fds.append(self._script_fd)
        for fd in fds:
            with suppress(OSError):
                os.close(fd)

    # ---- reading the pipes ---------------------------------------------------
    #
    # The pump thread reads the pipes between calls, so background jobs never
    # block on a full pipe. During a call the request thread reads them itself
    # (a thread hand-off would add scheduler latency to every call); the pump
    # is asked to pause but is never waited for. Each read and the routing of
    # its bytes happen under ``_mu``, so two readers cannot reorder output, and
    # whoever finishes a call also writes to the done pipe, which only the
    # request thread polls, so it never sleeps through a completion.

    def _on_exit(self, code: int) -> None:  # reaper thread
        self.exit_status = code
        self.dead = True
        for fd in (self._wake_w, self._done_w):
            with suppress(OSError):
                os.write(fd, b"x")

    def _pump(self) -> None:
        poller = self._new_poller(self._wake_r)
        while not self.dead:
            if self._paused:
                self._resume.wait()
                self._resume.clear()
                continue
            # Start only once the shell has been idle for a moment: calls in
            # quick succession then never wake this thread (the pipes hold
            # 1 MiB meanwhile), and it never competes with a reply being sent.
            idle = time.monotonic() - self._last_call_end
            if idle < PUMP_DELAY_S:
                time.sleep(PUMP_DELAY_S - idle)
                continue
            if self._children_stale:
                # Between calls bash starts nothing: its children now are the
                # background jobs a timeout must spare (see _call_procs).
                self._children_before = proc.direct_children(self.pid)
                self._children_stale = False
                continue
            self._pump_polling = True
            try:
                events = [] if self._paused else poller.poll()
            finally:
                self._pump_polling = False
            self._handle(poller, events)

    def _new_poller(self, extra: int) -> "select.poll":
        poller = select.poll()
        for fd in (self._out_r, self._err_r, self._ctl_r, extra):
            poller.register(fd, select.POLLIN)
        return poller

    def _pause_pump(self) -> None:
        self._resume.clear()
        self._paused = True
        if self._pump_polling:  # only a pump blocked in poll() needs waking
            with suppress(OSError):
                os.write(self._wake_w, b"p")

    def _resume_pump(self) -> None:
        self._last_call_end = time.monotonic()
        self._children_stale = True
        self._paused = False
        self._resume.set()

    def _read_until(self, call: Call, deadline: float) -> bool:
        """Read the pipes in this thread until the call is done or the deadline.

        Most commands finish within a millisecond: for that long only the
        control fd is watched, so a short command costs one wake-up instead of
        one per stream (the output is drained when its completion arrives).
        """
        first = min(deadline - time.monotonic(), FAST_WINDOW_S)
        if first > 0 and not call.done.is_set():
            self._handle(self._fast_poller, self._fast_poller.poll(first * 1000))
        while not call.done.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._handle(self._poller, self._poller.poll(min(left, 3600.0) * 1000))
        return True

    def _handle(self, poller: "select.poll", events: List[Tuple[int, int]]) -> None:
        with self._mu:
            for fd in self._eof:
                with suppress(KeyError):
                    poller.unregister(fd)
            ready = {fd for fd, _ in events}
            for fd in (self._out_r, self._err_r):
                if fd in ready:
                    self._drain(fd)
            if self._ctl_r in ready:
                data = self._read(self._ctl_r)
                if data == b"":
                    self._eof.add(self._ctl_r)
                elif data:
                    self._ctl += data
                    while b"\n" in self._ctl:
                        line, self._ctl = self._ctl.split(b"\n", 1)
                        self._complete(line)
            for fd in (self._wake_r, self._done_r):
                if fd in ready:
                    with suppress(OSError):
                        os.read(fd, 4096)
            call = self._call
            if self.dead and call is not None and not call.done.is_set():
                self._drain(self._out_r)
                self._drain(self._err_r)
                call.exit_code = self.exit_status
                call.session_died = True
                self._finish(call)

    def _finish(self, call: Call) -> None:
        call.done.set()
        with suppress(OSError):
            os.write(self._done_w, b"d")

    def _complete(self, line: bytes) -> None:
        parts = line.split()
        if len(parts) != 2:
            return
        self._drain(self._out_r)
        self._drain(self._err_r)
        call = self._call
        if call is not None and str(call.id).encode() == parts[0]:
            try:
                call.exit_code = int(parts[1])
            except ValueError:
                call.exit_code = None
            self._finish(call)

    def _read(self, fd: int) -> Optional[bytes]:
        return read_pipe(fd)

    def _drain(self, fd: int) -> None:
        """Read what is there now into the current call (caller holds ``_mu``)."""
        while True:
            data = self._read(fd)
            if data is None:
                return
            if not data:
                self._eof.add(fd)
                return
            call = self._call
            if call is not None and not call.done.is_set():
                (call.out if fd == self._out_r else call.err).feed(data)
