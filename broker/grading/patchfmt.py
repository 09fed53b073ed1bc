"""Reading git diffs as bytes: which paths a patch touches, and dropping sections.

The broker re-checks every extracted patch on its own side (the rollout sandbox's git
binary is as untrusted as the rest of it), so this parser must not need git: it splits a
``git diff --binary`` output at its ``diff --git`` headers and reads the paths from
those headers (C-quoted or not), ``rename``/``copy`` lines and ``---``/``+++`` lines.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass

_ESCAPES = {b"a": 7, b"b": 8, b"t": 9, b"n": 10, b"v": 11, b"f": 12, b"r": 13}
_HEADER = b"diff --git "


@dataclass(frozen=True)
class Section:
    paths: tuple[str, ...]
    data: bytes


def _unquote(raw: bytes) -> tuple[bytes, bytes]:
    """Parse one C-quoted git path at the start of ``raw``: (path, rest)."""
    assert raw[:1] == b'"'
    out = bytearray()
    i = 1
    while i < len(raw):
        c = raw[i : i + 1]
        if c == b'"':
            return bytes(out), raw[i + 1 :]
        if c == b"\\":
            nxt = raw[i + 1 : i + 2]
            if nxt.isdigit():
                out.append(int(raw[i + 1 : i + 4], 8))
                i += 4
                continue
            out.append(_ESCAPES.get(nxt, nxt[0] if nxt else 92))
            i += 2
            continue
        out += c
        i += 1
    raise ValueError(f"unterminated quoted path: {raw[:80]!r}")


def _strip_prefix(path: bytes) -> str | None:
    if path in (b"/dev/null", b"dev/null"):
        return None
    if path[:2] in (b"a/", b"b/"):
        path = path[2:]
    return path.decode("utf-8", "surrogateescape")


def _header_paths(rest: bytes) -> list[str]:
    rest = rest.rstrip(b"\r\n")
    if rest.startswith(b'"'):
        first, tail = _unquote(rest)
        tail = tail.lstrip(b" ")
        second = _unquote(tail)[0] if tail.startswith(b'"') else tail
        return [p for p in (_strip_prefix(first), _strip_prefix(second)) if p]
    half = (len(rest) - 1) // 2  # "a/P b/P": the usual case, spaces in P allowed
    if rest[half : half + 1] == b" " and rest[2:half] == rest[half + 3 :]:
        return [p for p in (_strip_prefix(rest[:half]),) if p]
    a, sep, b = rest.partition(b" b/")
    if not sep:
        raise ValueError(f"unparseable diff header: {rest[:120]!r}")
    return [p for p in (_strip_prefix(a), _strip_prefix(b"b/" + b)) if p]


def _line_path(line: bytes, prefix: bytes) -> str | None:
    value = line[len(prefix) :].rstrip(b"\r\n")
    if value.startswith(b'"'):
        value = _unquote(value)[0]
    elif b"\t" in value:  # "--- a/x\t2024-01-01 ..." from diff -u
        value = value.split(b"\t", 1)[0]
    return _strip_prefix(value) if prefix in (b"--- ", b"+++ ") else value.decode(errors="replace")


def _section_paths(data: bytes) -> list[str]:
    paths: list[str] = []
    lines = data.split(b"\n")
    if data.startswith(_HEADER):
        paths += _header_paths(lines[0][len(_HEADER) :])
    for line in lines[1:12] if data.startswith(_HEADER) else lines:
        for prefix in (b"--- ", b"+++ ", b"rename from ", b"rename to ", b"copy from "):
            if line.startswith(prefix):
                p = _line_path(line, prefix)
                if p:
                    paths.append(p)
        if data.startswith(_HEADER) and line.startswith((b"@@", b"GIT binary patch")):
            break
    # ``git apply`` also takes a traditional ``---``/``+++`` pair after a section's
    # hunks as one more file patch: every such pair names paths too (a hunk that removes
    # a line "-- x" and adds "++ y" is read as a pair as well: dropping more is safe).
    for first, second in itertools.pairwise(lines):
        if first.startswith(b"--- ") and second.startswith(b"+++ "):
            paths += [p for p in (_line_path(first, b"--- "), _line_path(second, b"+++ ")) if p]
    return list(dict.fromkeys(paths))


def split_sections(diff: bytes) -> tuple[bytes, list[Section]]:
    """(preamble, per-file sections) of a git diff; a plain ``diff -u`` is one section."""
    if not diff.strip():
        return b"", []
    starts = [m.start() for m in re.finditer(rb"(?m)^diff --git ", diff)]
    if not starts:
        if b"\n+++ " not in b"\n" + diff and not diff.startswith(b"--- "):
            raise ValueError("no 'diff --git' header and no '---'/'+++' lines")
        return b"", [Section(tuple(_section_paths(diff)), diff)]
    bounds = [*starts, len(diff)]
    sections = [
        Section(tuple(_section_paths(diff[s:e])), diff[s:e]) for s, e in itertools.pairwise(bounds)
    ]
    return diff[: starts[0]], sections


def patch_paths(diff: bytes) -> list[str]:
    """Every path a patch touches (old and new names), in order, without a/ b/."""
    _, sections = split_sections(diff)
    return list(dict.fromkeys(p for s in sections for p in s.paths))


def filter_patch(diff: bytes, drop: Callable[[str], bool]) -> tuple[bytes, list[str]]:
    """Remove every file section with a path ``drop`` matches: (kept patch, dropped paths).

    A section is dropped whole, so every path it names is reported: a rename from
    ``pkg/x.py`` into ``tests/x.py`` drops the removal of ``pkg/x.py`` too.
    """
    _, sections = split_sections(diff)
    kept: list[bytes] = []
    dropped: list[str] = []
    for section in sections:
        if any(drop(p) for p in section.paths):
            dropped += section.paths
        else:
            kept.append(section.data)
    return b"".join(kept), list(dict.fromkeys(dropped))


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """git's ``:(glob)`` pathspec semantics: ``**/`` any dirs, ``*`` within one name."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("/**", i) and i + 3 == len(pattern):
            out, i = out + "/.*", i + 3
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")
