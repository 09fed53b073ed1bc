"""``sandman image import|ls|rm`` as a user runs them, on a store of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker.settings import Settings
from tests.support.images import TASK_IMAGE

pytestmark = pytest.mark.integration
SANDMAN = str(Path(sys.executable).parent / "sandman")


def _run(env: dict[str, str], *args: str, stdin: bytes | None = None) -> str:
    proc = subprocess.run(
        [SANDMAN, "image", *args], env=env, input=stdin, capture_output=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode()


def test_import_from_stdin_ls_and_rm(tmp_path: Path) -> None:
    index = Settings().cache_dir / "images" / "index.tsv"
    tarballs = dict(line.split("\t", 1) for line in index.read_text().splitlines())
    env = {**os.environ, "SANDMAN_CACHE_DIR": str(tmp_path / "cache")}
    archive = Path(tarballs[TASK_IMAGE]).read_bytes()
    imported = _run(env, "import", "-", "--tag", "localhost/mine:1", stdin=archive)
    refs = {line.split("\t")[0]: line.split("\t")[1] for line in imported.splitlines()}
    assert set(refs) == {TASK_IMAGE, "localhost/mine:1"}
    assert len(set(refs.values())) == 1
    listed = _run(env, "ls")
    assert "localhost/mine:1" in listed and "\t-" in listed  # not unpacked before first use
    assert _run(env, "rm", "localhost/mine:1").strip() == "removed localhost/mine:1"
    assert "localhost/mine:1" not in _run(env, "ls")
    missing = subprocess.run(
        [SANDMAN, "image", "rm", "localhost/mine:1"], env=env, capture_output=True, check=False
    )
    assert missing.returncode != 0 and b"ImageNotFound" in missing.stderr
