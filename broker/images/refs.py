"""Image references as the store keys them: one spelling per image, so ``python:3.12`` and
``docker.io/library/python:3.12`` name the same entry (the rules docker and containerd use).

A digest (``sha256:<64 hex>``, alone or after ``name@``) names content and needs no tag.
"""

from __future__ import annotations

import re

from broker.errors import ImageInvalid

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_NAME_RE = re.compile(r"^[a-z0-9]+([._-]+[a-z0-9]+)*(/[a-z0-9]+([._-]+[a-z0-9]+)*)*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def is_digest(value: str) -> bool:
    return bool(DIGEST_RE.match(value))


def digest_of(ref: str) -> str | None:
    """The digest a reference pins (``sha256:...`` or ``name@sha256:...``), else None."""
    tail = ref.rsplit("@", 1)[-1]
    return tail if is_digest(tail) else None


def normalize(ref: str) -> str:
    """``[registry/]path[:tag]`` -> ``registry/path:tag`` (docker.io/library/ and :latest
    filled in); raises ImageInvalid for anything that is not a reference."""
    ref = ref.strip()
    if "@" in ref:
        ref = ref.split("@", 1)[0]
    name, tag = ref, "latest"
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = ref.rsplit(":", 1)
    first, _, rest = name.partition("/")
    if not rest:
        name = f"docker.io/library/{name}"
    elif not ("." in first or ":" in first or first == "localhost"):
        name = f"docker.io/{name}"
    registry, _, path = name.partition("/")
    if not _NAME_RE.match(path) or not _TAG_RE.match(tag) or not registry:
        raise ImageInvalid(f"not an image reference: {ref!r}")
    return f"{name}:{tag}"


def split(ref: str) -> tuple[str, str, str]:
    """``ref`` -> (registry host, repository, tag or digest) as the distribution API names
    them: ``python:3.12`` -> ("docker.io", "library/python", "3.12"); a pinned digest wins
    over the tag (``name:tag@sha256:...`` asks for exactly that content)."""
    pinned = digest_of(ref)
    name, tag = normalize(ref).rsplit(":", 1)
    host, _, repository = name.partition("/")
    return host, repository, pinned or tag


def pinned(ref: str, digest: str) -> str:
    """``ref`` pinned to ``digest`` as runtimes want it: ``name@sha256:...`` (the tag, which
    no longer decides anything, is dropped; the name keeps the caller's spelling)."""
    name = ref.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name.rsplit(":", 1)[0]
    return f"{name}@{digest}"
