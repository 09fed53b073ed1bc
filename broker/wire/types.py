"""Value types exchanged between the provider and its callers (workers, pools, client).

Kept apart from ``broker.ownership.provider`` so callers can import them without a backend.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass, field
from typing import Any

from broker.ledger.states import Role


@dataclass(frozen=True)
class AcquireSpec:
    """One sandbox request. ``request_id`` makes acquires idempotent end to end."""

    job: str
    image: str
    cpu_m: int = 1000
    memory_b: int = 1 << 30
    role: Role = Role.ROLLOUT
    request_id: str | None = None
    image_digest: str | None = None
    base_commit: str | None = None
    pool_key: str | None = None  # set for warm-pool creates (never-used pods)
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    owner: str | None = None
    enqueued_at: dt.datetime | None = None


@dataclass(frozen=True)
class Lease:
    """What a trainer gets back: where execd answers and the bearer token to use."""

    sandbox_id: str
    pod_name: str
    address: str  # host:port
    token: str = field(repr=False)
    job: str = ""
    role: str = Role.ROLLOUT.value
    warm: bool = False
    reused: bool = False
    lease_expires_at: str | None = None  # ISO 8601
    acquire_latency_s: float | None = None
    create_to_ready_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Lease:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
