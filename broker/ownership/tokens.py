"""Per-sandbox execd tokens, derived rather than stored.

token = HMAC-SHA256(broker key, sandbox id + nonce). The ledger keeps only the token's
hash, yet a redelivered create, a warm-pool hand-out or a restarted worker can always
re-derive the token of a sandbox it owns. One sandbox's token says nothing about
another's (different id and nonce), and the key never leaves the broker.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from broker.settings import Settings


def broker_key(settings: Settings) -> bytes:
    """The HMAC key: SANDMAN_SECRET_KEY, else a generated 0600 file in the state dir."""
    if settings.secret_key:
        return settings.secret_key.encode()
    path = Path(settings.state_dir) / "secrets" / "broker.key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path.read_text().strip().encode()
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32))
    return path.read_text().strip().encode()


def derive_token(key: bytes, sandbox_id: str, nonce: str) -> str:
    mac = hmac.new(key, f"execd-token:{sandbox_id}:{nonce}".encode(), hashlib.sha256)
    return mac.hexdigest()
