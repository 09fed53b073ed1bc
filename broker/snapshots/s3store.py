"""The snapshot blob store on an S3-compatible object store (boto3), for clusters: every
worker, the GC and the audit see the same bucket, wherever they run.

Same keys as the filesystem store under ``<prefix>``: ``blobs/<sha[:2]>/<sha>`` and
``manifests/<id>.json``, plus ``touched/<sha[:2]>/<sha>`` (below) and ``last-sweep``.

Streams, never whole blobs: ``put_stream`` is a multipart upload of ``PART``-sized parts
(the SHA-256 computed as the pieces arrive; a blob smaller than a part is one PUT of the
bytes already hashed), so a 2 GiB file costs one part of memory, not 2 GiB. A mismatch
aborts the upload before it completes, as does any failure: an object under a blob key is
always complete and verified. Uploads a dead worker left open are aborted by the sweep.
``chunks`` yields the GET body a megabyte at a time.

Why ``touch`` writes a marker object instead of copying the blob onto itself: a copy in
place does not refresh LastModified on every S3 implementation (versitygw's posix backend
keeps the file's mtime), and on AWS it rewrites the whole object (up to 5 GiB per call) to
change a timestamp. An empty marker is one small PUT anywhere; ``blobs()`` reports the
later of the blob's and its marker's times, merging the two sorted listings.

Errors are typed, and name the operation and key, never a credential: an unreachable
endpoint or a 5xx is ``ServiceUnavailable`` (temporary), refused credentials, a missing
bucket or another 4xx is ``ConfigError``, a missing blob ``SnapshotCorrupt``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import boto3
import botocore.exceptions as bce
from botocore.config import Config

from broker.errors import ConfigError, SandmanError, ServiceUnavailable, SnapshotCorrupt
from broker.settings import Settings
from broker.snapshots.store import (
    PIECE,
    changed_during_capture,
    check_sha,
    check_snapshot_id,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)

PART = 8 << 20  # S3 wants >= 5 MiB per part but the last; 10,000 parts: blobs up to 78 GiB
MAX_PARTS = 10_000
TOUCHERS = 16  # concurrent touches (botocore's default pool holds 10: raised to match)
MISSING = frozenset({"404", "NoSuchKey", "NotFound"})
UNAVAILABLE = frozenset(
    {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling"}
)
TRANSPORT = (
    bce.EndpointConnectionError,
    bce.ConnectionClosedError,
    bce.ConnectTimeoutError,
    bce.ReadTimeoutError,
    bce.ResponseStreamingError,
    bce.HTTPClientError,
)


class S3BlobStore:
    """Blobs and manifests in ``bucket`` under ``prefix`` (empty or ending in ``/``)."""

    def __init__(
        self,
        client: S3Client,
        bucket: str,
        prefix: str = "",
        *,
        part_size: int = PART,
        scrub: Iterable[str] = (),
    ) -> None:
        if part_size < 5 << 20:
            raise ConfigError("an S3 multipart part is at least 5 MiB")
        self.client = client
        self.bucket = bucket
        self.prefix = prefix
        self.part_size = part_size
        self._scrub = tuple(s for s in scrub if s)

    @classmethod
    def from_settings(cls, settings: Settings, bucket: str, prefix: str) -> S3BlobStore:
        """A client of its own (boto3 sessions are not shared across threads), path-style
        addressing when an endpoint is set (loopback and most self-hosted servers have no
        per-bucket DNS names), bounded retries and timeouts."""
        for name in ("boto3", "botocore", "s3transfer", "urllib3"):
            if logging.getLogger(name).level == logging.NOTSET:
                # their DEBUG output carries signed request headers (the access key id)
                logging.getLogger(name).setLevel(logging.WARNING)
        session = boto3.session.Session(
            aws_access_key_id=settings.snapshot_s3_access_key or None,
            aws_secret_access_key=settings.snapshot_s3_secret_key or None,
            region_name=settings.snapshot_s3_region,
        )
        config = Config(
            connect_timeout=10,
            read_timeout=120,
            retries={"max_attempts": 4, "mode": "standard"},
            max_pool_connections=TOUCHERS,
            s3={"addressing_style": "path" if settings.snapshot_s3_endpoint else "auto"},
            signature_version="s3v4",
        )
        client = session.client(
            "s3", endpoint_url=settings.snapshot_s3_endpoint or None, config=config
        )
        secrets = (settings.snapshot_s3_access_key, settings.snapshot_s3_secret_key)
        return cls(client, bucket, prefix, scrub=secrets)

    # -- keys and errors ---------------------------------------------------------------

    def _blob(self, sha: str) -> str:
        return f"{self.prefix}blobs/{sha[:2]}/{check_sha(sha)}"

    def _marker(self, sha: str) -> str:
        return f"{self.prefix}touched/{sha[:2]}/{check_sha(sha)}"

    def _manifest(self, snapshot_id: str) -> str:
        return f"{self.prefix}manifests/{check_snapshot_id(snapshot_id)}.json"

    def _failure(self, exc: Exception, op: str, key: str) -> SandmanError:
        """The typed error for a failed call; its text names no credential."""
        where = f"S3 {op} of s3://{self.bucket}/{key}"
        if isinstance(exc, bce.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", "?"))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            text = f"{where}: {code} ({status}) {self._clean(str(err.get('Message', '')))}"
            if status >= 500 or code in UNAVAILABLE:
                return ServiceUnavailable(text.strip())
            return ConfigError(text.strip())
        if isinstance(exc, TRANSPORT):
            return ServiceUnavailable(f"{where}: the store did not answer ({type(exc).__name__})")
        if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
            return ConfigError(f"{where}: no S3 credentials (SANDMAN_SNAPSHOT_S3_*_KEY)")
        return ServiceUnavailable(f"{where}: {type(exc).__name__}: {self._clean(str(exc))}")

    def _clean(self, text: str) -> str:
        for secret in self._scrub:
            text = text.replace(secret, "***")
        return text[:500]

    @staticmethod
    def _missing(exc: Exception) -> bool:
        if not isinstance(exc, bce.ClientError):
            return False
        return str(exc.response.get("Error", {}).get("Code")) in MISSING

    def _head(self, key: str) -> dict[str, Any] | None:
        try:
            return dict(self.client.head_object(Bucket=self.bucket, Key=key))
        except Exception as exc:
            if self._missing(exc):
                return None
            raise self._failure(exc, "HEAD", key) from None

    def _put(self, key: str, body: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=body)
        except Exception as exc:
            raise self._failure(exc, "PUT", key) from None

    def _delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            if not self._missing(exc):
                raise self._failure(exc, "DELETE", key) from None

    def _list(self, sub: str) -> Iterator[tuple[str, float]]:
        """(key without ``prefix + sub``, LastModified) in key order, page by page."""
        start = self.prefix + sub
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=start
        )
        try:
            for page in pages:
                for obj in page.get("Contents", []):
                    yield obj["Key"][len(start) :], obj["LastModified"].timestamp()
        except Exception as exc:
            raise self._failure(exc, "LIST", start) from None

    # -- blobs -------------------------------------------------------------------------

    def has(self, sha: str) -> bool:
        return self._head(self._blob(sha)) is not None

    def touch(self, sha: str) -> bool:
        if not self.has(sha):
            return False
        self._put(self._marker(sha), b"")
        return True

    def touch_all(self, shas: Iterable[str]) -> set[str]:
        """Two requests a file (HEAD, marker PUT): run ``TOUCHERS`` at a time (the client is
        thread-safe) so an unchanged tree of thousands of files is not that many serial
        round trips."""
        wanted = list(dict.fromkeys(shas))
        with ThreadPoolExecutor(min(TOUCHERS, len(wanted) or 1)) as pool:
            found = list(pool.map(self.touch, wanted))
        return {sha for sha, hit in zip(wanted, found, strict=True) if hit}

    def put_stream(self, sha: str, pieces: Iterable[bytes]) -> int:
        """Hashed as it streams; a part is uploaded as soon as it is full, so memory holds
        one part, never the blob. Completed only when the hash matches, aborted otherwise
        (and on any failure): readers never see a partial or wrong blob."""
        key = self._blob(sha)
        digest = hashlib.sha256()
        size = 0
        buf = bytearray()
        upload: str | None = None
        parts: list[dict[str, Any]] = []
        try:
            for piece in pieces:
                digest.update(piece)
                size += len(piece)
                buf += piece
                if len(buf) >= self.part_size:
                    upload = upload or self._start_upload(key)
                    parts.append(self._upload_part(key, upload, len(parts) + 1, buf))
                    buf = bytearray()
            if digest.hexdigest() != sha:
                raise changed_during_capture(digest.hexdigest(), sha)
            if upload is None:
                self._put(key, bytes(buf))
                return size
            if buf:
                parts.append(self._upload_part(key, upload, len(parts) + 1, buf))
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload,
                MultipartUpload={"Parts": parts},  # type: ignore[typeddict-item]
            )
        except BaseException as exc:
            if upload is not None:
                self._abort(key, upload)
            if isinstance(exc, bce.BotoCoreError | bce.ClientError):
                raise self._failure(exc, "multipart PUT", key) from None
            raise  # the pieces' own failure (execd went away), or a typed one
        return size

    def _start_upload(self, key: str) -> str:
        """CRC32 part checksums declared up front, as AWS wants them repeated at completion
        when parts carry them (botocore adds them to every part by default)."""
        answer = self.client.create_multipart_upload(
            Bucket=self.bucket, Key=key, ChecksumAlgorithm="CRC32"
        )
        return answer["UploadId"]

    def _upload_part(self, key: str, upload: str, number: int, data: bytearray) -> dict[str, Any]:
        if number > MAX_PARTS:
            raise ConfigError(f"{key}: over {MAX_PARTS} parts of {self.part_size} bytes")
        answer = self.client.upload_part(
            Bucket=self.bucket,
            Key=key,
            UploadId=upload,
            PartNumber=number,
            Body=data,  # type: ignore[arg-type]  # botocore sends a bytearray as is
            ChecksumAlgorithm="CRC32",
        )
        return {
            "ETag": answer["ETag"],
            "PartNumber": number,
            "ChecksumCRC32": answer["ChecksumCRC32"],
        }

    def _abort(self, key: str, upload: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
        except Exception:  # the sweep aborts what is left (sweep_tmp)
            log.warning("could not abort the upload of %s; the sweep will", key)

    def chunks(self, sha: str) -> Iterator[bytes]:
        key = self._blob(sha)
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
        except Exception as exc:
            if self._missing(exc):
                raise SnapshotCorrupt(f"blob {sha} is missing from the store") from None
            raise self._failure(exc, "GET", key) from None
        try:
            yield from body.iter_chunks(PIECE)
        except Exception as exc:
            raise self._failure(exc, "GET", key) from None
        finally:
            body.close()

    def size(self, sha: str) -> int:
        head = self._head(self._blob(sha))
        if head is None:
            raise SnapshotCorrupt(f"blob {sha} is missing from the store")
        return int(head["ContentLength"])

    def _joined(self) -> Iterator[tuple[str, float | None, float | None]]:
        """(``ab/<sha>``, blob time, marker time), a time None where that object is
        absent: both listings come in key order, so one pass pairs them."""
        markers = self._list("touched/")
        marker = next(markers, None)
        for name, mtime in self._list("blobs/"):
            while marker is not None and marker[0] < name:
                yield marker[0], None, marker[1]
                marker = next(markers, None)
            if marker is not None and marker[0] == name:
                yield name, mtime, marker[1]
                marker = next(markers, None)
            else:
                yield name, mtime, None
        while marker is not None:
            yield marker[0], None, marker[1]
            marker = next(markers, None)

    def blobs(self) -> Iterator[tuple[str, float]]:
        for name, blob, marker in self._joined():
            sha = name.rpartition("/")[2]
            if blob is not None and name == f"{sha[:2]}/{sha}" and len(sha) == 64:
                yield sha, max(blob, marker or 0.0)

    def delete_blob(self, sha: str) -> None:
        self._delete(self._blob(sha))
        self._delete(self._marker(sha))

    # -- manifests ---------------------------------------------------------------------

    def put_manifest(self, snapshot_id: str, manifest: dict[str, Any]) -> None:
        self._put(self._manifest(snapshot_id), json.dumps(manifest, separators=(",", ":")).encode())

    def manifest(self, snapshot_id: str) -> dict[str, Any] | None:
        key = self._manifest(snapshot_id)
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
            with contextlib.closing(body):
                data: dict[str, Any] = json.loads(body.read())
        except Exception as exc:
            if self._missing(exc):
                return None
            raise self._failure(exc, "GET", key) from None
        return data

    def manifests(self) -> list[str]:
        return sorted(
            n[: -len(".json")] for n, _ in self._list("manifests/") if n.endswith(".json")
        )

    def delete_manifest(self, snapshot_id: str) -> None:
        self._delete(self._manifest(snapshot_id))

    # -- the sweep ---------------------------------------------------------------------

    def last_sweep(self) -> float:
        """The sweeper's own clock, written in the object (not the server's LastModified)."""
        key = self.prefix + "last-sweep"
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
            with contextlib.closing(body):
                return float(body.read() or 0)
        except ValueError:
            return 0.0
        except Exception as exc:
            if self._missing(exc):
                return 0.0
            raise self._failure(exc, "GET", key) from None

    def mark_sweep(self) -> None:
        self._put(self.prefix + "last-sweep", repr(time.time()).encode())

    def sweep_tmp(self, older_than_s: float) -> int:
        """Multipart uploads a dead writer left open, and markers whose blob is gone."""
        cutoff = time.time() - older_than_s
        removed = 0
        start = self.prefix + "blobs/"
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=start
            )
            stale = [
                (u["Key"], u["UploadId"])
                for page in pages
                for u in page.get("Uploads", [])
                if u["Initiated"].timestamp() < cutoff
            ]
        except Exception as exc:
            raise self._failure(exc, "LIST uploads", start) from None
        for key, upload in stale:
            self._abort(key, upload)
            removed += 1
        orphans = [n for n, blob, mark in self._joined() if blob is None and (mark or 0) < cutoff]
        for name in orphans:
            self._delete(self.prefix + "touched/" + name)
        return removed + len(orphans)
