"""One-shot runs: a process beside the session, with its own stdin, cwd, env and user.

Each run is spawned by ``subprocess.Popen`` (the one stdlib way to chdir, switch
user and set up pipes in the child before exec) inside ``Reaper.own``, so the
reaper, still the only caller of ``waitpid``, hands its exit status back; the
Popen object is never waited on (its ``returncode`` is filled in from the
reaper, so it never polls either). The run is its own session and process
group, and it carries ``SANDMAN_EXECD_CALL=<its id>``: a timeout kills the
leader, its descendants and whatever carries the id wherever it went (``setsid``,
double forks re-parented to execd), stopped first, then killed.

The request thread drives the run (``events``): it feeds stdin, reads both
pipes and yields what it reads, so ``/v1/run`` captures and ``/v1/run/stream``
forwards the same events. Runs are bounded by ``Runner``'s slots: one over the
bound is refused at once (429), never queued.
"""

from __future__ import annotations

import errno
import os
import select
import signal
import sys
import threading
import time

from . import bashproto, errors, proc
from .errors import suppress
from .output import read_pipe
from .reaper import Reaper
from .runspec import RunSpec, User

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:  # imported on the first run: a sandbox that never runs one saves 0.4 MiB
    from typing import Any, Dict, Iterator, Optional, Set, Tuple

    Event = Tuple[str, bytes]
    import subprocess

POST_EXIT_GRACE_S = 0.5  # output still coming from pipes that background children hold
FINAL_READS = 32  # 2 MiB: more than a pipe holds (execd never enlarges a run's pipes)
STDIN_PIECE = 65536
KILL_WAIT_S = 10.0

# (stream, bytes): "stdout"/"stderr" with data, or "keepalive" with b"".


class Runner:
    """The bound on concurrent runs, and what every run starts from."""

    def __init__(self, reaper: Reaper, base_env: Dict[str, str], limit: int) -> None:
        self.reaper = reaper
        self.base_env = base_env
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)
        self._lock = threading.Lock()
        self.active = 0
        self.started = 0

    def start(self, spec: RunSpec) -> "Run":
        if not self._slots.acquire(blocking=False):
            raise errors.TooManyRequests("%d runs are already running" % self.limit)
        with self._lock:
            self.active += 1
            self.started += 1
        try:
            return Run(spec, self)
        except BaseException:
            self.done()
            raise

    def done(self) -> None:
        with self._lock:
            self.active -= 1
        self._slots.release()


def _switch_user(user: User) -> None:  # pragma: no cover (runs in the child, Python 3.8)
    os.setgroups(user.groups)
    os.setgid(user.gid)
    os.setuid(user.uid)


def _popen_kwargs(spec: RunSpec, env: Dict[str, str]) -> Dict[str, Any]:
    import subprocess

    kwargs: Dict[str, Any] = {
        "stdin": subprocess.PIPE if spec.stdin is not None else subprocess.DEVNULL,
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        "cwd": spec.cwd,
        "env": env,
        "start_new_session": True,
        "close_fds": True,
    }
    user = spec.user
    if user is not None:
        if sys.version_info >= (3, 9):  # switched in C between fork and exec
            kwargs.update(user=user.uid, group=user.gid, extra_groups=user.groups)
        else:
            kwargs["preexec_fn"] = lambda: _switch_user(user)
    return kwargs


def run_env(base: Dict[str, str], spec: RunSpec, call_id: int) -> Dict[str, str]:
    env = dict(base)
    if spec.user is not None:
        env.update(HOME=spec.user.home, USER=spec.user.name, LOGNAME=spec.user.name)
    env.update(spec.env)
    env[bashproto.CALL_VAR] = str(call_id)
    return env


