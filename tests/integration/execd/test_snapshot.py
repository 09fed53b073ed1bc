"""execd's snapshot routes on their own (on the oldest Python execd supports): a capture
lists everything, a restore brings a changed tree back exactly and verifies it, a put is
streamed past the body limit, and a wrong blob is refused without breaking the connection.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.execd_daemon import Client, Daemon

pytestmark = pytest.mark.integration
LIMIT = 1 << 20  # --max-body-bytes: a put larger than this must still pass


@pytest.fixture
def small_body_daemon(tmp_path: Path) -> Any:
    d = Daemon(tmp_path, args=["--max-body-bytes", str(LIMIT)])
    yield d
    d.stop()


def _pack(files: list[tuple[str, bytes, str | None, int]]) -> bytes:
    """A put pack: per file a JSON head line, then its bytes."""
    out = b""
    for path, data, sha, mode in files:
        head = {"p": path, "s": len(data), "d": sha or hashlib.sha256(data).hexdigest(), "m": mode}
        out += json.dumps(head).encode() + b"\n" + data
    return out


def _put(c: Client, files: list[tuple[str, bytes, str | None, int]]) -> Any:
    return c.request(
        "PUT", "/v1/snapshot/put", _pack(files), {"Content-Type": "application/octet-stream"}
    )


def _blob(daemon: Any, path: str) -> bytes:
    """The raw bytes of ``/v1/snapshot/blob`` (not JSON: the test client cannot read it)."""
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    try:
        conn.request(
            "POST",
            "/v1/snapshot/blob",
            json.dumps({"path": path}),
            {"Authorization": "Bearer " + daemon.token},
        )
        resp = conn.getresponse()
        assert resp.status == 200
        return resp.read()
    finally:
        conn.close()


def _restore(c: Client, listing: dict[str, Any], contents: dict[str, bytes]) -> Any:
    body = {"roots": listing["roots"], "entries": listing["entries"]}
    need = c.post("/v1/snapshot/prepare", body)["need"]
    modes = {e["p"]: e["m"] for e in listing["entries"]}
    if need:  # every file in one pack
        files = [(e["p"], contents[e["p"]], None, modes[e["p"]]) for e in need]
        code, doc = _put(c, files)
        assert (code, doc["files"]) == (200, len(need)), doc
    return need, c.request("POST", "/v1/snapshot/finish", {**body, "session": listing["session"]})


def test_a_changed_tree_is_restored_exactly_and_verified(small_body_daemon: Any) -> None:
    c = small_body_daemon.client()
    work = small_body_daemon.workdir
    (work / "src" / "deep").mkdir(parents=True)
    big = os.urandom(4 * LIMIT)
    files = {"src/deep/big.bin": big, "src/a.py": b"print(1)\n", "run.sh": b"#!/bin/sh\n"}
    for rel, data in files.items():
        (work / rel).write_bytes(data)
    os.chmod(work / "run.sh", 0o751)
    os.symlink("src/a.py", work / "link")
    c.exec("cd src && export SNAP_VAR=kept")
    listing = c.post("/v1/snapshot/capture")
    assert listing["session"]["cwd"] == str(work / "src")
    kinds = sorted((e["p"][len(str(work)) :], e["k"]) for e in listing["entries"])
    assert kinds == [
        ("", "d"), ("/link", "l"), ("/run.sh", "f"), ("/src", "d"), ("/src/a.py", "f"),
        ("/src/deep", "d"), ("/src/deep/big.bin", "f"),
    ]  # fmt: skip
    contents = {str(work / rel): data for rel, data in files.items()}
    assert _blob(small_body_daemon, str(work / "src/deep/big.bin")) == big
    # Change everything, then restore.
    (work / "src/a.py").write_bytes(b"changed\n")
    (work / "run.sh").unlink()
    (work / "link").unlink()
    (work / "extra").mkdir()
    (work / "extra/f").write_bytes(b"x")
    c.exec("cd / && export SNAP_VAR=lost")
    need, (code, doc) = _restore(c, listing, contents)
    assert code == 200, doc
    assert sorted(n["p"] for n in need) == [str(work / "run.sh"), str(work / "src/a.py")]
    assert (work / "src/a.py").read_bytes() == b"print(1)\n"
    assert oct(os.stat(work / "run.sh").st_mode & 0o7777) == oct(0o751)
    assert os.readlink(work / "link") == "src/a.py"
    assert not (work / "extra").exists()
    assert c.exec('pwd; echo "$SNAP_VAR"')["stdout"] == f"{work / 'src'}\nkept\n"
    # The big file went through a put four times the body limit.
    (work / "src/deep/big.bin").unlink()
    need, (code, doc) = _restore(c, listing, contents)
    assert code == 200, doc
    assert [n["p"] for n in need] == [str(work / "src/deep/big.bin")]
    assert (work / "src/deep/big.bin").read_bytes() == big


def test_a_wrong_blob_or_a_tampered_tree_is_refused(small_body_daemon: Any) -> None:
    c = small_body_daemon.client()
    work = small_body_daemon.workdir
    (work / "f").write_bytes(b"right")
    listing = c.post("/v1/snapshot/capture")
    (work / "f").unlink()
    c.post("/v1/snapshot/prepare", {"roots": listing["roots"], "entries": listing["entries"]})
    wrong = hashlib.sha256(b"right").hexdigest()
    code, doc = _put(c, [(str(work / "f"), b"wrong", wrong, 0o644)])
    assert (code, doc["error"]["code"]) == (422, "blob_mismatch")
    assert not (work / "f").exists()
    assert c.exec("echo same connection")["stdout"] == "same connection\n"
    assert _put(c, [(str(work / "f"), b"right", None, 0o644)])[0] == 200
    (work / "f").write_bytes(b"tampered after the put")
    code, doc = c.request(
        "POST", "/v1/snapshot/finish", {"roots": listing["roots"], "entries": listing["entries"]}
    )
    assert (code, doc["error"]["code"]) == (422, "restore_mismatch")
    assert "differs " + str(work / "f") in doc["error"]["message"]


def _blob_dir(tmp: Path, blobs: list[bytes]) -> Path:
    """A directory of blobs named by SHA-256, as the local backend's inbox holds them."""
    tmp.mkdir()
    for data in blobs:
        (tmp / hashlib.sha256(data).hexdigest()).write_bytes(data)
    return tmp


