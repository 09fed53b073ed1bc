"""SANDMAN_EXECD_VISIBLE_CPUS: execd delivers a visible CPU count to everything it starts."""

import os
import subprocess

import pytest

from tests.support.execd_daemon import REPO, Daemon, oldest_python

pytestmark = pytest.mark.integration

HOST_CPUS = len(os.sched_getaffinity(0))


def _visible(d: Daemon) -> dict[str, str]:
    """nproc (it reads the affinity) in the default shell, a named session and a run."""
    c = d.client()
    c.post("/v1/sessions/open", {"name": "s"})
    return {
        "default": c.exec("nproc")["stdout"].strip(),
        "session": c.exec("nproc", session="s")["stdout"].strip(),
        "run": c.post("/v1/run", {"argv": ["nproc"]})["stdout"].strip(),
        "bash_child": c.exec("bash -c nproc")["stdout"].strip(),
    }


def test_one_visible_cpu_reaches_every_shell_and_run(tmp_path):
    d = Daemon(tmp_path, env={"SANDMAN_EXECD_VISIBLE_CPUS": "1"})
    try:
        assert _visible(d) == dict.fromkeys(("default", "session", "run", "bash_child"), "1")
        assert os.sched_getaffinity(d.pid) == {min(os.sched_getaffinity(0))}
    finally:
        d.stop()


def test_unset_or_too_many_leaves_the_affinity_alone(tmp_path):
    for env, name in (({}, "unset"), ({"SANDMAN_EXECD_VISIBLE_CPUS": "4096"}, "many")):
        (tmp_path / name).mkdir()
        d = Daemon(tmp_path / name, env=env)
        try:
            assert set(_visible(d).values()) == {str(HOST_CPUS)}
            if name == "many":
                assert f"only {HOST_CPUS} CPUs are allowed" in d.log()
        finally:
            d.stop()


@pytest.mark.parametrize("bad", ["0", "two", "-1"])
def test_a_bad_value_stops_execd(tmp_path, bad):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDMAN_")}
    env.update(SANDMAN_EXECD_VISIBLE_CPUS=bad, SANDMAN_EXECD_TOKEN="t")
    done = subprocess.run(
        [oldest_python(), "-m", "execd", "--listen", "127.0.0.1:0", "--workdir", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0
    assert "SANDMAN_EXECD_VISIBLE_CPUS must be a positive integer" in done.stderr
