"""Entry point: ``python3 -m execd --listen HOST:PORT`` (or ``--listen-fd N``).

The local backend starts it as ``python3 -S -c "from execd.__main__ import main; ..."``
(broker/backends/localpyc.py: ``-m`` costs every sandbox 0.2 MiB of ``runpy``).

Reads the token from the pipe or file descriptor named by SANDMAN_EXECD_TOKEN_FD
(read to EOF, then closed: nothing in the sandbox can read it again), else the
file named by SANDMAN_EXECD_TOKEN_FILE, else SANDMAN_EXECD_TOKEN, and removes all
three from the environment before bash is started, so no command can see it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from . import __version__, logs
from . import rundir as rundir_mod
from .api import App
from .cli import parse_args
from .cpus import pin_visible_cpus
from .errors import suppress
from .reaper import Reaper, become_subreaper
from .server import Server
from .session import Launch
from .sessions import Sessions
from .shell import Shell

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Any, Iterable, List, Optional, Set

log = logs.getLogger("execd")
TOKEN_VARS = ("SANDMAN_EXECD_TOKEN", "SANDMAN_EXECD_TOKEN_FILE", "SANDMAN_EXECD_TOKEN_FD")


def scrub_environ(names: Iterable[str]) -> None:
    """Overwrite the values in the process's original environment block.

    ``os.environ.pop`` only unlinks the variable: /proc/<pid>/environ keeps
    showing the bytes the kernel placed at exec time, and any command in the
    sandbox could read them there. So the bytes are blanked in place first,
    through /proc/self/mem (no ``ctypes``: 0.4 MiB in every sandbox), or through
    libc's ``environ`` with ``ctypes`` where /proc cannot do it.
    """
    wanted = {name.encode("latin-1") for name in names}
    try:
        _scrub_via_proc(wanted)
        return
    except (OSError, ValueError, IndexError) as exc:
        log.debug("environment block not scrubbed through /proc: %s", exc)
    try:
        _scrub_via_libc(wanted)
    except (OSError, AttributeError, ValueError) as exc:
        log.warning("could not scrub the environment block: %s", exc)


def _scrub_via_proc(wanted: Set[bytes]) -> None:
    """The block lies at env_start..env_end (fields 50 and 51 of /proc/self/stat):
    exactly the bytes /proc/<pid>/environ shows to others."""
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2 :].split()  # from field 3 on: comm may hold spaces
    start, end = int(fields[50 - 3]), int(fields[51 - 3])
    if not 0 < start < end:
        raise ValueError("no environment block in /proc/self/stat")
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        block = mem.read(end - start)
        at = start
        for entry in block.split(b"\0"):
            name, eq, value = entry.partition(b"=")
            if eq and value and name in wanted:
                mem.seek(at + len(name) + 1)
                mem.write(b"x" * len(value))
            at += len(entry) + 1


def _scrub_via_libc(wanted: Set[bytes]) -> None:
    import ctypes

    libc = ctypes.CDLL(None)
    env = ctypes.POINTER(ctypes.c_void_p).in_dll(libc, "environ")
    i = 0
    while env[i]:
        entry = ctypes.string_at(env[i])
        name = entry.split(b"=", 1)[0]
        if name in wanted:
            start = len(name) + 1
            ctypes.memset(env[i] + start, ord("x"), len(entry) - start)
        i += 1


def _read_fd(raw: str) -> str:
    """The token from an inherited descriptor (a pipe the provider filled and closed).

    The local provider uses this: an environment variable would sit in the
    environ block of bubblewrap's init (PID 1 in the sandbox, which execd cannot
    scrub), and a file would stay on disk. A pipe read to EOF is empty for anyone
    who opens it later through /proc, and the descriptor is closed here.
    """
    if not raw.isdigit():
        raise SystemExit("execd: SANDMAN_EXECD_TOKEN_FD is not a descriptor number")
    fd, data = int(raw), b""
    try:
        while len(data) <= 4096:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
        return data.decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit("execd: cannot read SANDMAN_EXECD_TOKEN_FD: %s" % exc) from None
    finally:
        with suppress(OSError):
            os.close(fd)


def read_token(insecure: bool) -> bytes:
    token = os.environ.get("SANDMAN_EXECD_TOKEN", "")
    path = os.environ.get("SANDMAN_EXECD_TOKEN_FILE", "")
    fd = os.environ.get("SANDMAN_EXECD_TOKEN_FD", "")
    if fd:
        token = _read_fd(fd)
    elif path:
        try:
            with open(path, "rb") as f:
                token = f.read().decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit("execd: cannot read SANDMAN_EXECD_TOKEN_FILE: %s" % exc) from None
    scrub_environ(TOKEN_VARS)
    for name in TOKEN_VARS:
        os.environ.pop(name, None)
    if not token and not insecure:
        raise SystemExit(
            "execd: no token: set SANDMAN_EXECD_TOKEN_FD, SANDMAN_EXECD_TOKEN_FILE or "
            "SANDMAN_EXECD_TOKEN "
            "(or pass --insecure-no-auth for local debugging)"
        )
    return token.encode("utf-8")


def find_bash() -> str:
    """``shutil.which("bash") or "/bin/bash"``, without importing shutil at start."""
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(folder or ".", "bash")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return "/bin/bash"


def ensure_std_fds() -> None:
    """PID 1 may start with 0-2 closed; a pipe landing there would be clobbered."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open("/dev/null", os.O_RDWR)


