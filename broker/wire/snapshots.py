"""The snapshot messages between a trainer and the workers: ids and answers, no bytes.

A snapshot's files never travel here: a worker streams them between the sandbox's execd
and the blob store. The trainer sends one ``sandman.snapshot`` message (an ``op``, the ids,
a deadline) and waits on the request's mailbox, exactly like an acquire.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from broker.errors import InvalidRequest

OPS = frozenset({"capture", "restore", "describe"})
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Snapshot:
    """A snapshot of one sandbox's workspace roots and shell state (cwd, exported
    variables). Running processes are NOT captured: a restored sandbox starts with a fresh
    shell in the saved cwd and environment, and nothing else running."""

    id: str
    image: str
    image_digest: str | None
    size: int  # bytes of all files listed (what the job's snapshot quota counts)
    created: str  # ISO 8601
    job: str
    files: int = 0
    stored: int = 0  # new bytes this snapshot added to the store (after dedup)
    expires: str | None = None
    sandbox_id: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Snapshot:
        return cls(
            id=str(data["id"]),
            image=str(data["image"]),
            image_digest=data.get("image_digest"),
            size=int(data["size"]),
            created=str(data["created"]),
            job=str(data["job"]),
            files=int(data.get("files", 0)),
            stored=int(data.get("stored", 0)),
            expires=data.get("expires"),
            sandbox_id=data.get("sandbox_id"),
        )


def snapshot_request(
    op: str, *, timeout: float = DEFAULT_TIMEOUT_S, **fields: Any
) -> dict[str, Any]:
    """One snapshot message: ``op`` and its ids, a request id for the mailbox, a deadline."""
    if op not in OPS:
        raise InvalidRequest(f"unknown snapshot op {op!r}")
    if not 0 < timeout <= 86400:
        raise InvalidRequest(f"timeout {timeout} outside (0, 86400]", field="timeout")
    now = time.time()
    return {
        "op": op,
        "request_id": f"snap-{uuid.uuid4().hex}",
        "enqueued_at": now,
        "deadline": now + timeout,
        **fields,
    }
