"""Entry point: ``python3 -m execd --listen HOST:PORT`` (or ``--listen-fd N``).

Reads the token from the pipe or file descriptor named by SANDMAN_EXECD_TOKEN_FD
(read to EOF, then closed: nothing in the sandbox can read it again), else the
file named by SANDMAN_EXECD_TOKEN_FILE, else SANDMAN_EXECD_TOKEN, and removes all
three from the environment before bash is started, so no command can see it.
"""

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
from typing import Any, Iterable, List, Optional, Tuple

from . import __version__
from . import rundir as rundir_mod
from .api import App
from .cpus import pin_visible_cpus
from .reaper import Reaper, become_subreaper
from .run import Runner
from .server import Server
from .session import Launch
from .sessions import Sessions
from .shell import Shell
from .snapshot import Snapshots
from .state import StateKeeper

log = logging.getLogger("execd")
TOKEN_VARS = ("SANDMAN_EXECD_TOKEN", "SANDMAN_EXECD_TOKEN_FILE", "SANDMAN_EXECD_TOKEN_FD")


def parse_listen(value: str) -> Tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError("--listen wants HOST:PORT, got %r" % value)
    host = host.strip("[]") or "0.0.0.0"  # noqa: S104 (a pod serves on its IP)
    return host, int(port)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m execd", description=__doc__.splitlines()[0])
    p.add_argument(
        "--listen",
        type=parse_listen,
        default=("0.0.0.0", 8000),  # noqa: S104
        help="HOST:PORT to serve on (default 0.0.0.0:8000; port 0 picks one)",
    )
    p.add_argument(
        "--listen-fd",
        type=int,
        default=None,
        help="serve on this inherited, already listening socket instead of --listen "
        "(the local backend binds it outside the sandbox's network namespace)",
    )
    p.add_argument("--workdir", default=None, help="the session's starting directory")
    p.add_argument(
        "--make-workdir",
        action="store_true",
        help="create --workdir (and its parents) when the image lacks it: a pod's default "
        "/workspace, like the local backend's bound empty workspace",
    )
    p.add_argument("--max-body-bytes", type=int, default=64 * 1024 * 1024)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=300.0,
        help="seconds a keep-alive connection may sit idle",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=60.0,
        help="seconds a client may stall while sending one request",
    )
    p.add_argument(
        "--head-timeout",
        type=float,
        default=10.0,
        help="seconds (in total, from connect) a connection without the token has to send "
        "its request head",
    )
    p.add_argument(
        "--max-pending",
        type=int,
        default=64,
        help="connections without the token held at once (the oldest is cut for a new one)",
    )
    p.add_argument(
        "--max-runs",
        type=int,
        default=32,
        help="one-shot runs at once; one more is refused with 429 (never queued)",
    )
    p.add_argument(
        "--max-sessions",
        type=int,
        default=16,
        help="named sessions open at once (the default session not counted)",
    )
    p.add_argument(
        "--stream-keepalive",
        type=float,
        default=5.0,
        help="seconds of silence after which a streamed run sends a keepalive frame",
    )
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve without a token (local debugging only)",
    )
    p.add_argument("--version", action="version", version=__version__)
    return p.parse_args(argv)


def scrub_environ(names: Iterable[str]) -> None:
    """Overwrite the values in the process's original environment block.

    ``os.environ.pop`` only unlinks the variable: /proc/<pid>/environ keeps
    showing the bytes the kernel placed at exec time, and any command in the
    sandbox could read them there. So the bytes are blanked in place first.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        env = ctypes.POINTER(ctypes.c_void_p).in_dll(libc, "environ")
        i = 0
        while env[i]:
            entry = ctypes.string_at(env[i])
            name = entry.split(b"=", 1)[0]
            if name.decode("latin-1") in names:
                start = len(name) + 1
                ctypes.memset(env[i] + start, ord("x"), len(entry) - start)
            i += 1
    except (OSError, AttributeError, ValueError) as exc:
        log.warning("could not scrub the environment block: %s", exc)


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
        with contextlib.suppress(OSError):
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
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # First, before any thread or child: they all inherit the affinity.
    pin_visible_cpus(os.environ)
    token = read_token(args.insecure_no_auth)
    if args.listen_fd is not None:
        # Before bash or any run starts: no command in the sandbox may inherit it.
        with contextlib.suppress(OSError):
            os.set_inheritable(args.listen_fd, False)
    if not token:
        log.warning("serving WITHOUT authentication (--insecure-no-auth)")
    bash = shutil.which("bash") or "/bin/bash"
    if not os.access(bash, os.X_OK):
        raise SystemExit("execd: bash not found")
    workdir = os.path.abspath(args.workdir or os.getcwd())
    if args.make_workdir:
        with contextlib.suppress(OSError):  # not ours to create: refused just below
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
    state = StateKeeper(shell, workdir, rundir)
    sessions = Sessions(shell, launch, rundir, args.max_sessions)
    runner = Runner(reaper, launch.env, args.max_runs)
    snapshots = Snapshots(shell, workdir, rundir, umask)
    app = App(
        token,
        shell,
        state,
        args.max_body_bytes,
        umask,
        sessions,
        runner,
        args.stream_keepalive,
        snapshots,
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
        shutil.rmtree(rundir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