def main(argv: Optional[List[str]] = None) -> int:
    ensure_std_fds()
    args = parse_args(argv)
    logs.configure(args.log_level, sys.stderr)
    # First, before any thread or child: they all inherit the affinity.
    pin_visible_cpus(os.environ)
    token = read_token(args.insecure_no_auth)
    if args.listen_fd is not None:
        # Before bash or any run starts: no command in the sandbox may inherit it.
        with suppress(OSError):
            os.set_inheritable(args.listen_fd, False)
    if not token:
        log.warning("serving WITHOUT authentication (--insecure-no-auth)")
    bash = find_bash()
    if not os.access(bash, os.X_OK):
        raise SystemExit("execd: bash not found")
    workdir = os.path.abspath(args.workdir or os.getcwd())
    if args.make_workdir:
        with suppress(OSError):  # not ours to create: refused just below
            os.makedirs(workdir, exist_ok=True)
    if not os.path.isdir(workdir):
        raise SystemExit("execd: --workdir %s is not a directory" % workdir)
    umask = os.umask(0o022)
    os.umask(umask)
    become_subreaper()
    reaper = Reaper()
    reaper.start()
    rundir = rundir_mod.create()
    launch = Launch(bash, workdir, dict(os.environ), reaper)
    shell = Shell(launch, rundir)
    shell.start()
    sessions = Sessions(shell, launch, rundir, args.max_sessions)
    app = App(
        token,
        shell=shell,
        rundir=rundir,
        max_body=args.max_body_bytes,
        umask=umask,
        sessions=sessions,
        max_runs=args.max_runs,
        keepalive_s=args.stream_keepalive,
    )
    server = Server(
        args.listen,
        app,
        app.authorized,
        idle_timeout=args.idle_timeout,
        request_timeout=args.request_timeout,
        head_timeout=args.head_timeout,
        max_pending=args.max_pending,
        listen_fd=args.listen_fd,
    )

    def stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    host, port = server.server_address[:2]
    log.info(
        "execd %s listening on %s:%d (pid %d, workdir %s)",
        __version__,
        host,
        port,
        os.getpid(),
        workdir,
    )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        try:
            sessions.close_all()
            shell.close()
        except Exception:  # best effort at shutdown
            log.exception("cleanup failed")
        rundir_mod.remove(rundir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
