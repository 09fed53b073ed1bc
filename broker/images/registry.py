"""A read-only client of the OCI distribution API (registry v2): resolve and fetch.

Why the broker talks to registries at all: a tag moves, a digest does not. An acquire
resolves its image's tag to a manifest digest ONCE (a ``HEAD`` of the manifest, cached
briefly so a burst costs one request), the ledger records it and the pod is created by
digest, so every sandbox of a job runs the same bytes even if the tag is re-pushed
meanwhile, and a missing image is an ``ImageNotFound`` before any row or pod exists
instead of a pod stuck in ``ErrImagePull``. ``sandman image pull`` fetches through the
same client into the local store.

Which registries: ``SANDMAN_REGISTRIES`` maps registry hosts (as written in image
references) to the endpoint that serves them, e.g.
``localhost=http://127.0.0.1:16500,docker.io=https://registry-1.docker.io``. Images of
hosts that are not listed are not resolved (pods are created by tag, as before): the
broker never guesses an endpoint or sends a request nobody configured.

Authentication: anonymous, including the bearer-token dance public registries ask for
(``WWW-Authenticate: Bearer realm=...``). Credentials are not supported yet.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any, cast

import httpx

from broker.errors import ImageInvalid, ImageNotFound, RegistryUnavailable
from broker.images import refs
from broker.images.archive import INDEX_TYPES, MANIFEST_DOCKER, MANIFEST_OCI
from broker.settings import parse_registries

MANIFEST_TYPES = (*INDEX_TYPES, MANIFEST_OCI, MANIFEST_DOCKER)
MAX_MANIFEST_B = 4 << 20  # the limit containerd applies to manifests


@dataclass(frozen=True)
class Manifest:
    digest: str
    media_type: str
    body: bytes

    def json(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.body)
        return data


@dataclass
class RegistryClient:
    """Resolve and fetch from the configured registries; thread-safe, one per process."""

    endpoints: dict[str, str]
    ttl_s: float = 10.0
    timeout_s: float = 10.0
    transport: httpx.BaseTransport | None = None
    _cache: dict[str, tuple[float, str]] = field(default_factory=dict, repr=False)
    _tokens: dict[str, str] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _http: httpx.Client | None = field(default=None, repr=False)

    @classmethod
    def from_setting(cls, raw: str, **kwargs: Any) -> RegistryClient:
        return cls(parse_registries(raw), **kwargs)

    def serves(self, ref: str) -> bool:
        """True when ``ref``'s registry host is configured (so it is resolved)."""
        return refs.split(ref)[0] in self.endpoints

    # -- resolve -----------------------------------------------------------------------

    def resolve(self, ref: str) -> str | None:
        """The manifest digest ``ref`` names now, or None when its host is not configured.

        A pinned digest is checked to exist (HEAD), not trusted. Answers are cached for
        ``ttl_s`` so a burst of acquires costs one request per image; the cache holds
        successes only, so a fixed registry is seen at once."""
        host, repository, reference = refs.split(ref)
        if host not in self.endpoints:
            return None
        key = f"{host}/{repository}@{reference}"
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        digest = self._head_manifest(host, repository, reference, ref)
        with self._lock:
            self._cache[key] = (now + self.ttl_s, digest)
        return digest

    def _head_manifest(self, host: str, repository: str, reference: str, ref: str) -> str:
        response = self._request("HEAD", host, repository, f"manifests/{reference}", ref)
        digest = str(response.headers.get("Docker-Content-Digest", ""))
        if refs.is_digest(digest):
            return digest
        # A registry that omits the header (allowed): hash the manifest ourselves.
        return self.manifest(ref).digest

    # -- fetch -------------------------------------------------------------------------

    def manifest(self, ref: str) -> Manifest:
        """The manifest (or index) ``ref`` names, its digest checked against its bytes."""
        host, repository, reference = refs.split(ref)
        response = self._request("GET", host, repository, f"manifests/{reference}", ref)
        body = response.content
        if len(body) > MAX_MANIFEST_B:
            raise ImageInvalid(f"manifest of {ref} is larger than {MAX_MANIFEST_B} bytes")
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if refs.is_digest(reference) and digest != reference:
            raise ImageInvalid(f"registry served {digest} for {ref}")
        media_type = response.headers.get("Content-Type", "").split(";")[0].strip()
        if media_type not in MANIFEST_TYPES:
            media_type = str(json.loads(body).get("mediaType") or "")
        if media_type not in MANIFEST_TYPES:
            raise ImageInvalid(f"{ref}: unsupported manifest type {media_type!r}")
        return Manifest(digest, media_type, body)

    def platform_manifest(self, ref: str, os_name: str = "linux", arch: str = "amd64") -> Manifest:
        """The single-platform manifest of ``ref`` (an index is narrowed to os/arch)."""
        found = self.manifest(ref)
        if found.media_type not in INDEX_TYPES:
            return found
        for entry in found.json().get("manifests") or []:
            platform = entry.get("platform") or {}
            if platform.get("os") == os_name and platform.get("architecture") == arch:
                name = refs.normalize(ref).rsplit(":", 1)[0]
                return self.manifest(f"{name}@{entry['digest']}")
        raise ImageNotFound(f"{ref} has no {os_name}/{arch} image")

    @contextlib.contextmanager
    def blob(self, ref: str, digest: str) -> Iterator[IO[bytes]]:
        """A stream of blob ``digest`` of ``ref``'s repository (the caller checks the hash,
        e.g. ``ImageStore.put_blob``); never held in memory whole."""
        host, repository, _ = refs.split(ref)
        with self._stream(host, repository, f"blobs/{digest}", ref) as response:
            yield cast(IO[bytes], _Reader(response.iter_bytes(1 << 20)))

    # -- HTTP --------------------------------------------------------------------------

    def _client(self) -> httpx.Client:
        with self._lock:
            if self._http is None:
                self._http = httpx.Client(
                    timeout=self.timeout_s, transport=self.transport, follow_redirects=True
                )
            return self._http

    def close(self) -> None:
        with self._lock:
            if self._http is not None:
                self._http.close()
                self._http = None

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _url(self, host: str, repository: str, path: str) -> str:
        return f"{self.endpoints[host]}/v2/{repository}/{path}"

    def _headers(self, host: str, repository: str) -> dict[str, str]:
        headers = {"Accept": ", ".join(MANIFEST_TYPES)}
        token = self._tokens.get(f"{host}/{repository}")
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _request(
        self, method: str, host: str, repository: str, path: str, ref: str
    ) -> httpx.Response:
        for attempt in (1, 2):
            try:
                response = self._client().request(
                    method,
                    self._url(host, repository, path),
                    headers=self._headers(host, repository),
                )
            except httpx.HTTPError as exc:
                raise RegistryUnavailable(
                    f"registry {host} did not answer for {ref}: {exc}"
                ) from exc
            if (
                response.status_code == 401
                and attempt == 1
                and self._authenticate(host, repository, response)
            ):
                continue
            _check(response, ref, host)
            return response
        raise ImageNotFound(f"image {ref} not found or unauthorized at {host}")

    @contextlib.contextmanager
    def _stream(self, host: str, repository: str, path: str, ref: str) -> Iterator[httpx.Response]:
        self._request("HEAD", host, repository, path, ref)  # errors and auth first
        try:
            with self._client().stream(
                "GET", self._url(host, repository, path), headers=self._headers(host, repository)
            ) as response:
                _check(response, ref, host)
                yield response
        except httpx.HTTPError as exc:
            raise RegistryUnavailable(f"registry {host} broke off {path} of {ref}: {exc}") from exc

    def _authenticate(self, host: str, repository: str, challenge: httpx.Response) -> bool:
        """Anonymous bearer token for ``repository:pull`` when the registry asks for one."""
        header = challenge.headers.get("WWW-Authenticate", "")
        scheme, _, params = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        fields = dict(
            (k.strip(), v.strip().strip('"'))
            for k, _, v in (p.partition("=") for p in params.split(","))
            if k.strip()
        )
        realm = fields.get("realm")
        if not realm:
            return False
        query = {"scope": f"repository:{repository}:pull"}
        if fields.get("service"):
            query["service"] = fields["service"]
        try:
            answer = self._client().get(realm, params=query)
            answer.raise_for_status()
            token = answer.json().get("token") or answer.json().get("access_token")
        except (httpx.HTTPError, ValueError) as exc:
            raise RegistryUnavailable(f"token service of {host} failed: {exc}") from exc
        if not token:
            return False
        self._tokens[f"{host}/{repository}"] = str(token)
        return True


def _check(response: httpx.Response, ref: str, host: str) -> None:
    status = response.status_code
    if status < 300:
        return
    if status in (401, 403, 404):
        raise ImageNotFound(f"image {ref} not found or unauthorized at {host} ({status})")
    raise RegistryUnavailable(f"registry {host} answered {status} for {ref}")


class _Reader:
    """A file-like ``read(n)`` over httpx's byte iterator (for ``ImageStore.put_blob``)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buffer = b""

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self._buffer) < size:
            try:
                self._buffer += next(self._chunks)
            except StopIteration:
                break
        if size < 0:
            out, self._buffer = self._buffer, b""
        else:
            out, self._buffer = self._buffer[:size], self._buffer[size:]
        return out
