"""Where the broker's services answer, without starting any: the settings, else the record
``sandman services up`` (or ``sandman up``) leaves in the state dir.

Processes that must never start a service (the trainer client, the admin UI, a worker
started by hand) read the URLs here: a service started by one of them would be a second,
empty Redis or PostgreSQL that no worker reads. ``broker.local.services`` is the only
writer of the record (0600, it carries passwords); everyone else only reads.

The record is one JSON object per state dir: the embedded services' URLs and the ports
they were given at first start (``ports``). The ports belong to the state dir, so two
installations on one machine never share (or silently talk to) each other's servers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from broker.errors import ServiceUnavailable
from broker.settings import Settings

Service = Literal["postgres", "redis"]


@dataclass(frozen=True)
class ServiceUrls:
    database_url: str
    redis_url: str


def urls_file(settings: Settings) -> Path:
    return settings.state_dir / "run" / "services.json"


def read_record(settings: Settings) -> dict[str, Any]:
    """The state dir's services record as written; {} when missing or unreadable."""
    try:
        recorded = json.loads(urls_file(settings).read_text())
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def recorded_port(settings: Settings, service: Service) -> int:
    """The port this state dir's embedded ``service`` was given at first start; 0 if none."""
    ports = read_record(settings).get("ports")
    port = ports.get(service) if isinstance(ports, dict) else None
    return port if isinstance(port, int) and 0 < port < 65536 else 0


def known_urls(settings: Settings) -> ServiceUrls:
    """The service URLs without starting anything: the settings', else those the last
    ``sandman services up`` recorded; "" where neither knows one."""
    recorded = read_record(settings)
    return ServiceUrls(
        database_url=settings.database_url or str(recorded.get("database_url") or ""),
        redis_url=settings.redis_url or str(recorded.get("redis_url") or ""),
    )


def known_redis_url(settings: Settings) -> str:
    """The Redis URL to talk to, or ServiceUnavailable saying how to get one."""
    url = known_urls(settings).redis_url
    if not url:
        raise ServiceUnavailable(
            f"no Redis to talk to: SANDMAN_REDIS_URL is unset and {urls_file(settings)} "
            "does not exist; run `sandman up` (or `sandman services up`) or set SANDMAN_REDIS_URL"
        )
    return url
