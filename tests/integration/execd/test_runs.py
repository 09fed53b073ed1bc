"""One-shot runs (/v1/run) against a real daemon: every option, kills, codes, concurrency.

Concurrency is proven by rendezvous, never by timing: each command announces itself in
a directory and waits until all the others have announced themselves too. Executed one
after another, the first would wait alone (and say so); executed together, every one
sees all the others, and their own timestamps overlap.
"""

import base64
import hashlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from tests.support.execd_daemon import REPO, Daemon, oldest_python
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


def run(client, status=200, **body):
    return client.post("/v1/run", body, status=status)


def test_argv_and_cmd_shapes(client):
    r = run(client, argv=["echo", "hi there"])
    assert r == {
        **r,
        "exit_code": 0,
        "stdout": "hi there\n",
        "stderr": "",
        "stdout_total": 9,
        "stderr_total": 0,
        "truncated": False,
        "timed_out": False,
    }
    assert "stdout_b64" not in r and r["duration_s"] >= 0
    r = run(client, cmd="echo out; echo err >&2; exit 3")
    assert (r["exit_code"], r["stdout"], r["stderr"]) == (3, "out\n", "err\n")
    assert run(client, argv=["printf", "%s|", "$HOME", "a b"])["stdout"] == "$HOME|a b|"


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"argv": ["true"], "cmd": "true"},
        {"argv": []},
        {"argv": "true"},
        {"argv": ["a\u0000b"]},
        {"cmd": "true", "timeout": 0},
        {"cmd": "true", "binary": "yes"},
        {"cmd": "true", "stdin_b64": "not base64!"},
        {"cmd": "true", "env": ["A=1"]},
        {"cmd": "true", "env": {"1A": "x"}},
        {"cmd": "true", "env": {"A": 1}},
    ],
)
def test_bad_requests_are_400(client, body):
    assert "error" in run(client, status=400, **body)


def test_stdin_text_binary_and_none(client):
    assert run(client, argv=["cat"], stdin_b64=base64.b64encode(b"h\xc3\xa9\n").decode())[
        "stdout"
    ] == ("hé\n")
    raw = bytes(range(256)) * 4
    r = run(client, argv=["cat"], stdin_b64=base64.b64encode(raw).decode(), binary=True)
    assert base64.b64decode(r["stdout_b64"]) == raw and r["stdout_total"] == len(raw)
    assert "\ufffd" in r["stdout"]  # the text form replaces what is not UTF-8
    # Without stdin_b64 the run reads EOF at once (never hangs on an open pipe).
    r = run(client, argv=["cat"], timeout=60)
    assert (r["exit_code"], r["stdout"], r["timed_out"]) == (0, "", False)


def test_stdin_over_a_mebibyte(client):
    raw = os.urandom(3 * 1024 * 1024 + 7)
    script = 't=$(mktemp); cat > "$t"; sha256sum < "$t"; wc -c < "$t"; rm "$t"'
    r = run(client, cmd=script, stdin_b64=base64.b64encode(raw).decode())
    assert r["exit_code"] == 0
    digest, size = r["stdout"].split()[0], r["stdout"].split()[-1]
    assert (digest, int(size)) == (hashlib.sha256(raw).hexdigest(), len(raw))


def test_stdin_a_run_does_not_read_is_dropped(client):
    raw = b"x" * (4 * 1024 * 1024)  # more than any pipe holds
    r = run(client, argv=["true"], stdin_b64=base64.b64encode(raw).decode())
    assert r["exit_code"] == 0


def test_cwd(client, daemon, tmp_path):
    assert run(client, argv=["pwd"], cwd=str(tmp_path))["stdout"] == f"{tmp_path}\n"
    assert run(client, argv=["pwd"])["stdout"] == f"{daemon.workdir}\n"
    (daemon.workdir / "sub").mkdir(exist_ok=True)
    assert run(client, argv=["pwd"], cwd="sub")["stdout"] == f"{daemon.workdir}/sub\n"
    bad = run(client, status=400, argv=["pwd"], cwd=str(tmp_path / "missing"))
    assert bad["error"]["code"] == "bad_cwd"


def test_env_is_added_through_the_spawn(client, tmp_path):
    r = run(client, cmd='echo "$FOO|$EMPTY|${PATH:+path}"', env={"FOO": "a b", "EMPTY": ""})
    assert r["stdout"] == "a b||path\n"
    # An `env` first on the run's own PATH is never what applies the variables.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "env").write_text("#!/bin/sh\necho hijacked\n")
    (fake / "env").chmod(0o755)
    path = f"{fake}:{os.environ['PATH']}"
    r = run(client, argv=["printenv", "FOO"], env={"FOO": "direct", "PATH": path})
    assert r["stdout"] == "direct\n"


