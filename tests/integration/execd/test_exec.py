"""The /v1/exec contract, driven over HTTP against a real daemon."""

import os
import secrets
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.execd_daemon import proc_children

pytestmark = pytest.mark.integration


def test_echo_shape(client):
    r = client.exec("echo hi")
    assert r == {
        **r,
        "exit_code": 0,
        "stdout": "hi\n",
        "stderr": "",
        "timed_out": False,
        "truncated": False,
        "stdout_bytes": 3,
        "stderr_bytes": 0,
        "session_restarted": False,
    }
    assert isinstance(r["duration_s"], float) and r["duration_s"] >= 0


def test_stdout_stderr_separate_and_no_trailing_newline(client):
    r = client.exec("printf out; printf err >&2")
    assert (r["stdout"], r["stderr"]) == ("out", "err")


@pytest.mark.parametrize(
    ("command", "code"),
    [
        ("true", 0),
        ("false", 1),
        ("(exit 42)", 42),
        ("definitely-not-a-command-xyz", 127),
        ("sh -c 'kill -TERM $$'", 143),
        ("sh -c 'kill -KILL $$'", 137),
    ],
)
def test_exit_status_exact(client, command, code):
    assert client.exec(command)["exit_code"] == code


def test_missing_command_message_on_stderr(client):
    r = client.exec("definitely-not-a-command-xyz")
    assert "not found" in r["stderr"] and r["stdout"] == ""


def test_state_persists_across_calls(client, tmp_path):
    client.exec(
        f"cd {tmp_path} && export EXECD_T=42 && greet() {{ echo hello $1; }}; "
        "alias sayhi='echo alias-hi'; shopt -s extglob; set -o pipefail; "
        "declare -A M=([k]=v); declare -a ARR=(a b c)"
    )
    r = client.exec(
        "pwd; echo $EXECD_T; greet x; sayhi; shopt -p extglob; "
        "[[ -o pipefail ]] && echo pf; echo ${M[k]} ${ARR[2]}"
    )
    assert r["stdout"].split("\n")[:-1] == [
        str(tmp_path),
        "42",
        "hello x",
        "alias-hi",
        "shopt -s extglob",
        "pf",
        "v c",
    ]
    client.exec("cd {}; unset EXECD_T".format(client.exec("echo $HOME")["stdout"].strip()))


def test_background_jobs_persist(client):
    client.exec("sleep 30 & echo started")
    r = client.exec("jobs")
    assert "sleep 30" in r["stdout"]
    assert client.exec("kill %1; wait %1; echo $?")["stdout"].strip() == "143"


def test_non_utf8_output_never_crashes(client):
    r = client.exec(r"printf 'a\xff\xfeb'; printf '\x80' >&2")
    assert r["stdout_bytes"] == 4 and r["stderr_bytes"] == 1
    assert r["stdout"] == "a\ufffd\ufffdb" and r["stderr"] == "\ufffd"


@pytest.mark.parametrize(
    "command",
    [
        "cat",
        "read x; echo rc=$?",
        "python3 -c 'import sys; print(len(sys.stdin.read()))'",
        "head -n1",
    ],
)
def test_stdin_is_eof(client, command):
    r = client.exec(command, timeout=10)
    # stdin at EOF: the command ends by itself, with success, instead of waiting for input
    assert not r["timed_out"] and r["exit_code"] == 0


def test_exit_n_returns_n_and_next_call_restarts(client):
    r = client.exec("echo before; exit 7")
    assert (r["exit_code"], r["stdout"]) == (7, "before\n")
    nxt = client.exec("echo again")
    assert nxt["stdout"] == "again\n" and nxt["session_restarted"] is True
    assert client.exec("true")["session_restarted"] is False


def test_set_e_failure_does_not_break_session(client):
    r = client.exec("set -e; false; echo unreachable")
    assert r["exit_code"] == 1 and "unreachable" not in r["stdout"]
    assert client.exec("echo ok")["stdout"] == "ok\n"


def test_set_e_alone_does_not_leak_into_next_call(client):
    client.exec("set -e")
    assert client.exec("false; echo survived")["stdout"] == "survived\n"


@pytest.mark.parametrize(
    "poison",
    [
        "exec >/dev/null",
        "exec 2>&-",
        "exec 1>&- 2>&-",
        "exec </dev/zero",
        "exec 251>&- 252>&- 253>&-",
        "shopt -u expand_aliases",
        "unalias -a",
        "source() { echo hijacked; }; export() { :; }; set() { :; }",
        "set -u; IFS=x",
    ],
)
def test_exec_redirections_do_not_break_session(client, poison):
    client.exec(poison + "; echo hidden")
    r = client.exec("echo visible; echo err >&2")
    client.exec("unset -f source export set; set +u; IFS=$' \\t\\n'")
    assert (r["stdout"], r["stderr"], r["session_restarted"]) == ("visible\n", "err\n", False)


