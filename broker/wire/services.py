"""Where the broker's services answer, without starting any: the settings, else the record
``sandman services up`` (or ``sandman up``) leaves in the state dir.

Processes that must never start a service (the trainer client, the admin UI, a worker
started by hand) read the URLs here: a service started by one of them would be a second,
empty Redis or PostgreSQL that no worker reads. ``broker.local.services`` is the only
writer of the record (0600, it carries passwords); everyone else only reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from broker.errors import ServiceUnavailable
from broker.settings import Settings


@dataclass(frozen=True)
class ServiceUrls:
    database_url: str
    redis_url: str


def urls_file(settings: Settings) -> Path:
    return settings.state_dir / "run" / "services.json"


def known_urls(settings: Settings) -> ServiceUrls:
    """The service URLs without starting anything: the settings', else those the last
    ``sandman services up`` recorded; "" where neither knows one."""
    try:
        recorded = json.loads(urls_file(settings).read_text())
    except (OSError, ValueError):
        recorded = {}
    if not isinstance(recorded, dict):
        recorded = {}
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