@pytest.mark.parametrize(
    "name", ["LD_PRELOAD", "SANDMAN_EXECD_CALL", "SANDMAN_X", "BASH_ENV", "PYTHONPATH", "IFS"]
)
def test_reserved_env_is_refused(client, name):
    r = run(client, status=400, argv=["true"], env={name: "x"})
    assert r["error"]["code"] == "reserved_env"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"cmd": "exit 0"}, 0),
        ({"cmd": "exit 42"}, 42),
        ({"cmd": "exit 255"}, 255),
        ({"cmd": "kill -TERM $$"}, 143),
        ({"cmd": "kill -KILL $$"}, 137),
        ({"argv": ["bash", "-c", "kill -SEGV $$"]}, 139),
        ({"argv": ["no-such-command-here"]}, 127),
        ({"argv": ["/etc/passwd"]}, 126),
    ],
)
def test_exit_codes_are_exact(client, body, code):
    r = run(client, **body)
    assert (r["exit_code"], r["timed_out"]) == (code, False)
    if code in (126, 127):
        assert r["stderr"].startswith("execd: ")


def test_output_caps(client):
    r = run(client, cmd="head -c 10000 /dev/zero | tr '\\0' a; echo -n END", max_output_bytes=100)
    assert r["truncated"] and r["stdout_total"] == 10003
    assert r["stdout"].startswith("a" * 50) and r["stdout"].endswith("END")
    assert "bytes omitted" in r["stdout"]
    r = run(client, cmd="printf 'ab\\xff'", max_output_bytes=100, binary=True)
    assert base64.b64decode(r["stdout_b64"]) == b"ab\xff" and not r["truncated"]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] not in (b"Z", b"X")


def test_timeout_kills_the_whole_tree(client, tmp_path):
    """A grandchild that ignores SIGTERM, and one that left with setsid, both go."""
    pids = tmp_path / "pids"
    script = (
        f"(trap '' TERM; sleep 1000 & echo $! >> {pids}; wait) & "
        f"setsid bash -c 'sleep 1000 & echo $! >> {pids}; wait' & "
        f"until [ $(cat {pids} 2>/dev/null | wc -l) -ge 2 ]; do sleep 0.05; done; "
        "echo ready; sleep 1000"
    )
    r = run(client, cmd=script, timeout=15)  # room to start both under load; then killed
    assert (r["exit_code"], r["timed_out"]) == (None, True)
    found = [int(p) for p in pids.read_text().split()]
    assert len(found) == 2
    wait_until(lambda: not any(_alive(p) for p in found), 30, 0.05, "the tree to be gone")


