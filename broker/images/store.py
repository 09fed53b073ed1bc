"""The local image store: what the local backend runs sandboxes on.

Layout under ``<cache_dir>/local-images`` (SANDMAN_CACHE_DIR, not the state dir: images
are content-addressed and belong to no installation, so every state dir on the machine,
each test run's included, shares one copy and one unpack of each digest; the per-sandbox
writable layers, which do belong to an installation, live in its state dir)::

    refs.json                 {normalized ref (or the digest, if unnamed): manifest digest}
    blobs/sha256/<hex>        manifests, configs and layers, checked against their digest
    rootfs/<hex>/             a digest's unpacked root filesystem (read-only by convention)
    locks/<hex>.lock          held while that digest is unpacked
    .lock                     held while refs.json changes

Each digest is unpacked once, on first use, under its lock into a temporary directory
that is renamed into place: a concurrent first use waits and then finds it done, and a
crash mid-unpack leaves only a temporary directory (removed by the next unpack).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import secrets
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from broker.errors import ImageInvalid, ImageNotFound
from broker.images import archive, refs
from broker.images.registry import RegistryClient
from broker.images.unpack import unpack


@dataclass(frozen=True)
class StoredImage:
    ref: str
    digest: str
    size_b: int  # the layers' blob size
    unpacked: bool


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _hex(digest: str) -> str:
    if not refs.is_digest(digest):
        raise ImageInvalid(f"not a sha256 digest: {digest!r}")
    return digest.split(":", 1)[1]


class ImageStore:
    """Import, list, remove, resolve and unpack images; safe across processes."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @classmethod
    def at_cache(cls, cache_dir: Path) -> ImageStore:
        return cls(Path(cache_dir) / "local-images")

    # -- blobs -----------------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / _hex(digest)

    def put_blob(self, reader: IO[bytes], expected: str | None) -> tuple[str, int]:
        """Copy a blob in, hashing as it goes; a digest other than ``expected`` is refused."""
        folder = self.root / "blobs" / "sha256"
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".tmp-{secrets.token_hex(6)}"
        sha, size = hashlib.sha256(), 0
        try:
            with tmp.open("wb") as out:
                while chunk := reader.read(1 << 20):
                    sha.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
            digest = "sha256:" + sha.hexdigest()
            if expected is not None and digest != expected:
                raise ImageInvalid(f"blob content is {digest}, the manifest says {expected}")
            os.replace(tmp, folder / sha.hexdigest())
        finally:
            tmp.unlink(missing_ok=True)
        return digest, size

    def _json_blob(self, digest: str) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self.blob_path(digest).read_bytes())
        except FileNotFoundError as exc:
            raise ImageNotFound(f"image {digest} is not in the local store") from exc
        return data

    def manifest(self, digest: str) -> dict[str, Any]:
        return self._json_blob(digest)

    def config(self, digest: str) -> dict[str, Any]:
        """The image's runtime config (Env, WorkingDir, Cmd...): ``{}`` if it has none."""
        raw = self._json_blob(self.manifest(digest)["config"]["digest"])
        config = raw.get("config") or raw.get("Config") or {}
        return config if isinstance(config, dict) else {}

    # -- refs --------------------------------------------------------------------------

    def _refs(self) -> dict[str, str]:
        try:
            data: dict[str, str] = json.loads((self.root / "refs.json").read_text())
        except FileNotFoundError:
            return {}
        return data

    def _write_refs(self, table: dict[str, str]) -> None:
        tmp = self.root / f"refs.json.tmp-{secrets.token_hex(4)}"
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(self.root / "refs.json")

    def resolve(self, ref: str) -> str:
        """The manifest digest ``ref`` names here; ImageNotFound when it is not stored."""
        pinned = refs.digest_of(ref)
        if pinned is not None:
            alias = self._refs().get(pinned)  # an index digest a pull narrowed to amd64
            if alias is not None and self.blob_path(alias).exists():
                return alias
            if not self.blob_path(pinned).exists():
                raise ImageNotFound(f"image {ref} is not in the local store")
            return pinned
        digest = self._refs().get(refs.normalize(ref))
        if digest is None or not self.blob_path(digest).exists():
            raise ImageNotFound(
                f"image {ref} is not in the local store (import it: sandman image import FILE)"
            )
        return digest

    def import_archive(
        self, source: Path | IO[bytes], tags: tuple[str, ...] = ()
    ) -> list[StoredImage]:
        """Import every image of a docker-archive or OCI archive (a path, or a stream such
        as stdin, spooled to a temporary file first since archives need random access).
        ``tags`` add references (for archives whose images carry none)."""
        self.root.mkdir(parents=True, exist_ok=True)
        # One lock from the first blob to the refs: a concurrent ``remove`` prunes every
        # blob no ref names yet, which would include this import's.
        with _flock(self.root / ".lock"), contextlib.ExitStack() as stack:
            if isinstance(source, Path):
                path = source
            else:
                spool = stack.enter_context(
                    tempfile.NamedTemporaryFile(dir=self.root, prefix=".import-")
                )
                shutil.copyfileobj(source, spool, 1 << 20)
                spool.flush()
                path = Path(spool.name)
            try:
                tar = stack.enter_context(tarfile.open(path, "r:*"))
            except (tarfile.TarError, OSError) as exc:
                raise ImageInvalid(f"not a tar archive: {exc}") from exc
            images = archive.read_archive(tar, self.put_blob)
            if tags and len(images) != 1:
                raise ImageInvalid(
                    f"--tag needs an archive of one image, this one has {len(images)}"
                )
            out = []
            table = self._refs()
            for image in images:
                # An image without a name is listed (and removable) under its digest.
                names = [refs.normalize(r) for r in [*image.refs, *tags]] or [image.digest]
                for name in names:
                    table[name] = image.digest
                out += [self._stored(name, image.digest) for name in names]
            self._write_refs(table)
        return out

    def pull(self, client: RegistryClient, ref: str) -> StoredImage:
        """Fetch ``ref`` (its linux/amd64 image) from its registry into the store, by the
        same rules as an import: every blob checked against its digest while it streams
        in (never whole in memory), blobs already stored are not fetched again, and the
        ref is recorded last, so a broken-off pull leaves no ref to half an image."""
        if not client.serves(ref):
            raise ImageNotFound(
                f"no registry is configured for {ref} (SANDMAN_REGISTRIES=host=URL,...)"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        found = client.platform_manifest(ref)
        manifest = found.json()
        config = manifest.get("config") or {}
        layers = manifest.get("layers")
        if not isinstance(layers, list) or not config.get("digest"):
            raise ImageInvalid(f"{ref}: a manifest without config or layers")
        with _flock(self.root / ".lock"):
            for desc in [config, *layers]:
                digest = str(desc.get("digest"))
                if self.blob_path(digest).exists():
                    continue
                with client.blob(ref, digest) as stream:
                    self.put_blob(stream, digest)
            self.put_blob(io.BytesIO(found.body), found.digest)
            table = self._refs()
            asked = refs.digest_of(ref)
            name = found.digest if asked else refs.normalize(ref)
            table[name] = found.digest
            if asked and asked != found.digest:
                table[asked] = found.digest  # the index digest the request pinned
            self._write_refs(table)
        return self._stored(name, found.digest)

    def _stored(self, ref: str, digest: str) -> StoredImage:
        try:
            layers = self.manifest(digest).get("layers") or []
        except ImageNotFound:
            layers = []
        size = sum(int(layer.get("size") or 0) for layer in layers)
        return StoredImage(ref, digest, size, self.rootfs_path(digest).is_dir())

    def images(self) -> list[StoredImage]:
        return [self._stored(ref, digest) for ref, digest in sorted(self._refs().items())]

    def remove(self, ref: str) -> list[str]:
        """Forget ``ref`` (or every ref of a digest); a digest no ref names any more loses
        its manifest and unpacked root, and blobs no manifest names are deleted. Sandboxes
        already running on it keep working only in copy mode: do not remove an image in use."""
        with _flock(self.root / ".lock"):
            table = self._refs()
            pinned = refs.digest_of(ref)
            gone = (
                [r for r, d in table.items() if d == pinned]
                if pinned
                else [r for r in [refs.normalize(ref)] if r in table]
            )
            if not gone:
                raise ImageNotFound(f"image {ref} is not in the local store")
            dropped = {table.pop(name) for name in gone} - set(table.values())
            self._write_refs(table)
            for digest in dropped:
                self._drop_rootfs(digest)
            self._prune(set(table.values()))
        return gone

    def _prune(self, live: set[str]) -> None:
        keep: set[str] = set()
        for digest in live:
            with contextlib.suppress(ImageNotFound, KeyError):
                manifest = self.manifest(digest)
                keep |= {_hex(digest), _hex(manifest["config"]["digest"])}
                keep |= {_hex(layer["digest"]) for layer in manifest["layers"]}
        for blob in (self.root / "blobs" / "sha256").glob("*"):
            if blob.name not in keep and not blob.name.startswith("."):
                blob.unlink(missing_ok=True)

    # -- root filesystems --------------------------------------------------------------

    def rootfs_path(self, digest: str) -> Path:
        return self.root / "rootfs" / _hex(digest)

    def rootfs(self, digest: str) -> Path:
        """The unpacked root of ``digest``, unpacking it first if no process did yet."""
        final = self.rootfs_path(digest)
        if final.is_dir():
            return final
        with _flock(self.root / "locks" / f"{_hex(digest)}.lock"):
            if final.is_dir():
                return final
            manifest = self.manifest(digest)
            layers = [self.blob_path(layer["digest"]) for layer in manifest["layers"]]
            for stale in final.parent.glob(f".{final.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            work = final.parent / f".{final.name}.tmp-{os.getpid()}"
            work.mkdir(parents=True)
            try:
                unpack(work, layers)
                os.rename(work, final)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
        return final

    def _drop_rootfs(self, digest: str) -> None:
        final = self.rootfs_path(digest)
        if final.is_dir():
            trash = final.parent / f".{final.name}.tmp-rm-{secrets.token_hex(4)}"
            with contextlib.suppress(OSError):
                os.rename(final, trash)
                shutil.rmtree(trash, ignore_errors=True)


def open_source(name: str) -> Path | IO[bytes]:
    """``-`` is standard input, anything else a path."""
    return sys.stdin.buffer if name == "-" else Path(name)
