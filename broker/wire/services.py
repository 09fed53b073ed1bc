"""Where the embedded Redis answers, as ``sandman services up`` leaves it in the state dir.

The trainer client must find a broker someone else started and never start one itself
(it would be a second, empty Redis that no worker reads). ``broker.local.services``
writes the password file and builds the URL with these helpers; the client only reads.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from broker.errors import ServiceUnavailable


def redis_secret_path(state_dir: Path) -> Path:
    return state_dir / "secrets" / "redis.password"


def embedded_redis_url(password: str, port: int) -> str:
    return f"redis://:{quote(password)}@127.0.0.1:{port}/0"


def find_embedded_redis(state_dir: Path, port: int) -> str:
    """The embedded Redis's URL from its password file; ServiceUnavailable if never started."""
    secret = redis_secret_path(state_dir)
    try:
        password = secret.read_text().strip()
    except OSError as exc:
        raise ServiceUnavailable(
            f"no Redis to talk to: SANDMAN_REDIS_URL is unset and {secret} does not exist; "
            "run `sandman up` (or `sandman services up`) or set SANDMAN_REDIS_URL"
        ) from exc
    return embedded_redis_url(password, port)