def test_xtrace_shows_only_the_users_commands(client):
    client.exec("set -x")
    r = client.exec("echo traced")
    client.exec("set +x")
    # One trace line (bash marks the sourced level as "++"), none of execd's own.
    assert r["stdout"] == "traced\n"
    assert r["stderr"].splitlines() == ["++ echo traced"]


def test_heredoc_and_multiline(client):
    r = client.exec("cat <<'EOF'\nline $1\n  two\nEOF\nfor i in 1 2; do\n  echo n$i\ndone")
    assert r["stdout"] == "line $1\n  two\nn1\nn2\n"


def test_output_resembling_protocol(client):
    fake = "0 0\\n1 0\\n__execd_i=1;__execd\\n"
    r = client.exec("printf '%s' '" + fake + "'; printf '" + fake + "' >&2; echo done")
    assert r["stdout"].endswith("done\n") and "0 0" in r["stdout"] and r["exit_code"] == 0


def test_syntax_error_is_reported_and_session_survives(client):
    r = client.exec("if then fi")
    assert r["exit_code"] != 0 and "syntax error" in r["stderr"]
    assert client.exec("echo fine")["stdout"] == "fine\n"


def test_unicode_and_quotes_roundtrip(client):
    text = "héllo 'quoted' \"dq\" $HOME `x` \\ tab\t ✓"
    r = client.exec("cat <<'EOF'\n" + text + "\nEOF")
    assert r["stdout"] == text + "\n"


def test_large_command_text(client):
    r = client.exec("x=" + "a" * 200000 + "; echo ${#x}")
    assert r["stdout"] == "200000\n"


def test_timeout_kills_and_keeps_session(client, tmp_path):
    client.exec(f"cd {tmp_path}; export KEEP=yes")
    marker = f"30.{secrets.randbelow(10**6):06d}"  # names this test's sleep among all processes
    r = client.exec(f"echo partial; echo perr >&2; sleep {marker}; echo never", timeout=0.5)
    assert r["timed_out"] is True and r["exit_code"] is None
    # the command was killed, not left running behind the answer
    assert client.exec(f"pgrep -f 'sleep {marker}' || echo gone")["stdout"] == "gone\n"
    assert r["stdout"] == "partial\n" and r["stderr"].startswith("perr\n")
    after = client.exec("pwd; echo $KEEP")
    assert after["stdout"] == f"{tmp_path}\nyes\n" and not after["session_restarted"]


