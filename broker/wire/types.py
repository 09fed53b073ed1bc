"""The lease: what a trainer gets back, built in one place (``Lease.from_row``).

Kept free of the ledger's imports (the row is described by a Protocol) so the trainer's
client can decode leases without SQLAlchemy. The request side lives in
``broker.wire.request``.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from broker.wire.roles import Role


class LeaseRow(Protocol):
    """The ledger columns a lease is made of (``broker.ledger.models.Sandbox``)."""

    id: str
    pod_name: str
    address: str | None
    job: str
    role: Role
    pool_key: str | None
    reuse_count: int
    lease_expires_at: dt.datetime | None
    acquire_latency_s: float | None
    create_to_ready_s: float | None


@dataclass(frozen=True)
class Lease:
    """Where execd answers and the bearer token to use."""

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

    @classmethod
    def from_row(cls, row: LeaseRow, token: str) -> Lease:
        """The one way a lease is made from the ledger.

        A row still in a pool (``pool_key`` set) is a warm lease: it has no expiry and no
        acquire latency yet, both belong to the hand-out that has not happened; the
        trainer that claims it measures its own.
        """
        warm = row.pool_key is not None
        expires = row.lease_expires_at
        return cls(
            sandbox_id=row.id,
            pod_name=row.pod_name,
            address=row.address or "",
            token=token,
            job=row.job,
            role=str(row.role),
            warm=warm,
            reused=row.reuse_count > 0,
            lease_expires_at=expires.isoformat() if expires and not warm else None,
            acquire_latency_s=None if warm else row.acquire_latency_s,
            create_to_ready_s=row.create_to_ready_s,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Lease:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
