"""Named sessions beside the default one: independent state, own locks, bounded, closable."""

import threading

import pytest

from tests.support.execd_daemon import Daemon
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


def test_named_sessions_are_independent(fresh_daemon, tmp_path):
    c = fresh_daemon.client()
    assert c.post("/v1/sessions/open", {"name": "a"})["name"] == "a"
    c.post("/v1/sessions/open", {"name": "b.2"})
    c.exec(f"cd {tmp_path}; export WHO=a; f() {{ echo fa; }}", session="a")
    c.exec("cd /; export WHO=b", session="b.2")
    assert c.exec("pwd; echo $WHO; f", session="a")["stdout"] == f"{tmp_path}\na\nfa\n"
    assert c.exec("pwd; echo $WHO", session="b.2")["stdout"] == "/\nb\n"
    default = c.exec("pwd; echo ${WHO:-none}; type f >/dev/null 2>&1 || echo nof")
    assert default["stdout"] == f"{fresh_daemon.workdir}\nnone\nnof\n"
    assert c.exec("echo x", session="default")["stdout"] == "x\n"  # the default, by name
    # exit ends only that session's bash; its next call starts fresh and says so.
    assert c.exec("exit 7", session="a")["exit_code"] == 7
    again = c.exec("pwd", session="a")
    assert again["session_restarted"] and again["stdout"] == f"{fresh_daemon.workdir}\n"
    assert c.exec("echo $WHO", session="b.2")["stdout"] == "b\n"
    info = c.request("GET", "/v1/info")[1]
    assert info["sessions"] == ["a", "b.2"]


def test_open_close_errors(fresh_daemon):
    c = fresh_daemon.client()
    c.post("/v1/sessions/open", {"name": "s"})
    assert c.post("/v1/sessions/open", {"name": "s"}, 409)["error"]["code"] == "session_exists"
    for bad in ("default", "", "a/b", "x" * 65, "sp ace"):
        c.post("/v1/sessions/open", {"name": bad}, 400)
    c.post("/v1/sessions/open", {}, 400)
    c.exec("sleep 1000 >/dev/null 2>&1 &", session="s")
    assert c.post("/v1/sessions/close", {"name": "s"}) == {"ok": True, "killed": 1}
    gone = c.post("/v1/exec", {"command": "true", "session": "s"}, 404)
    assert gone["error"]["code"] == "no_session"
    assert c.post("/v1/sessions/close", {"name": "s"}, 404)["error"]["code"] == "no_session"
    c.post("/v1/sessions/close", {"name": "default"}, 400)
    c.post("/v1/sessions/open", {"name": "s"})  # the name is free again


def test_the_number_is_bounded(tmp_path):
    d = Daemon(tmp_path, args=["--max-sessions", "2"])
    try:
        c = d.client()
        c.post("/v1/sessions/open", {"name": "one"})
        c.post("/v1/sessions/open", {"name": "two"})
        assert c.post("/v1/sessions/open", {"name": "three"}, 429)["error"]["code"] == "busy"
        c.post("/v1/sessions/close", {"name": "one"})
        c.post("/v1/sessions/open", {"name": "three"})
    finally:
        d.stop()


def test_a_timeout_in_one_session_spares_the_others(fresh_daemon, tmp_path):
    """Call ids are unique across sessions: a timed-out call kills its own processes only."""
    c = fresh_daemon.client()
    c.post("/v1/sessions/open", {"name": "slow"})
    job = int(c.exec("sleep 1000 >/dev/null 2>&1 & echo $!")["stdout"])
    r = c.exec("sleep 1000", session="slow", timeout=1)
    assert r["timed_out"]
    assert c.exec(f"kill -0 {job} && echo alive")["stdout"] == "alive\n"
    assert c.exec("echo still", session="slow")["stdout"] == "still\n"  # the shell survived


def test_a_session_runs_while_another_is_busy(fresh_daemon, tmp_path):
    """Per-session locks: a call blocked in one session does not hold up another."""
    gate = tmp_path / "gate"
    c = fresh_daemon.client()
    c.post("/v1/sessions/open", {"name": "blocked"})
    result = {}

    def blocked() -> None:
        command = f"touch {gate}.started; while [ ! -e {gate} ]; do sleep 0.05; done; echo released"
        result["r"] = fresh_daemon.client().exec(command, session="blocked", timeout=300)

    t = threading.Thread(target=blocked)
    t.start()
    started = tmp_path / "gate.started"
    wait_until(started.exists, 60, 0.05, "the blocked call to start")
    # Neither the default session nor a run waits for the blocked one: they create the gate.
    c.exec(f"echo > {gate}.default")
    c.post("/v1/run", {"cmd": f"mv {gate}.default {gate}"})
    t.join(300)
    assert result["r"]["stdout"] == "released\n"


def test_reset_restarts_named_sessions(fresh_daemon):
    c = fresh_daemon.client()
    c.post("/v1/sessions/open", {"name": "n"})
    c.exec("export KEEP=1", session="n")
    c.post("/v1/reset")
    r = c.exec("echo ${KEEP:-gone}", session="n")
    assert r["session_restarted"] and r["stdout"] == "gone\n"