def _copy(c: Client, src: Path, need: list[dict[str, Any]], modes: dict[str, int]) -> Any:
    files = [{**n, "m": modes[n["p"]]} for n in need]
    return c.request("POST", "/v1/snapshot/copy", {"dir": str(src), "files": files})


def test_a_restore_copies_its_blobs_from_a_local_directory(
    small_body_daemon: Any, tmp_path: Path
) -> None:
    c = small_body_daemon.client()
    work = small_body_daemon.workdir
    big, small = os.urandom(3 * LIMIT + 17), b"print(1)\n"
    (work / "big.bin").write_bytes(big)
    (work / "a.py").write_bytes(small)
    (work / "same.py").write_bytes(small)
    os.chmod(work / "a.py", 0o640)
    listing = c.post("/v1/snapshot/capture")
    for name in ("big.bin", "a.py", "same.py"):
        (work / name).unlink()
    body = {"roots": listing["roots"], "entries": listing["entries"]}
    need = c.post("/v1/snapshot/prepare", body)["need"]
    assert len(need) == 3
    src = _blob_dir(tmp_path / "inbox", [big, small])
    code, doc = _copy(c, src, need, {e["p"]: e["m"] for e in listing["entries"]})
    assert (code, doc["files"]) == (200, 3), doc
    assert c.request("POST", "/v1/snapshot/finish", body)[0] == 200
    assert (work / "big.bin").read_bytes() == big
    assert (work / "same.py").read_bytes() == small
    assert oct(os.stat(work / "a.py").st_mode & 0o7777) == oct(0o640)
    assert sorted(os.listdir(src)) == sorted(hashlib.sha256(d).hexdigest() for d in (big, small))


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda data: b"X" + data[1:],  # same size, other bytes
        lambda data: data[:-1],  # shorter
        lambda data: data + b"!",  # longer
    ],
    ids=["flipped", "short", "long"],
)
def test_a_corrupted_local_blob_is_refused_and_nothing_is_written(
    small_body_daemon: Any, tmp_path: Path, corrupt: Any
) -> None:
    c = small_body_daemon.client()
    work = small_body_daemon.workdir
    data = os.urandom(LIMIT + 5)
    (work / "f").write_bytes(data)
    listing = c.post("/v1/snapshot/capture")
    (work / "f").unlink()
    body = {"roots": listing["roots"], "entries": listing["entries"]}
    need = c.post("/v1/snapshot/prepare", body)["need"]
    src = tmp_path / "inbox"
    src.mkdir()
    (src / hashlib.sha256(data).hexdigest()).write_bytes(corrupt(data))
    code, doc = _copy(c, src, need, {e["p"]: e["m"] for e in listing["entries"]})
    assert (code, doc["error"]["code"]) == (422, "blob_mismatch"), doc
    assert sorted(os.listdir(work)) == []  # neither the file nor a temporary one
    assert c.exec("echo same connection")["stdout"] == "same connection\n"


