"""Layers onto a root: whiteouts, metadata, links, and every escape refused (ImageInvalid)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from broker.errors import ImageInvalid
from broker.images.unpack import unpack
from tests.unit.images.layers import layer

pytestmark = pytest.mark.unit


def test_layers_apply_in_order_with_whiteouts_and_opaque_dirs(tmp_path: Path) -> None:
    low = layer(tmp_path / "l1.tar", [
        ("etc", "dir"), ("etc/keep", "file", "k"), ("etc/gone", "file", "g"),
        ("opt/app", "dir"), ("opt/app/old", "file", "o"), ("var/d/x", "file", "x"),
    ])  # fmt: skip
    high = layer(tmp_path / "l2.tar", [
        ("opt/app/new", "file", "n"),  # listed BEFORE the opaque marker: must survive it
        ("opt/app/.wh..wh..opq", "file"),
        ("etc/.wh.gone", "file"), ("var/.wh.d", "file"), ("etc/keep", "file", "k2"),
    ])  # fmt: skip
    root = tmp_path / "root"
    root.mkdir()
    unpack(root, [low, high])
    assert (root / "etc/keep").read_text() == "k2"
    assert not (root / "etc/gone").exists()
    assert not (root / "var/d").exists()
    assert sorted(os.listdir(root / "opt/app")) == ["new"]
    assert not list(root.rglob(".wh.*"))


def test_owners_modes_symlinks_hardlinks_and_fifos(tmp_path: Path) -> None:
    tar = layer(tmp_path / "l.tar", [
        ("bin", "dir"), ("bin/tool", "file", "#!", 0o4755, 1234),
        ("bin/alias", "sym", "/bin/tool"), ("bin/hard", "link", "bin/tool"),
        ("run/pipe", "fifo"), ("secret", "dir", None, 0o700, 42),
    ])  # fmt: skip
    root = tmp_path / "root"
    root.mkdir()
    unpack(root, [tar])
    tool = (root / "bin/tool").stat()
    assert stat.S_IMODE(tool.st_mode) == 0o4755
    assert tool.st_mtime == 1_700_000_000
    if os.geteuid() == 0:
        assert tool.st_uid == 1234
        assert (root / "secret").stat().st_uid == 42
    assert os.readlink(root / "bin/alias") == "/bin/tool"  # resolved inside the sandbox
    assert (root / "bin/hard").stat().st_ino == tool.st_ino
    assert stat.S_ISFIFO((root / "run/pipe").lstat().st_mode)
    assert stat.S_IMODE((root / "secret").stat().st_mode) == 0o700


@pytest.mark.parametrize(
    "entries",
    [
        [("/etc/passwd", "file", "x")],
        [("../outside", "file", "x")],
        [("a/../../outside", "file", "x")],
        [("evil", "sym", "/"), ("evil/etc/passwd", "file", "x")],
        [("evil", "sym", "../../.."), ("evil/x", "file", "x")],
        [("up", "link", "../../etc/passwd")],
        [("dev/sda", "chr")],
    ],
    ids=[
        "absolute",
        "dotdot",
        "nested-dotdot",
        "symlink-parent",
        "relative-symlink-parent",
        "hardlink-out",
        "device",
    ],
)
def test_escapes_are_refused(tmp_path: Path, entries: list[tuple]) -> None:
    outside = tmp_path / "outside"
    root = tmp_path / "sub" / "root"
    root.mkdir(parents=True)
    with pytest.raises(ImageInvalid):
        unpack(root, [layer(tmp_path / "bad.tar", entries)])
    assert not outside.exists()
    assert not (tmp_path / "x").exists()


def test_gzip_layers_and_a_broken_layer(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    unpack(root, [layer(tmp_path / "l.tgz", [("a", "file", "z")], gzip=True)])
    assert (root / "a").read_text() == "z"
    broken = tmp_path / "broken.tar"
    broken.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(ImageInvalid):
        unpack(root, [broken])


def test_a_whiteout_never_deletes_through_a_lower_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "x").write_text("host file")
    root = tmp_path / "root"
    root.mkdir()
    low = layer(tmp_path / "l1.tar", [("evil", "sym", str(victim))])
    high = layer(tmp_path / "l2.tar", [("evil/.wh.x", "file")])
    with pytest.raises(ImageInvalid):
        unpack(root, [low, high])
    assert (victim / "x").read_text() == "host file"


@pytest.mark.parametrize("name", [".wh...", ".wh..", ".wh.", "sub/.wh...", "sub/.wh."])
def test_a_whiteout_of_the_parent_or_above_is_refused(tmp_path: Path, name: str) -> None:
    """``.wh...`` names ``..``: it would remove the unpack root's parent (every other
    unpacked image); ``.wh.`` and ``.wh..`` name the directory itself."""
    images = tmp_path / "rootfs"
    sibling = images / "other-digest"
    sibling.mkdir(parents=True)
    (sibling / "file").write_text("another image")
    root = images / "this-digest"
    root.mkdir()
    base = layer(tmp_path / "l1.tar", [("sub", "dir"), ("sub/keep", "file", "k")])
    with pytest.raises(ImageInvalid):
        unpack(root, [base, layer(tmp_path / "l2.tar", [(name, "file")])])
    assert (sibling / "file").read_text() == "another image"
    assert (root / "sub" / "keep").read_text() == "k"
