"""The /v1/files/* contract over HTTP, including property-based round trips."""

import base64
import hashlib
import json
import os
import secrets
import stat

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.integration
# A path no test run has made: a refusal must not depend on what /tmp holds on this host.
NEW_FILE = f"/tmp/sandman-refused-{secrets.token_hex(6)}/x"
FAST = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def test_write_read_roundtrip_creates_parents(client, tmp_path):
    path = tmp_path / "a" / "b" / "c.bin"
    data = b"\0\x01hello\xff\0"
    r = client.write(path, data)
    assert r == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert path.read_bytes() == data
    doc = client.post("/v1/files/read", {"path": str(path)})
    assert doc["sha256"] == r["sha256"] and base64.b64decode(doc["content_b64"]) == data
    assert [p.name for p in path.parent.iterdir()] == ["c.bin"]  # no temp file left


def test_write_mode_and_mode_preserved(client, tmp_path):
    path = tmp_path / "script.sh"
    client.write(path, b"#!/bin/sh\n", mode=0o750)
    assert stat.S_IMODE(path.stat().st_mode) == 0o750
    client.write(path, b"#!/bin/sh\necho\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o750


def test_write_empty_and_through_symlink(client, tmp_path):
    target = tmp_path / "real.txt"
    target.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    client.write(link, b"")
    assert link.is_symlink() and target.read_bytes() == b""


def test_large_file_roundtrip(client, tmp_path):
    data = os.urandom(6 * 1024 * 1024 + 5)  # over the streaming threshold
    path = tmp_path / "big.bin"
    client.write(path, data)
    doc = client.post("/v1/files/read", {"path": str(path)})
    assert doc["size"] == len(data) and doc["sha256"] == hashlib.sha256(data).hexdigest()
    assert base64.b64decode(doc["content_b64"]) == data


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"path": "relative/x"}, 400, "relative_path"),
        ({"path": ""}, 400, "relative_path"),
        ({"path": 5}, 400, "invalid_field"),
        ({}, 400, "missing_field"),
        ({"path": "/no/such/file/anywhere"}, 404, "file_not_found"),
        ({"path": "/etc/passwd/below-a-file"}, 404, "file_not_found"),
        ({"path": "/tmp"}, 400, "is_directory"),
        ({"path": "/tmp/a\u0000b"}, 400, "invalid_field"),
        ({"path": "/tmp/\ud800"}, 400, "invalid_field"),
    ],
)
def test_read_refusals(client, body, status, code):
    got, doc = client.request("POST", "/v1/files/read", body)
    assert (got, doc["error"]["code"]) == (status, code)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"path": NEW_FILE, "content_b64": "!!!notbase64"}, "invalid_base64"),
        ({"path": NEW_FILE, "content_b64": "YWJj="}, "invalid_base64"),
        ({"path": NEW_FILE, "content_b64": 12}, "invalid_field"),
        ({"path": NEW_FILE}, "missing_field"),
        ({"path": NEW_FILE, "content_b64": "", "mode": "644"}, "invalid_field"),
        ({"path": NEW_FILE, "content_b64": "", "mode": True}, "invalid_field"),
        ({"path": NEW_FILE, "content_b64": "", "mode": 0o17777}, "invalid_field"),
        ({"path": "x", "content_b64": ""}, "relative_path"),
        ({"path": "/tmp/", "content_b64": ""}, "is_directory"),
    ],
)
def test_write_refusals(client, body, code):
    got, doc = client.request("POST", "/v1/files/write", body)
    assert (got, doc["error"]["code"]) == (400, code)


def test_write_under_a_file_is_refused(client, tmp_path):
    (tmp_path / "f").write_text("x")
    got, doc = client.request(
        "POST", "/v1/files/write", {"path": str(tmp_path / "f" / "g"), "content_b64": ""}
    )
    assert got == 400 and doc["error"]["code"] == "bad_parent"


@FAST
@given(data=st.binary(max_size=4096))
def test_roundtrip_arbitrary_bytes(client, tmp_path, data):
    path = tmp_path / "prop.bin"
    r = client.write(path, data)
    assert r["sha256"] == hashlib.sha256(data).hexdigest()
    assert client.read(path) == data


def edit(client, path, old, new, status=200):
    return client.post("/v1/files/edit", {"path": str(path), "old": old, "new": new}, status)