def test_a_local_blob_that_is_a_link_or_missing_is_refused(
    small_body_daemon: Any, tmp_path: Path
) -> None:
    c = small_body_daemon.client()
    work = small_body_daemon.workdir
    (work / "f").write_bytes(b"content")
    listing = c.post("/v1/snapshot/capture")
    (work / "f").unlink()
    body = {"roots": listing["roots"], "entries": listing["entries"]}
    need = c.post("/v1/snapshot/prepare", body)["need"]
    modes = {e["p"]: e["m"] for e in listing["entries"]}
    src = tmp_path / "inbox"
    src.mkdir()
    code, doc = _copy(c, src, need, modes)
    assert (code, doc["error"]["code"]) == (404, "file_not_found"), doc
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"content")
    (src / hashlib.sha256(b"content").hexdigest()).symlink_to(elsewhere)
    code, doc = _copy(c, src, need, modes)
    assert code == 400, doc  # O_NOFOLLOW: a link planted in the directory is not followed
    assert not (work / "f").exists()


def test_a_missing_workdir_is_made_and_a_workdir_of_root_is_never_a_default_root(
    tmp_path: Path,
) -> None:
    """A pod's default workdir (/workspace) is made by execd when the image lacks it; a
    workdir of / must not make a capture walk the whole filesystem (/proc included)."""
    made = tmp_path / "made" / "workspace"
    d = Daemon(tmp_path, args=["--workdir", str(made), "--make-workdir"])
    try:
        c = d.client()
        assert c.exec("pwd")["stdout"] == f"{made}\n"
        assert c.post("/v1/snapshot/capture")["roots"] == [str(made)]
    finally:
        d.stop()
    (tmp_path / "root").mkdir()
    root = Daemon(tmp_path / "root", workdir=Path("/"))
    try:
        code, doc = root.client().request("POST", "/v1/snapshot/capture", {})
        assert (code, doc["error"]["code"]) == (400, "invalid_field"), doc
        assert "cannot be /" in doc["error"]["message"]
    finally:
        root.stop()


def test_a_restore_keeps_the_new_sandboxs_own_hostname(tmp_path: Path) -> None:
    """A pod's HOSTNAME is its name: a fork takes its source's exports, not its name."""
    dirs = [tmp_path / "source", tmp_path / "fork"]
    for d in dirs:
        d.mkdir()
    source = Daemon(dirs[0], env={"HOSTNAME": "source-pod"})
    fork = Daemon(dirs[1], env={"HOSTNAME": "fork-pod"}, workdir=source.workdir)
    try:
        source.client().exec("export AGENT_VAR=kept")
        listing = source.client().post("/v1/snapshot/capture")
        assert "HOSTNAME" in listing["session"]["env"]  # captured, and not restored
        c = fork.client()
        _, (code, doc) = _restore(c, listing, {})
        assert code == 200, doc
        assert c.exec('echo "$HOSTNAME $AGENT_VAR"')["stdout"] == "fork-pod kept\n"
    finally:
        source.stop()
        fork.stop()
