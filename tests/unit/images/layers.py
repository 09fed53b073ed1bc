"""Build layer tarballs and image archives in memory-sized test files (no docker needed)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

Entry = tuple  # (name, kind, payload, mode, uid) kind: file|dir|sym|link|chr|fifo


def layer(path: Path, entries: list[tuple], *, gzip: bool = False) -> Path:
    """Write a layer tar: (name, kind[, payload[, mode[, uid]]]) in the order given."""
    with tarfile.open(path, "w:gz" if gzip else "w") as tar:
        for item in entries:
            name, kind, payload, mode, uid = (*item, None, None, None)[:5]
            info = tarfile.TarInfo(name)
            info.uid = info.gid = uid if uid is not None else 0
            info.mtime = 1_700_000_000
            data = None
            if kind == "file":
                data = (payload or "").encode()
                info.size = len(data)
                info.mode = mode if mode is not None else 0o644
            elif kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, mode if mode is not None else 0o755
            elif kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, payload
            elif kind == "link":
                info.type, info.linkname = tarfile.LNKTYPE, payload
            elif kind == "chr":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def docker_archive(out: Path, layers: list[Path], tags: list[str]) -> Path:
    """A docker-archive like ``docker save`` (the layout pack_image.py writes)."""
    digests = [hashlib.sha256(p.read_bytes()).hexdigest() for p in layers]
    config = json.dumps(
        {"config": {"Env": ["PATH=/usr/bin:/bin", "SANDMAN_T=1"]},
         "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for d in digests]}}
    ).encode()  # fmt: skip
    cfg_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = [
        {"Config": cfg_name, "RepoTags": tags, "Layers": [f"{d}/layer.tar" for d in digests]}
    ]
    with tarfile.open(out, "w") as tar:
        for path, digest in zip(layers, digests, strict=True):
            tar.add(path, f"{digest}/layer.tar")
        _add(tar, cfg_name, config)
        _add(tar, "manifest.json", json.dumps(manifest).encode())
    return out


def oci_archive(out: Path, layers: list[Path], ref: str) -> tuple[Path, str]:
    """An OCI image layout in a tar; returns it and its manifest digest."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    config = blob(json.dumps({"config": {"Env": ["SANDMAN_T=oci"]}}).encode())
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **blob(p.read_bytes())}
                   for p in layers],
    }).encode()  # fmt: skip
    desc = blob(manifest)
    index = {"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", **desc,
         "annotations": {"io.containerd.image.name": ref}}]}  # fmt: skip
    with tarfile.open(out, "w") as tar:
        _add(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _add(tar, "index.json", json.dumps(index).encode())
        for digest, data in blobs.items():
            _add(tar, "blobs/sha256/" + digest.split(":")[1], data)
    return out, desc["digest"]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
