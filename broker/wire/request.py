"""The acquire request as it travels on the queue: built and validated at the door.

Nothing is enqueued for nonsense: every argument is checked here, in the trainer's
process, before the message exists.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from broker.errors import InvalidRequest
from broker.ledger.states import Role
from broker.wire.validation import parse_cpu, parse_memory, validate_image


def request_body(
    *,
    image: str,
    cpu: str | int | float,
    memory: str | int,
    job: str,
    role: str,
    image_digest: str | None,
    base_commit: str | None,
    workdir: str,
    env: dict[str, str] | None,
    owner: str,
    timeout: float,
) -> dict[str, Any]:
    """Validate arguments strictly (nothing is enqueued for nonsense) and build the request."""
    validate_image(image)
    if not job:
        raise InvalidRequest("job is required")
    if not 0 < timeout <= 24 * 3600:
        raise InvalidRequest(f"timeout {timeout!r} must be in (0, 86400] seconds")
    if role not in {r.value for r in Role}:
        raise InvalidRequest(f"role must be one of {[r.value for r in Role]}")
    now = time.time()
    return {
        "request_id": f"r-{uuid.uuid4().hex}",
        "job": job,
        "image": image,
        "cpu_m": parse_cpu(cpu),
        "memory_b": parse_memory(memory),
        "role": role,
        "image_digest": image_digest,
        "base_commit": base_commit,
        "workdir": workdir,
        "env": dict(env or {}),
        "owner": owner,
        "enqueued_at": now,
        "deadline": now + timeout,
    }
