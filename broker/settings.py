"""One typed settings object, built from ``SANDMAN_*`` variables at each entry point.

Nothing reads the environment at import time: entry points call ``Settings.from_env()``
and pass the result down, so tests and embedded runs can build settings explicitly.
A field ``foo_bar`` is read from ``SANDMAN_FOO_BAR``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from broker.errors import ConfigError

Backend = Literal["local", "kubernetes"]
PREFIX = "SANDMAN_"
_SECRET_FIELDS = frozenset(
    {
        "admin_token",
        "admin_password",
        "secret_key",
        "viewer_token",
        "snapshot_s3_access_key",
        "snapshot_s3_secret_key",
    }
)
_URL_FIELDS = frozenset({"database_url", "redis_url"})


def _default_state_dir() -> Path:
    return Path.home() / ".local" / "state" / "sandman"


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "sandman"


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a broker process needs; defaults are the embedded single-machine setup."""

    # Where running services keep data and logs, and where heavy build artefacts are cached.
    state_dir: Path = dataclasses.field(default_factory=_default_state_dir)
    cache_dir: Path = dataclasses.field(default_factory=_default_cache_dir)
    # Empty URLs mean "start the embedded PostgreSQL / Redis in state_dir".
    database_url: str = ""
    redis_url: str = ""
    # 0: the port is chosen free at the state dir's first start and recorded there
    # (run/services.json), so two state dirs on one machine never share a server.
    embedded_pg_port: int = 0
    embedded_redis_port: int = 0
    # Label value that marks pods as this installation's; the GC never touches other values.
    installation_id: str = "sandman-local"
    backend: Backend = "local"
    kubeconfig: str = ""
    # Registry hosts (as written in image refs) and the endpoints that serve them:
    # "localhost=http://127.0.0.1:16500,docker.io=https://registry-1.docker.io". Images of
    # listed hosts are resolved to a digest per acquire (broker/images/registry.py).
    registries: str = ""
    namespace: str = "sandman-sandboxes"
    # Cluster-wide pacing shared by every worker (token bucket in Redis).
    create_rate: float = 20.0
    create_burst: int = 20
    max_concurrent_creates: int = 64
    # Acquires popped from the fair queue that may wait for a create token at once
    # (broker/acquire/fairshare.py); 0: derived from create_rate.
    fair_gate: int = 0
    readiness_budget_s: float = 120.0
    # A creating row's lease = readiness budget + this margin; past it the GC assumes the
    # creating worker died and settles the row itself.
    create_lease_margin_s: float = 60.0
    lease_s: float = 300.0
    # A warm pool's idle timeout when its entry names none (held sandboxes: the job's own
    # ``idle_timeout_s``, off unless set).
    idle_timeout_s: float = 300.0
    # How often each worker looks for held sandboxes whose idle deadline passed (one Redis
    # call when none did; broker/acquire/idle.py); 0 turns idle reclaim off in that worker.
    idle_sweep_s: float = 1.0
    gc_interval_s: float = 30.0
    max_reuses: int = 8
    # Snapshots (broker/snapshots): how long one lives unless the caller says otherwise,
    # and how long the GC spares a capture in progress and a blob no manifest names yet.
    snapshot_ttl_s: float = 86400.0
    snapshot_grace_s: float = 600.0
    # Where snapshot blobs and manifests live: "" = <state_dir>/snapshots (one machine), or
    # "s3://bucket/prefix" on an S3-compatible store that every worker shares (a cluster).
    # Endpoint "" = AWS's own for the region; empty keys = boto3's own chain (AWS_*
    # variables, its credentials file, an instance or pod role). Keys are never logged.
    snapshot_store: str = ""
    snapshot_s3_endpoint: str = ""
    snapshot_s3_region: str = "us-east-1"
    snapshot_s3_access_key: str = ""
    snapshot_s3_secret_key: str = ""
    # Restores on the local backend copy their blobs from a read-only inbox on the same
    # disk (broker/snapshots/service.py); off: they stream over HTTP as on Kubernetes.
    snapshot_local_copy: bool = True
    execd_port: int = 8080
    web_host: str = "127.0.0.1"
    web_port: int = 8000
    admin_token: str = ""
    admin_password: str = ""
    viewer_token: str = ""  # read-only role in the admin UI
    web_cookie_secure: bool = False  # set when the UI is served over HTTPS
    secret_key: str = ""
    log_level: str = "INFO"
    # Crash points armed for a fault campaign or a test (broker/failpoints.py); empty in
    # production.
    failpoint: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from ``SANDMAN_*`` variables; explicit overrides win."""
        env = os.environ if environ is None else environ
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = env.get(PREFIX + field.name.upper())
            if raw is None or (raw == "" and hints[field.name] is not str):
                continue
            values[field.name] = _parse(field.name, raw, hints[field.name])
        values.update(overrides)
        return cls(**values)

    def __post_init__(self) -> None:
        if self.backend not in ("local", "kubernetes"):
            raise ConfigError(
                f"SANDMAN_BACKEND must be 'local' or 'kubernetes', not {self.backend!r}"
            )
        if self.create_rate <= 0 or self.create_burst < 1:
            raise ConfigError("SANDMAN_CREATE_RATE must be > 0 and SANDMAN_CREATE_BURST >= 1")
        if self.fair_gate < 0:
            raise ConfigError("SANDMAN_FAIR_GATE must be >= 0 (0: derived from the rate)")
        if self.max_reuses < 0:
            raise ConfigError("SANDMAN_MAX_REUSES must be >= 0")
        if self.snapshot_ttl_s <= 0 or self.snapshot_grace_s < 0:
            raise ConfigError("SANDMAN_SNAPSHOT_TTL_S must be > 0, SANDMAN_SNAPSHOT_GRACE_S >= 0")
        parse_registries(self.registries)  # ConfigError now, not at the first acquire
        parse_snapshot_store(self.snapshot_store)
        if bool(self.snapshot_s3_access_key) != bool(self.snapshot_s3_secret_key):
            raise ConfigError(
                "SANDMAN_SNAPSHOT_S3_ACCESS_KEY and SANDMAN_SNAPSHOT_S3_SECRET_KEY go together"
            )
        endpoint = urlsplit(self.snapshot_s3_endpoint)
        if self.snapshot_s3_endpoint and (
            endpoint.scheme not in ("http", "https") or not endpoint.netloc
        ):
            raise ConfigError(
                f"SANDMAN_SNAPSHOT_S3_ENDPOINT {self.snapshot_s3_endpoint!r} is not"
                " http(s)://host[:port]"
            )
        for name in ("embedded_pg_port", "embedded_redis_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(
                    f"SANDMAN_{name.upper()} must be a port (0 = chosen per state dir)"
                )

    @property
    def redelivery_s(self) -> float:
        """How long a task message may go unrenewed before another worker gets it.

        Derived, not set: a quarter of the readiness budget, between 5 s and 60 s, so a
        redelivery after a worker death fits well inside an acquire's own budget (the
        trainer's timeout, 300 s by default). Live workers renew the messages they hold
        (``workers.leases``), so this bounds how long a dead worker's tasks wait, never
        how long a task may run."""
        return min(60.0, max(5.0, self.readiness_budget_s / 4))

    def redacted(self) -> dict[str, str]:
        """A printable view: secrets blanked and URL passwords masked, safe for logs."""
        out: dict[str, str] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _SECRET_FIELDS:
                out[field.name] = "***" if value else ""
            elif field.name in _URL_FIELDS:
                out[field.name] = redact_url(str(value))
            else:
                out[field.name] = str(value)
        return out


def parse_registries(raw: str) -> dict[str, str]:
    """``host=endpoint[,host=endpoint...]`` -> {host: endpoint} (SANDMAN_REGISTRIES);
    ConfigError when an entry is not ``host=http(s)://netloc``."""
    table: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        host, sep, endpoint = item.partition("=")
        url = urlsplit(endpoint.strip())
        if not sep or not host.strip() or url.scheme not in ("http", "https") or not url.netloc:
            raise ConfigError(f"SANDMAN_REGISTRIES entry {item!r} is not host=http(s)://endpoint")
        table[host.strip()] = endpoint.strip().rstrip("/")
    return table