def test_runs_are_concurrent_with_each_other_and_the_sessions(daemon, tmp_path):
    """Four runs, the default session and a named session meet in one rendezvous."""
    meet = tmp_path / "meet"
    meet.mkdir()
    total = 6

    def rendezvous(me: str) -> str:
        return (
            f"date +%s.%N > {meet}/{me}.start; "
            f"for i in $(seq 1200); do [ $(ls {meet} | grep -c start) -ge {total} ] && break; "
            "sleep 0.05; done; "
            f"[ $(ls {meet} | grep -c start) -ge {total} ] && echo met || echo alone; "
            f"sleep 1; date +%s.%N > {meet}/{me}.end"
        )

    opener = daemon.client()
    opener.post("/v1/sessions/open", {"name": "meet"})
    results: dict = {}

    def go(me: str, path: str, body: dict) -> None:
        c = daemon.client()
        results[me] = c.post(path, body)

    jobs = [(f"run{i}", "/v1/run", {"cmd": rendezvous(f"run{i}")}) for i in range(4)]
    jobs.append(("default", "/v1/exec", {"command": rendezvous("default"), "timeout": 120}))
    jobs.append(
        ("named", "/v1/exec", {"command": rendezvous("named"), "timeout": 120, "session": "meet"})
    )
    threads = [threading.Thread(target=go, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert {me: r["stdout"] for me, r in results.items()} == {me: "met\n" for me, _, _ in jobs}
    starts = [float((meet / f"{me}.start").read_text()) for me, _, _ in jobs]
    ends = [float((meet / f"{me}.end").read_text()) for me, _, _ in jobs]
    assert max(starts) < min(ends)  # every one had started before any had finished
    opener.post("/v1/sessions/close", {"name": "meet"})


def test_the_bound_refuses_at_once(tmp_path):
    d = Daemon(tmp_path, args=["--max-runs", "2"])
    try:
        gate = tmp_path / "gate"
        started = tmp_path / "started"
        started.mkdir()
        wait = f"touch {started}/$$; while [ ! -e {gate} ]; do sleep 0.05; done; echo done"
        results = []

        def blocked() -> None:
            results.append(d.client().post("/v1/run", {"cmd": wait}))

        threads = [threading.Thread(target=blocked) for _ in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: len(list(started.iterdir())) == 2, 60, 0.05, "two runs to start")
        c = d.client()
        busy = c.post("/v1/run", {"argv": ["true"]}, status=429)
        assert busy["error"]["code"] == "busy"
        assert c.exec("echo session")["stdout"] == "session\n"  # the session is not bounded
        gate.touch()
        for t in threads:
            t.join(120)
        assert [r["stdout"] for r in results] == ["done\n", "done\n"]
        assert c.post("/v1/run", {"argv": ["true"]})["exit_code"] == 0  # slots came back
        assert c.request("GET", "/v1/info")[1]["runs_active"] == 0
    finally:
        d.stop()


def _pythons() -> list:
    """The oldest Python (3.8: the switch in preexec_fn) and the newest at hand (3.9+: the
    switch in C, Popen's user/group/extra_groups): both paths are proven."""
    found = [oldest_python(), sys.executable]
    return sorted(set(found))


def _runnable_by_nobody(python: str) -> bool:
    """Whether nobody can run execd from this checkout with ``python`` (not under /root)."""
    try:
        probe = subprocess.run(
            [python, "-c", "import execd"],
            user=65534,
            group=65534,
            cwd=str(REPO),
            capture_output=True,
            check=False,
        )
    except OSError:
        return False
    return probe.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="user switching needs execd to run as root")
@pytest.mark.parametrize("python", _pythons())
def test_user_switch_as_root(python, tmp_path):
    d = Daemon(tmp_path, python=python)
    try:
        client = d.client()
        nobody = pwd.getpwnam("nobody")
        r = run(client, cmd='id -un; id -u; id -g; echo "$HOME|$USER"', user="nobody")
        assert r["stdout"].split("\n")[:4] == [
            "nobody",
            str(nobody.pw_uid),
            str(nobody.pw_gid),
            f"{nobody.pw_dir}|nobody",
        ]
        by_uid = run(client, argv=["id", "-u"], user=str(nobody.pw_uid))
        assert by_uid["stdout"] == f"{nobody.pw_uid}\n"
        assert run(client, argv=["id", "-un"], user="root")["stdout"] == "root\n"  # its own
        groups = run(client, argv=["id", "-G"], user="nobody")["stdout"].split()
        assert sorted(groups) == sorted({str(g) for g in os.getgrouplist("nobody", nobody.pw_gid)})
        # What the switched user may not do is refused to it (the switch is for real).
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        (private / "secret").write_text("x")
        denied = run(client, argv=["cat", str(private / "secret")], user="nobody")
        assert denied["exit_code"] == 1 and "Permission denied" in denied["stderr"]
    finally:
        d.stop()


def test_unknown_user_is_typed(client):
    r = run(client, status=400, argv=["true"], user="no-such-user-here")
    assert r["error"]["code"] == "unknown_user"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start execd as another user")
def test_cannot_switch_user_when_not_root(tmp_path):
    candidates = [*_pythons(), "/usr/bin/python3"]
    python = next((p for p in candidates if _runnable_by_nobody(p)), None)
    if python is None:
        pytest.skip("the user nobody can run no Python here on this checkout")
    work = Path(tempfile.mkdtemp(prefix="execd-nobody-"))
    work.chmod(0o777)
    d = Daemon(tmp_path, python=python, popen_kw={"user": 65534, "group": 65534}, workdir=work)
    try:
        r = d.client().post("/v1/run", {"argv": ["true"], "user": "root"}, status=422)
        assert r["error"]["code"] == "cannot_switch_user"
        me = d.client().post("/v1/run", {"argv": ["id", "-un"], "user": "nobody"})
        assert me["stdout"] == "nobody\n"  # its own user needs no switch
    finally:
        d.stop()
        shutil.rmtree(work, ignore_errors=True)
