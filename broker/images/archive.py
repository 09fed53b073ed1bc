"""Read image archives: docker-archive (``docker save``, deploy/images/pack_image.py) and
OCI image layouts packed as a tar (``skopeo copy ... oci-archive:``, ``docker save`` of
Docker 25+, which carries both and is read as OCI so registry digests are kept).

Every image comes out as an OCI manifest plus its config and layer blobs. A docker-archive
has no manifest of its own: the one written here (config and layers by digest, canonical
JSON) is what its digest names, so importing the same archive twice gives the same digest.
Blob digests are checked while they are copied; a mismatch is ImageInvalid.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from broker.errors import ImageInvalid
from broker.images.refs import is_digest

MANIFEST_OCI = "application/vnd.oci.image.manifest.v1+json"
MANIFEST_DOCKER = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_MAX_JSON = 16 << 20

# put(reader, expected digest or None) -> (digest, size): the store's blob writer
PutBlob = Callable[[IO[bytes], str | None], tuple[str, int]]


@dataclass
class ArchiveImage:
    """One image found in an archive, its blobs already in the store."""

    digest: str  # of the manifest
    manifest: bytes
    refs: list[str] = field(default_factory=list)


def _json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ImageInvalid(f"{what} is not JSON: {exc}") from exc


def _member(tar: tarfile.TarFile, name: str) -> IO[bytes]:
    name = name.removeprefix("./")
    for candidate in (name, "./" + name):
        try:
            reader = tar.extractfile(candidate)
        except KeyError:
            continue
        if reader is not None:
            return reader
    raise ImageInvalid(f"the archive has no {name!r}")


def _small(tar: tarfile.TarFile, name: str) -> bytes:
    data = _member(tar, name).read(_MAX_JSON + 1)
    if len(data) > _MAX_JSON:
        raise ImageInvalid(f"{name} is larger than {_MAX_JSON} bytes")
    return data


def _names(tar: tarfile.TarFile) -> set[str]:
    return {m.name.removeprefix("./") for m in tar.getmembers()}


def read_archive(tar: tarfile.TarFile, put: PutBlob) -> list[ArchiveImage]:
    """Every image of an opened archive, blobs written through ``put``."""
    names = _names(tar)
    if "index.json" in names and any(n.startswith("blobs/") for n in names):
        return _read_oci(tar, put)
    if "manifest.json" in names:
        return _read_docker(tar, put)
    raise ImageInvalid("neither a docker-archive (manifest.json) nor an OCI layout (index.json)")


def _blob_path(digest: str) -> str:
    if not is_digest(digest):
        raise ImageInvalid(f"not a sha256 digest: {digest!r}")
    return "blobs/sha256/" + digest.split(":", 1)[1]


def _read_oci(tar: tarfile.TarFile, put: PutBlob) -> list[ArchiveImage]:
    index = _json(_small(tar, "index.json"), "index.json")
    out: list[ArchiveImage] = []
    for desc in index.get("manifests") or []:
        refs = _oci_refs(desc.get("annotations") or {})
        digest, manifest = _oci_manifest(tar, desc)
        put_manifest_blobs(manifest, lambda d: _member(tar, _blob_path(d)), put)
        raw = _small(tar, _blob_path(digest))
        put(_bytes_reader(raw), digest)
        out.append(ArchiveImage(digest=digest, manifest=raw, refs=refs))
    if not out:
        raise ImageInvalid("index.json lists no image")
    return out


def _oci_refs(annotations: dict[str, str]) -> list[str]:
    """containerd/Docker write the full name; a bare ref.name is only a tag (no name)."""
    full = annotations.get("io.containerd.image.name")
    if full:
        return [full]
    name = annotations.get("org.opencontainers.image.ref.name", "")
    return [name] if ("/" in name or ":" in name) else []


def _oci_manifest(tar: tarfile.TarFile, desc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """An image manifest for linux/amd64, descending through an index if there is one."""
    digest = str(desc.get("digest"))
    manifest = _json(_small(tar, _blob_path(digest)), f"manifest {digest}")
    if manifest.get("mediaType") in INDEX_TYPES or "manifests" in manifest:
        for child in manifest.get("manifests") or []:
            platform = child.get("platform") or {}
            if platform.get("os", "linux") == "linux" and platform.get("architecture") in (
                "amd64",
                None,
            ):
                return _oci_manifest(tar, child)
        raise ImageInvalid(f"index {digest} has no linux/amd64 image")
    return digest, manifest


def put_manifest_blobs(
    manifest: dict[str, Any], open_blob: Callable[[str], IO[bytes]], put: PutBlob
) -> None:
    """Copy the config and every layer a manifest names, checking their digests."""
    config = manifest.get("config") or {}
    layers = manifest.get("layers")
    if not isinstance(layers, list) or not config.get("digest"):
        raise ImageInvalid("a manifest without config or layers")
    for desc in [config, *layers]:
        digest = str(desc.get("digest"))
        _blob_path(digest)
        put(open_blob(digest), digest)


def _bytes_reader(data: bytes) -> IO[bytes]:
    import io

    return io.BytesIO(data)


def _read_docker(tar: tarfile.TarFile, put: PutBlob) -> list[ArchiveImage]:
    entries = _json(_small(tar, "manifest.json"), "manifest.json")
    if not isinstance(entries, list):
        raise ImageInvalid("manifest.json is not a list")
    out = []
    for entry in entries:
        config_raw = _small(tar, str(entry.get("Config")))
        config_digest, config_size = put(_bytes_reader(config_raw), None)
        layers = []
        for name in entry.get("Layers") or []:
            digest, size = put(_member(tar, str(name)), None)
            layers.append(
                {"mediaType": _layer_type(tar, str(name)), "digest": digest, "size": size}
            )
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_OCI,
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": config_size,
            },
            "layers": layers,
        }
        raw = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        put(_bytes_reader(raw), digest)
        out.append(
            ArchiveImage(digest=digest, manifest=raw, refs=list(entry.get("RepoTags") or []))
        )
    return out


def _layer_type(tar: tarfile.TarFile, name: str) -> str:
    head = _member(tar, name).read(2)
    gz = head == b"\x1f\x8b"
    return "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if gz else "")