class Run:
    def __init__(self, spec: RunSpec, runner: Runner) -> None:
        import subprocess

        self.spec = spec
        self.runner = runner
        self.id = bashproto.next_call_id()
        self.exit_status: Optional[int] = None
        self.timed_out = False
        self.started = time.monotonic()
        self.duration = 0.0
        self._closed = False
        self._done_r, self._done_w = os.pipe()
        os.set_blocking(self._done_r, False)
        self._popen: Optional["subprocess.Popen[bytes]"] = None
        self.early: Optional[Tuple[int, str]] = None  # (status, message): exec failed
        try:
            self.pid: Optional[int] = runner.reaper.own(self._launch, self._on_exit)
        except OSError as exc:
            self.pid = None
            self._failed(exc)
        except subprocess.SubprocessError as exc:  # preexec_fn (the user switch) failed
            self._close_fds()
            raise errors.Unprocessable(
                "cannot switch to user %r: %s" % (spec.user and spec.user.name, exc),
                "cannot_switch_user",
            ) from None

    def _launch(self) -> int:
        import subprocess

        env = run_env(self.runner.base_env, self.spec, self.id)
        self._popen = subprocess.Popen(self.spec.argv, **_popen_kwargs(self.spec, env))
        return self._popen.pid

    def _failed(self, exc: OSError) -> None:
        """The child could not exec: bash's statuses for the command, typed errors else."""
        spec = self.spec
        if exc.filename == spec.cwd or (
            isinstance(exc, PermissionError) and exc.filename is None and spec.user
        ):
            self._close_fds()
            if spec.user is not None and isinstance(exc, PermissionError):
                raise errors.Unprocessable(
                    "cannot run as %r: %s" % (spec.user.name, exc.strerror), "cannot_switch_user"
                ) from None
            raise errors.BadRequest("cannot enter cwd %s: %s" % (spec.cwd, exc.strerror), "bad_cwd")
        status = 127 if exc.errno == errno.ENOENT else 126
        what = "command not found" if status == 127 else exc.strerror or str(exc)
        self.early = (status, "execd: %s: %s\n" % (spec.argv[0], what))
        self.exit_status = status

    def _on_exit(self, code: int) -> None:  # reaper thread
        if self._popen is not None:
            self._popen.returncode = code  # never polled: the reaper already reaped it
        self.exit_status = code
        with suppress(OSError):
            os.write(self._done_w, b"x")

    # ---- driving the run ------------------------------------------------------

    def events(self, keepalive: Optional[float] = None) -> Iterator[Event]:
        """Feed stdin and yield output until the run is over (then ``close``)."""
        try:
            if self.early is not None:
                yield "stderr", self.early[1].encode()
                return
            yield from self._pump(keepalive)
        finally:
            self.close()

    def _pump(self, keepalive: Optional[float]) -> Iterator[Event]:
        popen = self._popen
        assert popen is not None and popen.stdout is not None and popen.stderr is not None
        names = {popen.stdout.fileno(): "stdout", popen.stderr.fileno(): "stderr"}
        poller = select.poll()
        for fd in (*names, self._done_r):
            os.set_blocking(fd, False)
            poller.register(fd, select.POLLIN)
        stdin = self._stdin_writer(poller)
        open_fds = set(names)
        deadline = self.started + self.spec.timeout
        exited_at: Optional[float] = None
        last_sent = time.monotonic()
        while open_fds:
            now = time.monotonic()
            if exited_at is None and self.exit_status is not None:
                exited_at = now
                stdin.close()
            if exited_at is not None and now - exited_at >= POST_EXIT_GRACE_S:
                # What the leader wrote is in the pipes even if this thread was slow to
                # get here: take it, but not what background children keep writing.
                for fd in open_fds:
                    for _ in range(FINAL_READS):
                        data = read_pipe(fd)
                        if not data:
                            break
                        yield names[fd], data
                break
            if exited_at is None and now >= deadline:
                self._kill_on_timeout()
                continue
            waits = [deadline - now if exited_at is None else exited_at + POST_EXIT_GRACE_S - now]
            if keepalive is not None:
                waits.append(last_sent + keepalive - now)
            ready = poller.poll(max(0.0, min(waits)) * 1000 + 1)
            for fd, _ in ready:
                if fd == self._done_r:
                    with suppress(OSError):
                        os.read(fd, 64)
                elif fd in names:
                    data = read_pipe(fd)
                    if data:
                        last_sent = time.monotonic()
                        yield names[fd], data
                    elif data is not None:
                        poller.unregister(fd)
                        open_fds.discard(fd)
                else:
                    stdin.write()
            if keepalive is not None and time.monotonic() - last_sent >= keepalive:
                last_sent = time.monotonic()
                yield "keepalive", b""
        self._wait_exit(deadline)

    def _stdin_writer(self, poller: "select.poll") -> "_StdinWriter":
        popen = self._popen
        assert popen is not None
        fd = popen.stdin.fileno() if popen.stdin is not None else None
        return _StdinWriter(fd, self.spec.stdin or b"", poller, popen)

    def _wait_exit(self, deadline: float) -> None:
        """Output closed before the leader exited: wait for it, or for the deadline."""
        while self.exit_status is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill_on_timeout()
                continue
            select.select([self._done_r], [], [], min(left, 3600.0))
            with suppress(OSError):
                os.read(self._done_r, 64)

    def _kill_on_timeout(self) -> None:
        self.timed_out = True
        self.kill()
        end = time.monotonic() + KILL_WAIT_S
        while self.exit_status is None and time.monotonic() < end:
            select.select([self._done_r], [], [], 0.05)
        if self.exit_status is None:  # never: SIGKILL is not ignorable; do not hang on it
            self.exit_status = 128 + signal.SIGKILL

    def _members(self, table: proc.Table) -> Set[int]:
        """The leader, its descendants and whatever carries this run's id, anywhere below us."""
        pid = self.pid
        assert pid is not None
        mine = str(self.id).encode()
        name = bashproto.CALL_VAR.encode()
        found = {pid} & set(table)
        for other in proc.descendants(table, [os.getpid()]):
            if other not in found and proc.environ_value(other, name) == mine:
                found.add(other)
        return found | proc.descendants(table, found)

    def kill(self) -> None:
        """Kill the run's whole tree (it may already be gone)."""
        if self.pid is None:
            return
        proc.kill_tree(self._members)
        with suppress(OSError):  # without /proc the group still goes
            os.killpg(self.pid, signal.SIGKILL)

    def close(self) -> None:
        """Release the slot and the pipes; a run abandoned mid-way (a client gone) is killed."""
        if self._closed:
            return
        self._closed = True
        if self.pid is not None and self.exit_status is None:
            proc.kill_tree(self._members)
        self.duration = time.monotonic() - self.started
        self._close_fds()
        self.runner.done()

    def _close_fds(self) -> None:
        popen = self._popen
        if popen is not None:
            for pipe in (popen.stdin, popen.stdout, popen.stderr):
                if pipe is not None:
                    with suppress(OSError):
                        pipe.close()
        for fd in (self._done_r, self._done_w):
            with suppress(OSError):
                os.close(fd)


class _StdinWriter:
    """Feeds the run's stdin in pieces as the pipe accepts them, then closes it (EOF)."""

    def __init__(
        self,
        fd: Optional[int],
        data: bytes,
        poller: "select.poll",
        popen: "subprocess.Popen[bytes]",
    ) -> None:
        self.fd = fd
        self.view = memoryview(data)
        self.poller = poller
        self.popen = popen
        if fd is None:
            return
        os.set_blocking(fd, False)
        if self.view:
            poller.register(fd, select.POLLOUT)
        else:
            self.close()

    def write(self) -> None:
        if self.fd is None:
            return
        try:
            while self.view:
                self.view = self.view[os.write(self.fd, self.view[:STDIN_PIECE]) :]
        except BlockingIOError:
            return
        except OSError:  # EPIPE: the run stopped reading; the rest is dropped
            pass
        self.close()

    def close(self) -> None:
        if self.fd is None:
            return
        with suppress(KeyError):
            self.poller.unregister(self.fd)
        with suppress(OSError):
            if self.popen.stdin is not None:
                self.popen.stdin.close()
        self.fd = None
