"""Snapshots and fork on the local backend, both transports and both blob stores (the
state dir's filesystem and a real S3 server: conftest.py), against the real stack.

A SWE-style sandbox (the SWE image's git repository at /repo as the workdir, so the
default roots are that repository) is changed in every way a snapshot must carry: new
files and directories, a deleted file of the image, modes, a symlink, the shell's cwd and
an exported variable. Its forks must show all of it, and be independent of each other
and of their source.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from broker.errors import SandmanError
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.settings import Settings
from tests.integration.client.test_transports import Handle, Trainer
from tests.support.images import SWE_IMAGE

pytestmark = pytest.mark.integration


def _job(sessions: Any, name: str, **config: Any) -> str:
    with sessions.begin() as session:
        store.ensure_job(session, name, **config)
    return name


def _out(sb: Handle, command: str) -> str:
    result = sb.exec(command)
    assert result.exit_code == 0, (command, result.stdout, result.stderr)
    return str(result.stdout)


def _change_everything(sb: Handle) -> str:
    """Every kind of change; returns the image file it deleted."""
    victim = _out(sb, "cd /repo && git ls-files | sort | head -1").strip()
    assert victim
    sb.write_file("/repo/new/deep/file.txt", "forked content\n", mode=0o640)
    sb.write_file("/repo/run.sh", "#!/bin/sh\necho ran\n", mode=0o751)
    _out(sb, f"rm /repo/{shlex.quote(victim)}")
    _out(sb, "ln -s new/deep/file.txt /repo/link && chmod 0750 /repo/new/deep")
    _out(sb, "cd /repo/new && export FORK_VAR='a b'")
    return victim


def _check_carried(sb: Handle, victim: str) -> None:
    assert sb.read_text("/repo/new/deep/file.txt") == "forked content\n"
    modes = _out(sb, "stat -c '%a %n' /repo/new/deep/file.txt /repo/run.sh /repo/new/deep")
    assert modes.split("\n")[:3] == [
        "640 /repo/new/deep/file.txt",
        "751 /repo/run.sh",
        "750 /repo/new/deep",
    ]
    assert _out(sb, "readlink /repo/link").strip() == "new/deep/file.txt"
    assert _out(sb, "cat /repo/link") == "forked content\n"
    assert _out(sb, f"test -e /repo/{shlex.quote(victim)} && echo present || echo gone") == (
        "gone\n"
    )
    assert _out(sb, 'pwd; echo "$FORK_VAR"') == "/repo/new\na b\n"
    assert _out(sb, "/repo/run.sh") == "ran\n"


def check_forks(source: Handle, forks: list[Handle], victim: str) -> None:
    """Every fork carries every change; a write and a delete in one are its own."""
    for fork in forks:
        _check_carried(fork, victim)
    forks[0].write_file("/repo/only-in-fork-0", "x")
    _out(forks[0], "rm /repo/run.sh")
    seen = "for f in only-in-fork-0 run.sh; do test -e /repo/$f && echo $f; done; true"
    assert _out(forks[0], seen) == "only-in-fork-0\n"
    assert _out(forks[1], seen) == "run.sh\n"  # fork 0's write and delete are its own
    assert _out(source, seen) == "run.sh\n"


def test_fork_carries_every_change_and_forks_are_independent(
    make_trainer: Callable[..., Trainer], sessions: Any, stack: Settings
) -> None:
    trainer = make_trainer(owner="fork")
    job = _job(sessions, f"fork-{trainer.flavour}-{stack.installation_id}")  # one per store
    sb = trainer.open(image=SWE_IMAGE, job=job, workdir="/repo", timeout=120)
    forks: list[Any] = []
    try:
        victim = _change_everything(sb)
        forks = sb.fork(2)
        assert all(not isinstance(f, SandmanError) for f in forks), forks
        check_forks(sb, [Handle(f, trainer.run) for f in forks], victim)
    finally:
        for fork in forks:
            if not isinstance(fork, SandmanError):
                Handle(fork, trainer.run).release()
        sb.release()


def test_a_restore_reads_its_blobs_from_a_read_only_inbox_and_no_more_of_the_store(
    make_trainer: Callable[..., Trainer], sessions: Any, stack: Settings
) -> None:
    """The local backend's restore hard-links the blobs into the fork's own inbox (bound
    read-only at /sandman/inbox) and removes them after: the fork cannot write there,
    finds it empty, and sees nothing of the store. (An S3 store has no local files: its
    restores stream, and the inbox is never used.)"""
    trainer = make_trainer(owner="inbox")
    job = _job(sessions, f"inbox-{trainer.flavour}")
    sb = trainer.open(image=SWE_IMAGE, job=job, workdir="/repo", timeout=120)
    forks: list[Any] = []
    try:
        sb.write_file("/repo/data.bin", b"inbox content\n" * 1000)
        forks = sb.fork(1)
        assert not isinstance(forks[0], SandmanError), forks
        fork = Handle(forks[0], trainer.run)
        assert fork.read_text("/repo/data.bin") == "inbox content\n" * 1000
        with sessions() as session:
            row = session.get(Sandbox, fork.id)
            assert row is not None
            pod = Path(stack.state_dir) / "local-pods" / row.pod_name
        # The restore made and removed its directory of links there after the start.
        used = (pod / "inbox").stat().st_mtime_ns > (
            pod.parent / f"{row.pod_name}.json"
        ).stat().st_mtime_ns
        assert used == (not stack.snapshot_store), stack.snapshot_store
        assert list((pod / "inbox").iterdir()) == []
        assert _out(fork, "ls -A /sandman/inbox") == ""
        denied = fork.exec("touch /sandman/inbox/x || mkdir /sandman/inbox/d")
        assert denied.exit_code != 0 and "Read-only file system" in denied.stderr
        store_dir = Path(stack.state_dir) / "snapshots"
        assert _out(fork, f"test -e {shlex.quote(str(store_dir))} && echo seen || echo hidden") == (
            "hidden\n"
        )
    finally:
        for fork in forks:
            if not isinstance(fork, SandmanError):
                Handle(fork, trainer.run).release()
        sb.release()
