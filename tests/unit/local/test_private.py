"""Private dirs and files of the state dir (broker.local.private)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from broker.local.private import private_dir, tighten, write_private

pytestmark = pytest.mark.unit


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_private_dir_creates_and_tightens_but_keeps_only_the_granted_traverse(
    tmp_path: Path,
) -> None:
    made = private_dir(tmp_path / "a" / "b")
    assert _mode(made) == 0o700
    made.chmod(0o755)
    assert _mode(private_dir(made)) == 0o700
    made.chmod(0o711)  # group and other traverse
    assert _mode(private_dir(made, traverse_gid=made.stat().st_gid)) == 0o710
    assert _mode(private_dir(made, traverse_gid=made.stat().st_gid + 1)) == 0o700


def test_tighten_strips_group_and_other_bits_below_a_dir(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir(mode=0o755)
    (tmp_path / "d" / "aof").write_text("token")
    (tmp_path / "d" / "aof").chmod(0o644)
    (tmp_path / "d" / "run.sh").write_text("")
    (tmp_path / "d" / "run.sh").chmod(0o755)
    tighten(tmp_path / "d")
    assert _mode(tmp_path / "d") == 0o700
    assert _mode(tmp_path / "d" / "aof") == 0o600
    assert _mode(tmp_path / "d" / "run.sh") == 0o700


def test_write_private_replaces_with_an_owner_only_file(tmp_path: Path) -> None:
    path = tmp_path / "services.json"
    path.write_text("old")
    path.chmod(0o644)
    old_umask = os.umask(0)
    try:
        write_private(path, "new")
    finally:
        os.umask(old_umask)
    assert path.read_text() == "new" and _mode(path) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["services.json"]  # no temp file left
