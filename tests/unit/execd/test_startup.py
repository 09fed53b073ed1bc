"""What an idle execd carries: the modules it imports at start, its command line and log
lines without argparse and logging (each module kept out is memory in every sandbox)."""

import io
import subprocess
from pathlib import Path

import pytest

from execd import cli, logs
from tests.support.execd_daemon import oldest_python

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[3]

# Each is imported only by the endpoint that needs it (files, snapshots, runs, shutdown).
HEAVY = {
    "_hashlib",  # OpenSSL's libcrypto: 3 MiB resident
    "hashlib",
    "hmac",
    "argparse",
    "logging",
    "dataclasses",
    "inspect",
    "ast",
    "subprocess",
    "shutil",
    "tempfile",
    "random",
    "typing",  # annotations only (execd/__init__.py): 0.6 MiB with what it pulls in
    "ctypes",  # the subreaper prctl goes through _ctypes, the scrub through /proc
    "base64",  # binascii's two functions instead (files.b64encode/b64decode)
    "struct",
    "contextlib",  # errors.suppress; and execd is started with -c, so no runpy pulls it in
    "runpy",
    # The parts made on first use (execd/api.py): runs, the state baseline, snapshots.
    "execd.run",
    "execd.runspec",
    "execd.runreply",
    "execd.state",
    "execd.snapshot",
    "execd.treescan",
    "execd.sessionstate",
}


def test_execd_starts_without_the_heavy_modules():
    out = subprocess.run(
        [
            oldest_python(),
            "-S",
            "-c",
            "import sys, execd.__main__; print(' '.join(sorted(sys.modules)))",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert sorted(HEAVY & set(out.split())) == []


def test_the_import_check_sees_a_heavy_module():
    out = subprocess.run(
        [oldest_python(), "-S", "-c", "import sys, hmac; print(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert {"hmac", "_hashlib"} <= HEAVY & set(out.split())


def test_cli_defaults_and_values():
    args = cli.parse_args([])
    assert (args.listen, args.listen_fd, args.max_runs, args.insecure_no_auth) == (
        ("0.0.0.0", 8000),
        None,
        32,
        False,
    )
    args = cli.parse_args(
        ["--listen", "[::1]:0", "--max-runs=3", "--idle-timeout", "1.5", "--insecure-no-auth"]
    )
    assert (args.listen, args.max_runs, args.idle_timeout, args.insecure_no_auth) == (
        ("::1", 0),
        3,
        1.5,
        True,
    )
    assert cli.parse_args(["--log-level", "DEBUG"]).log_level == "DEBUG"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--listen", "nohost"], "--listen wants HOST:PORT"),
        (["--max-runs", "x"], "invalid int value: 'x'"),
        (["--log-level", "LOUD"], "invalid choice: 'LOUD'"),
        (["--workdir"], "expected one argument"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--insecure-no-auth=1"], "ignored explicit argument"),
    ],
)
def test_cli_refuses_with_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_help_and_version(capsys):
    for word, expect in (("--help", "--max-sessions VALUE"), ("--version", "0.1.0")):
        with pytest.raises(SystemExit) as exc:
            cli.parse_args([word])
        assert exc.value.code == 0
        assert expect in capsys.readouterr().out


def test_log_lines_keep_the_logging_format_and_level():
    stream = io.StringIO()
    logs.configure("INFO", stream)
    try:
        log = logs.getLogger("execd.test")
        log.debug("hidden %d", 1)
        log.info("shown %d %s", 2, "x")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed on %s", "y")
    finally:
        logs.configure("WARNING", None)
    lines = stream.getvalue().splitlines()
    assert "hidden" not in stream.getvalue()
    assert lines[0].endswith(" INFO execd.test: shown 2 x")
    assert lines[0][:4].isdigit() and lines[0][19] == ","  # "YYYY-MM-DD HH:MM:SS,mmm"
    assert lines[1].endswith(" ERROR execd.test: failed on y")
    assert lines[-1] == "RuntimeError: boom"


def test_log_line_with_bad_arguments_is_still_written():
    stream = io.StringIO()
    logs.configure("INFO", stream)
    try:
        logs.getLogger("x").info("%d items", "many")
    finally:
        logs.configure("WARNING", None)
    assert "%d items ('many',)" in stream.getvalue()


# Blanks the token in this process's exec-time environment block by the way named in
# argv[1], then prints what /proc/self/environ shows and whether ctypes was imported.
SCRUB = """
import sys
from execd import __main__ as m
getattr(m, sys.argv[1])({b"SANDMAN_EXECD_TOKEN", b"EMPTY"})
with open("/proc/self/environ", "rb") as f:
    print(sorted(f.read().split(b"\\0")), "ctypes" in sys.modules)
"""


@pytest.mark.parametrize(
    ("way", "imports_ctypes"), [("_scrub_via_proc", False), ("_scrub_via_libc", True)]
)
def test_both_scrubs_blank_the_token_in_the_exec_time_environment(way, imports_ctypes):
    out = subprocess.run(
        [oldest_python(), "-S", "-c", SCRUB, way],
        cwd=REPO,
        env={"SANDMAN_EXECD_TOKEN": "s3cret", "KEEP": "s3cret", "EMPTY": ""},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    entries = "[b'', b'EMPTY=', b'KEEP=s3cret', b'SANDMAN_EXECD_TOKEN=xxxxxx']"
    assert out.split("\n")[0] == f"{entries} {imports_ctypes}"


def test_libc_call_returns_the_errno_without_ctypes():
    code = (
        "import sys; from execd.reaper import libc_call; "
        "print(libc_call('prctl', 9999, 0, 0, 0, 0), libc_call('prctl', 36, 1, 0, 0, 0), "
        "'ctypes' in sys.modules)"
    )
    out = subprocess.run(
        [oldest_python(), "-S", "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["22", "0", "False"]  # EINVAL for an unknown option