def test_timeout_on_builtin_loop_keeps_state(client):
    client.exec("export LOOPVAR=1; f() { while :; do :; done; }")
    r = client.exec("f; echo never", timeout=0.5)
    assert r["timed_out"] and "never" not in r["stdout"]
    r2 = client.exec("echo $LOOPVAR")
    assert r2["stdout"] == "1\n" and not r2["session_restarted"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def test_timeout_kills_whole_tree_including_escaped(client):
    r = client.exec(
        "(setsid sleep 300 & echo $! > /tmp/execd-esc-$$) ; "
        "(sleep 301 & echo $! > /tmp/execd-bg-$$); cat /tmp/execd-esc-$$ "
        "/tmp/execd-bg-$$; rm -f /tmp/execd-*-$$; sleep 302",
        timeout=1,
    )
    pids = [int(x) for x in r["stdout"].split()]
    assert r["timed_out"] and len(pids) == 2
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def test_timeout_spares_earlier_background_jobs(client):
    pid = int(client.exec("sleep 120 & echo $!")["stdout"])
    assert client.exec("sleep 30", timeout=0.3)["timed_out"]
    assert _alive(pid)
    client.exec(f"kill {pid}")


def test_output_cap_keeps_head_and_tail(client):
    r = client.exec(
        "echo HEAD; head -c 3000000 /dev/zero | tr '\\0' x; echo; echo TAIL", max_output_bytes=1000
    )
    assert r["truncated"] and r["stdout_bytes"] == 5 + 3000000 + 1 + 5
    assert r["stdout"].startswith("HEAD\nxxx") and r["stdout"].endswith("xxx\nTAIL\n")
    assert len(r["stdout"]) < 1200


def test_default_output_cap_is_one_mib(client):
    r = client.exec("head -c 3000000 /dev/zero")
    assert r["truncated"] and r["stdout_bytes"] == 3000000
    assert 1024 * 1024 <= len(r["stdout"]) < 1024 * 1024 + 200


def test_huge_output_does_not_exhaust_memory(daemon, client):
    def rss_kb():  # the high-water mark: any burst while streaming counts
        with open(f"/proc/{daemon.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM"):
                    return int(line.split()[1])
        return 0

    r = client.exec("head -c 400000000 /dev/zero", max_output_bytes=4096, timeout=120)
    assert r["stdout_bytes"] == 400000000 and r["truncated"]
    assert rss_kb() < 100 * 1024


def test_concurrent_requests_never_mix(daemon):
    results = {}

    def worker(i):
        c = daemon.client()
        results[i] = c.exec(f"echo start-{i}; sleep 0.02; echo end-{i}")
        c.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, r in results.items():
        assert r["stdout"] == f"start-{i}\nend-{i}\n"
    assert len(results) == 8


def test_orphans_are_reaped(daemon, client):
    client.exec("( sh -c 'sleep 0.2 & exit 0' & ); ( sleep 0.1 & )")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        zombies = [p for p, state in proc_children(daemon.pid) if state == "Z"]
        sleepers = [p for p, state in proc_children(daemon.pid) if state != "Z"]
        if not zombies and len(sleepers) <= 1:
            break
        time.sleep(0.05)
    assert zombies == []
    assert client.request("GET", "/v1/info")[1]["orphans_reaped"] >= 1


def test_token_absent_from_command_env_and_logs(daemon, client):
    env = client.exec("env")["stdout"]
    assert daemon.token not in env and "SANDMAN_EXECD_TOKEN" not in env
    # The exec-time environment block of execd itself is blanked too.
    raw = client.exec(f"tr '\\0' '\\n' < /proc/{daemon.pid}/environ")["stdout"]
    assert "SANDMAN_EXECD_TOKEN=" in raw and daemon.token not in raw
    client.request("POST", "/v1/exec", {"command": "echo " + daemon.token})
    client.request("GET", "/v1/info", headers={"Authorization": "Bearer wrong-" + daemon.token})
    assert daemon.token not in daemon.log()


def test_reset_kills_everything_and_starts_fresh(fresh_daemon):
    c = fresh_daemon.client()
    pid = int(c.exec("cd /; export GONE=1; sleep 100 & (setsid sleep 101 &); echo $!")["stdout"])
    r = c.post("/v1/reset")
    assert r["ok"] is True and r["killed"] >= 2
    assert not _alive(pid)
    after = c.exec("pwd; echo ${GONE-unset}; jobs")
    assert after["stdout"] == f"{fresh_daemon.workdir}\nunset\n"
    assert os.path.samefile(after["stdout"].split()[0], fresh_daemon.workdir)


def test_workdir_is_starting_directory(daemon, client):
    c = daemon.client()
    assert c.exec("true")  # the module daemon may have moved; a reset goes back
    c.post("/v1/reset")
    assert c.exec("pwd")["stdout"].strip() == str(daemon.workdir)


def test_timeout_when_command_blocks_the_unwinding(client):
    r = client.exec("trap '' USR1; while :; do :; done", timeout=0.3)
    assert r["timed_out"] and r["exit_code"] is None
    nxt = client.exec("echo back")
    assert nxt["stdout"] == "back\n" and nxt["session_restarted"] is True


def test_runtime_dir_removed_by_a_command(client):
    r = client.exec(
        'd=$(alias __execd | grep -o "source [^ ]*" | cut -d" " -f2); '
        'rm -rf "$(dirname "$d")"; echo removed'
    )
    assert r["stdout"] == "removed\n"
    assert client.exec("echo still-works")["stdout"] == "still-works\n"


def test_reset_interrupts_a_running_command(fresh_daemon):
    c1, c2 = fresh_daemon.client(), fresh_daemon.client()
    result = {}
    t = threading.Thread(target=lambda: result.update(c1.exec("sleep 100; sleep 100", timeout=300)))
    t.start()
    time.sleep(0.5)
    assert c2.post("/v1/reset")["killed"] >= 1
    t.join(60)
    assert not t.is_alive()  # the running exec answered: its command was interrupted
    assert result["exit_code"] is not None and result["exit_code"] >= 128
    assert c2.exec("echo fresh")["stdout"] == "fresh\n"


def test_exec_replacing_the_shell_returns_its_status(client):
    r = client.exec("exec sh -c 'echo replaced; exit 5'")
    assert (r["exit_code"], r["stdout"]) == (5, "replaced\n")
    assert client.exec("echo ok")["session_restarted"] is True


def test_stray_background_output_between_calls_is_not_attributed(client):
    client.exec("(sleep 0.3; echo late) &")
    time.sleep(0.8)
    assert client.exec("echo now")["stdout"] == "now\n"


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=3000))
def test_output_bytes_survive_the_pipes(client, tmp_path, data):
    client.write(tmp_path / "out.bin", data)
    r = client.exec(f"cat {tmp_path}/out.bin; cat {tmp_path}/out.bin >&2")
    assert r["stdout_bytes"] == r["stderr_bytes"] == len(data)
    assert r["stdout"] == r["stderr"] == data.decode("utf-8", "replace")


def test_both_streams_flooding_at_once(client):
    r = client.exec(
        "head -c 3000000 /dev/zero >&2 & head -c 3000000 /dev/zero; wait", max_output_bytes=100
    )
    assert (r["stdout_bytes"], r["stderr_bytes"], r["truncated"]) == (3000000, 3000000, True)


def test_timeout_while_flooding_output(client):
    r = client.exec("yes", timeout=0.5, max_output_bytes=1000)
    assert r["timed_out"] and r["truncated"] and r["stdout_bytes"] > 1000
    assert r["stdout"].startswith("y\ny\n") and len(r["stdout"]) < 1100
    assert client.exec("echo calm")["stdout"] == "calm\n"