_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def parse_snapshot_store(raw: str) -> tuple[str, str] | None:
    """``SANDMAN_SNAPSHOT_STORE`` -> None for the state dir's filesystem (empty), or
    (bucket, prefix) for ``s3://bucket[/prefix]``, the prefix empty or ending in ``/``;
    ConfigError for anything else."""
    if not raw:
        return None
    url = urlsplit(raw)
    prefix = url.path.strip("/")
    if url.scheme != "s3" or not _BUCKET.fullmatch(url.netloc) or url.query or url.fragment:
        raise ConfigError(
            f"SANDMAN_SNAPSHOT_STORE {raw!r} is not empty (the state dir) nor s3://bucket[/prefix]"
        )
    return url.netloc, f"{prefix}/" if prefix else ""


def redact_url(url: str) -> str:
    """Mask the password of a URL such as ``postgresql://user:pw@host/db``."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _parse(name: str, raw: str, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    try:
        if hint is Path:
            return Path(raw).expanduser()
        if hint is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if hint in (int, float, str):
            return hint(raw)
        if origin is Literal:
            if raw not in typing.get_args(hint):
                raise ValueError(raw)
            return raw
        if origin in (types.UnionType, typing.Union):
            return raw
    except ValueError as exc:
        raise ConfigError(f"{PREFIX}{name.upper()}={raw!r} is not a valid {hint}") from exc
    raise ConfigError(f"unsupported settings type for {name}: {hint}")
