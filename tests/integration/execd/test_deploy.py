"""execd as it is deployed: from a read-only copy, on the oldest Python at hand."""

import os
import shutil
import signal
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.support.execd_daemon import REPO, Daemon, oldest_python, proc_children
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


def snapshot(root: Path):
    return sorted((str(p.relative_to(root)), p.stat().st_mtime_ns) for p in root.rglob("*"))


def test_runs_from_read_only_copy_and_writes_nothing(tmp_path):
    base = Path(tempfile.mkdtemp(prefix="execd-ro-"))
    os.chmod(base, 0o755)
    try:
        shutil.copytree(
            REPO / "execd", base / "execd", ignore=shutil.ignore_patterns("__pycache__")
        )
        for p in [base, *base.rglob("*")]:
            os.chmod(p, stat.S_IMODE(p.stat().st_mode) & ~0o222)
        before = snapshot(base)
        work = Path(tempfile.mkdtemp(prefix="execd-ro-work-"))
        os.chmod(work, 0o777)
        env = {"PYTHONDONTWRITEBYTECODE": ""}
        # chmod a-w does not stop root: run as nobody so the copy is read-only for real.
        kw = {"user": 65534, "group": 65534} if os.geteuid() == 0 else {}
        env_clean = {k: v for k, v in env.items() if v}
        python = oldest_python(65534) if kw else oldest_python()
        d = Daemon(tmp_path, cwd=base, python=python, popen_kw=kw, workdir=work, env=env_clean)
        try:
            c = d.client()
            assert c.exec("echo ok; id -u")["stdout"].startswith("ok\n")
            assert c.exec("python3 -c 'import sys; print(sys.version_info[:2])'")["exit_code"] == 0
        finally:
            d.stop()
        assert snapshot(base) == before
        assert not list(base.rglob("__pycache__"))
    finally:
        for p in [base, *base.rglob("*")]:
            os.chmod(p, 0o755)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def test_refuses_to_start_without_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDMAN_")}
    res = subprocess.run(
        [oldest_python(), "-m", "execd", "--listen", "127.0.0.1:0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert res.returncode != 0 and "token" in res.stderr.lower()


def test_token_from_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("file-token-123\n")
    d = Daemon(
        tmp_path,
        env={"SANDMAN_EXECD_TOKEN": "", "SANDMAN_EXECD_TOKEN_FILE": str(token_file)},
        token="file-token-123",
    )
    try:
        c = d.client()
        r = c.exec("env | grep -c SANDMAN_EXECD_TOKEN; echo")
        assert r["stdout"].startswith("0")
    finally:
        d.stop()


def test_insecure_no_auth_flag(tmp_path):
    d = Daemon(tmp_path, args=["--insecure-no-auth"], env={"SANDMAN_EXECD_TOKEN": ""})
    try:
        c = d.client()
        assert c.request("POST", "/v1/exec", {"command": "true"}, auth=False)[0] == 200
    finally:
        d.stop()


def test_as_pid_1_reaps_orphans_and_stops_on_sigterm(tmp_path):
    from tests.conftest import unavailable

    if shutil.which("unshare") is None:
        unavailable("util-linux unshare", "not installed")  # fails under CI
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], check=False, capture_output=True
    )
    if probe.returncode != 0:
        unavailable("a PID namespace", probe.stderr.decode(errors="replace"))
    d = Daemon(tmp_path, wrapper=["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"])
    try:
        c = d.client()
        assert c.request("GET", "/v1/info")[1]["pid"] == 1
        c.exec("for i in 1 2 3; do ( sh -c 'sleep 0.1 & exit 0' & ); done")
        zombies = (
            "for f in /proc/[0-9]*/stat; do read -r l < $f 2>/dev/null; "
            's=${l##*) }; [ "${s%% *}" = Z ] && echo $f; done; true'
        )
        wait_until(lambda: c.exec(zombies)["stdout"] == "", 30, 0.1, "no zombies")
        wait_until(  # each sleep, at least
            lambda: c.request("GET", "/v1/info")[1]["orphans_reaped"] >= 3, 30, 0.05, "reaping"
        )
        execd_host_pid = next(p for p, _ in proc_children(d.proc.pid))
        os.kill(execd_host_pid, signal.SIGTERM)
        assert d.proc.wait(10) == 0  # unshare exits with its child's status
    finally:
        d.stop()


def test_sigterm_cleans_up_processes_and_runtime_dir(tmp_path):
    d = Daemon(tmp_path)
    c = d.client()
    bash_pid = c.request("GET", "/v1/info")[1]["session_pid"]
    job = int(c.exec("sleep 300 & echo $!")["stdout"])
    script = c.exec('alias __execd | grep -o "source [^ ]*" | cut -d" " -f2')["stdout"].strip()
    rundir = os.path.dirname(script)
    assert os.path.isdir(rundir) and not rundir.startswith(str(REPO))
    d.stop()
    assert d.proc.returncode == 0
    for pid in (bash_pid, job):
        assert not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text()
    assert not os.path.exists(rundir)


def test_runtime_dirs_of_dead_daemons_are_swept(tmp_path):
    from execd import proc

    ns = os.readlink("/proc/self/ns/pid")
    gone = subprocess.Popen(["true"])
    start = proc.read_stat(gone.pid).start
    gone.wait()
    stale, live = (
        Path(tempfile.mkdtemp(prefix="execd-", dir="/dev/shm")),
        Path(tempfile.mkdtemp(prefix="execd-", dir="/dev/shm")),
    )
    (stale / "owner").write_text(f"{gone.pid} {start} {ns}")
    me = proc.read_stat(os.getpid()).start
    (live / "owner").write_text(f"{os.getpid()} {me} {ns}")
    d = Daemon(tmp_path)
    try:
        assert not stale.exists() and live.exists()
    finally:
        d.stop()
        shutil.rmtree(live, ignore_errors=True)


def test_serves_an_inherited_listening_socket_that_no_command_inherits(tmp_path):
    """``--listen-fd``: the local backend binds execd's socket in the host's network
    namespace and execd, in the sandbox's own, serves on it. The session's bash and
    every command must not hold it (they could accept the trainer's connections)."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port, inode = listener.getsockname()[1], os.fstat(listener.fileno()).st_ino
    fd = listener.fileno()
    d = Daemon(tmp_path, args=["--listen-fd", str(fd)], popen_kw={"pass_fds": (fd,)})
    listener.close()  # execd's copy is the only one now
    try:
        assert d.port == port
        c = d.client()
        held = c.exec("for f in /proc/$$/fd/* /proc/self/fd/*; do readlink $f; done")["stdout"]
        assert f"socket:[{inode}]" not in held, held
        assert c.exec("echo ok")["stdout"] == "ok\n"
    finally:
        d.stop()


def test_listen_fd_that_is_no_socket_is_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDMAN_")}
    read_end, write_end = os.pipe()
    try:
        res = subprocess.run(
            [oldest_python(), "-m", "execd", "--listen-fd", str(read_end)],
            cwd=REPO,
            env={**env, "SANDMAN_EXECD_TOKEN": "x" * 16},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            pass_fds=(read_end,),
        )
    finally:
        os.close(read_end)
        os.close(write_end)
    assert res.returncode != 0 and "not a socket" in res.stderr