def test_edit_replaces_once_and_verifies(client, tmp_path):
    path = tmp_path / "e.py"
    path.write_bytes(b"def f():\n    return 1\n")
    os.chmod(path, 0o640)
    r = edit(client, path, "return 1", "return 2")
    assert path.read_bytes() == b"def f():\n    return 2\n"
    assert r == {"size": 22, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_edit_no_match_and_ambiguous(client, tmp_path):
    path = tmp_path / "e.txt"
    path.write_text("x = 1\nx = 1\n")
    doc = edit(client, path, "y = 2", "z", status=409)
    assert doc["error"]["code"] == "no_match" and "not found" in doc["error"]["message"]
    doc = edit(client, path, "x = 1", "z", status=409)
    assert doc["error"]["code"] == "ambiguous_match" and "2 times" in doc["error"]["message"]
    assert path.read_text() == "x = 1\nx = 1\n"


def test_edit_crlf_bom_and_missing_final_newline(client, tmp_path):
    path = tmp_path / "win.txt"
    path.write_bytes(b"\xef\xbb\xbfone\r\ntwo\r\nthree")
    edit(client, path, "one\ntwo", "uno\ndos\nextra")
    assert path.read_bytes() == b"\xef\xbb\xbfuno\r\ndos\r\nextra\r\nthree"


@pytest.mark.parametrize(
    ("content", "old", "status", "code", "hint"),
    [
        (b"a\r\nb\nc\r\n", "a\nb", 409, "mixed_line_endings", "CRLF"),
        (b"caf\xe9\n", "caf", 422, "not_utf8", "shell"),  # the shell can edit any bytes
    ],
    ids=["mixed_line_endings", "non_utf8"],
)
def test_edit_refused_clearly_with_a_hint(client, tmp_path, content, old, status, code, hint):
    path = tmp_path / "refused.txt"
    path.write_bytes(content)
    doc = edit(client, path, old, "x", status=status)
    assert doc["error"]["code"] == code and hint in doc["error"]["message"]
    assert path.read_bytes() == content


def test_edit_mixed_line_endings_work_when_given_exactly(client, tmp_path):
    path = tmp_path / "mixed.txt"
    path.write_bytes(b"a\r\nb\nc\r\n")
    edit(client, path, "a\r\nb\n", "x\n")
    assert path.read_bytes() == b"x\nc\r\n"


def test_edit_refusals(client, tmp_path):
    got, doc = client.request(
        "POST", "/v1/files/edit", {"path": str(tmp_path / "nope"), "old": "a", "new": "b"}
    )
    assert got == 404
    (tmp_path / "f").write_text("abc")
    got, doc = client.request(
        "POST", "/v1/files/edit", {"path": str(tmp_path / "f"), "old": "", "new": "b"}
    )
    assert got == 400
    got, doc = client.request(
        "POST", "/v1/files/edit", {"path": str(tmp_path / "f"), "old": "a", "new": None}
    )
    assert got == 400 and doc["error"]["code"] == "missing_field"


line = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=8)


@FAST
@given(
    lines=st.lists(line, min_size=2, max_size=6, unique=True),
    eol=st.sampled_from(["\n", "\r\n"]),
    bom=st.booleans(),
    final=st.booleans(),
    new=line,
)
def test_edit_over_http_matches_expected_replace(client, tmp_path, lines, eol, bom, final, new):
    text = eol.join(lines) + (eol if final else "")
    old = lines[0] + "\n" + lines[1]  # the agent sends LF, whatever the file uses
    if occurrences_of(text, old.replace("\n", eol)) != 1:
        return
    path = tmp_path / "prop.txt"
    raw = (b"\xef\xbb\xbf" if bom else b"") + text.encode()
    path.write_bytes(raw)
    os.chmod(path, 0o604)
    r = edit(client, path, old, new)
    expected = (b"\xef\xbb\xbf" if bom else b"") + text.replace(
        old.replace("\n", eol), new, 1
    ).encode()
    assert path.read_bytes() == expected
    assert r == {"size": len(expected), "sha256": hashlib.sha256(expected).hexdigest()}
    assert stat.S_IMODE(path.stat().st_mode) == 0o604


def occurrences_of(text, needle):
    from execd.edit import occurrences

    return occurrences(text, needle)


def _big_write(client, body: bytes):
    return client.request("POST", "/v1/files/write", body)


@pytest.mark.parametrize("variant", ["plain", "escaped_slash", "nested_decoy", "duplicate"])
def test_big_upload_parsing_variants(client, tmp_path, variant):
    data = os.urandom(900_000) + b"\xff\xfe/" * 1000
    b64 = base64.b64encode(data).decode()
    path = json.dumps(str(tmp_path / f"{variant}.bin"))
    if variant == "plain":
        body = f'{{"path": {path}, "content_b64" : "{b64}"}}'
    elif variant == "escaped_slash":  # JSON allows "\/": must still decode right
        body = '{{"path": {}, "content_b64": "{}"}}'.format(path, b64.replace("/", "\\/"))
    elif variant == "nested_decoy":
        body = f'{{"meta": {{"content_b64": "x"}}, "path": {path}, "content_b64": "{b64}"}}'
    else:  # JSON: the last duplicate wins
        body = f'{{"path": {path}, "content_b64": "AAAA", "content_b64": "{b64}"}}'
    status, doc = _big_write(client, body.encode())
    assert status == 200, doc
    assert (tmp_path / f"{variant}.bin").read_bytes() == data


@pytest.mark.parametrize("bad", ["!" * 4, "====", "\u00e9" * 4])
def test_big_upload_with_bad_base64_is_400_and_leaves_nothing(client, tmp_path, bad):
    b64 = base64.b64encode(os.urandom(3_000_000)).decode()
    b64 = b64[:4_000_000] + bad + b64[4_000_000 + len(bad) :]
    target = tmp_path / "bad.bin"
    body = json.dumps({"path": str(target), "content_b64": b64}).encode()
    status, doc = _big_write(client, body)
    assert status == 400 and doc["error"]["code"] == "invalid_base64"
    assert not target.exists() and list(tmp_path.iterdir()) == []
