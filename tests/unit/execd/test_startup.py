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
