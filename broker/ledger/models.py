"""Ledger tables: jobs, sandboxes, the append-only event log, and detected leaks.

A sandbox row is written and committed before its pod is created, carrying a random
nonce that is also a pod label: that row is the proof of ownership the GC relies on.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    func,
)
from sqlalchemy.orm import Mapped, mapped_column

from broker.ledger.base import Base
from broker.ledger.states import Role, State


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_id() -> str:
    return uuid.uuid4().hex


def _enum(cls: type[Any], name: str) -> Enum:
    return Enum(
        cls,
        name=name,
        native_enum=False,
        length=16,
        values_callable=lambda e: [m.value for m in e],
        validate_strings=True,
    )


class Tenant(Base):
    """A team that owns jobs, and its quotas over all of them together (None: no limit).

    Read fresh at every admission (``Provider.intent``), so a change applies to the next
    acquire; every change is an ``admin`` event (``broker.acquire.quotas``)."""

    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    max_live: Mapped[int | None] = mapped_column(Integer)  # live sandboxes, warm ones included
    creates_per_minute: Mapped[int | None] = mapped_column(Integer)  # intents, sliding minute
    snapshot_bytes: Mapped[int | None] = mapped_column(BigInteger)  # listed by live snapshots
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )


class Job(Base):
    """A training or grading job: its pacing, caps, budgets and network policy."""

    __tablename__ = "jobs"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    tenant: Mapped[str | None] = mapped_column(ForeignKey("tenants.name"), index=True)
    create_rate: Mapped[float | None] = mapped_column(
        Float
    )  # per-job creates/s (None: global only)
    create_burst: Mapped[int | None] = mapped_column(Integer)
    max_live: Mapped[int | None] = mapped_column(Integer)
    max_concurrent_creates: Mapped[int | None] = mapped_column(Integer)
    readiness_budget_s: Mapped[float] = mapped_column(Float, default=120.0)
    # Idle reclaim of held sandboxes (broker/acquire/idle.py); None: off. Warm pools have
    # their own idle timeout per pool entry.
    idle_timeout_s: Mapped[float | None] = mapped_column(Float, default=None)
    lease_s: Mapped[float] = mapped_column(Float, default=300.0)
    egress: Mapped[str] = mapped_column(String(16), default="allow")  # allow | deny | allowlist
    egress_allow: Mapped[list[str]] = mapped_column(JSON, default=list)
    node_selector: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    tolerations: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    warm_pools: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    # Images pulled ahead onto the job's nodes (warm-pool images are, too): pools.prepull
    hot_images: Mapped[list[str] | None] = mapped_column(JSON, default=list)
    reuse: Mapped[bool] = mapped_column(Boolean, default=False)
    max_reuses: Mapped[int] = mapped_column(Integer, default=8)
    # The most bytes (logical, all files listed) its live snapshots may hold; None: no limit.
    snapshot_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )


class Sandbox(Base):
    """One sandbox and the pod behind it, from intent to confirmed deletion."""

    __tablename__ = "sandboxes"
    __table_args__ = (
        Index("ix_sandboxes_state_job", "state", "job"),
        Index("ix_sandboxes_lease", "lease_expires_at"),
        Index("ix_sandboxes_pool", "pool_key", "state"),
        Index("ix_sandboxes_requested_at", "requested_at"),
        Index("ix_sandboxes_tenant_state", "tenant", "state"),
        Index("ix_sandboxes_tenant_requested", "tenant", "requested_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    job: Mapped[str] = mapped_column(ForeignKey("jobs.name"), index=True)
    installation: Mapped[str] = mapped_column(String(63))
    request_id: Mapped[str | None] = mapped_column(String(128), unique=True)
    nonce: Mapped[str] = mapped_column(String(64), unique=True)
    pod_name: Mapped[str] = mapped_column(String(253), unique=True)
    namespace: Mapped[str] = mapped_column(String(63))
    backend: Mapped[str] = mapped_column(String(16), default="kubernetes")
    image: Mapped[str] = mapped_column(String(512))
    image_digest: Mapped[str | None] = mapped_column(String(128))  # as the request pinned it
    # The manifest digest the pod runs, resolved once at admission (None: created by tag).
    image_resolved: Mapped[str | None] = mapped_column(String(128))
    base_commit: Mapped[str | None] = mapped_column(String(64))
    cpu_m: Mapped[int] = mapped_column(Integer)  # millicores, requests == limits
    memory_b: Mapped[int] = mapped_column(BigInteger)  # bytes, requests == limits
    role: Mapped[Role] = mapped_column(_enum(Role, "sandbox_role"), default=Role.ROLLOUT)
    state: Mapped[State] = mapped_column(_enum(State, "sandbox_state"), default=State.REQUESTED)
    pool_key: Mapped[str | None] = mapped_column(String(128))  # set while the pod is warm/unclaimed
    owner: Mapped[str | None] = mapped_column(String(128))  # trainer identity holding the lease
    pod_ip: Mapped[str | None] = mapped_column(String(64))
    node_name: Mapped[str | None] = mapped_column(String(253))
    address: Mapped[str | None] = mapped_column(String(128))  # host:port of execd
    token_hash: Mapped[str | None] = mapped_column(String(128))
    reuse_count: Mapped[int] = mapped_column(Integer, default=0)
    create_attempts: Mapped[int] = mapped_column(Integer, default=0)
    delete_attempts: Mapped[int] = mapped_column(Integer, default=0)
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    requested_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    creating_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    ready_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    acquired_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    last_used_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    releasing_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    deleted_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    abandoned_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    enqueued_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    acquire_latency_s: Mapped[float | None] = mapped_column(Float)  # queue-inclusive
    create_to_ready_s: Mapped[float | None] = mapped_column(Float)
    image_pull_s: Mapped[float | None] = mapped_column(Float)
    image_pulled: Mapped[bool | None] = mapped_column(Boolean)  # did this start fetch the image
    start_s: Mapped[float | None] = mapped_column(Float)
    last_error: Mapped[str | None] = mapped_column(Text)
    egress_denied: Mapped[bool] = mapped_column(Boolean, default=False)
    egress_enforced: Mapped[bool | None] = mapped_column(Boolean)  # measured by the in-pod probe
    readiness_simulated: Mapped[bool] = mapped_column(Boolean, default=False)
    # The job's tenant when the intent was admitted: quotas count it, audits bill it.
    tenant: Mapped[str | None] = mapped_column(String(63))


class Event(Base):
    """Append-only audit trail: every transition and every API call outcome."""

    __tablename__ = "events"
    __table_args__ = (
        Index("ix_events_sandbox_at", "sandbox_id", "at"),
        Index("ix_events_job_at", "job", "at"),
        Index("ix_events_pod_name", "pod_name"),
        Index("ix_events_nonce", "nonce"),
        Index("ix_events_at", "at"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    at: Mapped[dt.datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, server_default=func.now()
    )
    sandbox_id: Mapped[str | None] = mapped_column(String(32))
    job: Mapped[str | None] = mapped_column(String(63))
    pod_name: Mapped[str | None] = mapped_column(String(253))
    nonce: Mapped[str | None] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(32))  # transition | api | gc | pool | reuse | admin
    action: Mapped[str] = mapped_column(String(64))
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str | None] = mapped_column(String(16))
    outcome: Mapped[str | None] = mapped_column(String(64))
    actor: Mapped[str] = mapped_column(String(128), default="broker")
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class Leak(Base):
    """Something the GC found that breaks the ownership invariant, and how it ended."""

    __tablename__ = "leaks"
    __table_args__ = (Index("ix_leaks_open", "resolved_at", "kind"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    kind: Mapped[str] = mapped_column(
        String(32)
    )  # unowned_pod | dangling_row | stuck_create | foreign_pod | abandoned | idle
    namespace: Mapped[str | None] = mapped_column(String(63))
    pod_name: Mapped[str | None] = mapped_column(String(253))
    sandbox_id: Mapped[str | None] = mapped_column(String(32))
    nonce: Mapped[str | None] = mapped_column(String(64))
    job: Mapped[str | None] = mapped_column(String(63))
    detected_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    resolved_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    resolution: Mapped[str | None] = mapped_column(String(64))
    resolved_by: Mapped[str | None] = mapped_column(String(128))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class GcPass(Base):
    """One GC pass's observed-versus-ledger counts, written by the pass itself.

    Auditors read it (the ``audit.gc_passes`` view) to see every pass's pods against the
    ledger's live rows over time, so it is append-only in the database: a trigger from
    migration 0002 refuses UPDATE, DELETE and TRUNCATE, whoever asks."""

    __tablename__ = "gc_passes"
    __table_args__ = (Index("ix_gc_passes_started_at", "started_at"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    started_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    installation: Mapped[str] = mapped_column(String(63))
    namespace: Mapped[str] = mapped_column(String(63))
    actor: Mapped[str] = mapped_column(String(128))
    dry_run: Mapped[bool] = mapped_column(Boolean)
    # Observed: every pod carrying our label keys (other installations' included) ...
    pods_seen: Mapped[int] = mapped_column(Integer)
    foreign_pods: Mapped[int] = mapped_column(Integer)
    # ... against the ledger: this installation's rows in a live state when the pass read them.
    live_rows: Mapped[int] = mapped_column(Integer)
    unowned_pods: Mapped[int] = mapped_column(Integer)
    late_pods: Mapped[int] = mapped_column(Integer)
    dangling_rows: Mapped[int] = mapped_column(Integer)
    actions: Mapped[int] = mapped_column(Integer)
    errors: Mapped[int] = mapped_column(Integer)


class Snapshot(Base):
    """One snapshot of a sandbox's workspace: owned by a job, expiring, its manifest and
    blobs in the blob store (``broker.snapshots.store``).

    ``capturing`` is the intent written before any blob: a capture whose worker died stays
    there and the GC deletes it (with its manifest) past the grace; blobs no manifest
    references are collected by the store's own sweep."""

    __tablename__ = "snapshots"
    __table_args__ = (
        Index("ix_snapshots_job_state", "job", "state"),
        Index("ix_snapshots_expires_at", "expires_at"),
        Index("ix_snapshots_tenant_state", "tenant", "state"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    job: Mapped[str] = mapped_column(ForeignKey("jobs.name"), index=True)
    # Whose store holds its blobs: the GC and the audit of one installation see only its own.
    installation: Mapped[str] = mapped_column(String(63))
    sandbox_id: Mapped[str | None] = mapped_column(String(32))  # the sandbox it was taken of
    # The tenant its job had at capture, billed for its bytes (as ``sandboxes.tenant``).
    tenant: Mapped[str | None] = mapped_column(String(63))
    image: Mapped[str] = mapped_column(String(512))
    image_digest: Mapped[str | None] = mapped_column(String(128))
    state: Mapped[str] = mapped_column(String(16), default="capturing")
    size_b: Mapped[int] = mapped_column(BigInteger, default=0)  # all files listed
    stored_b: Mapped[int] = mapped_column(BigInteger, default=0)  # new blob bytes it added
    files: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    deleted_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
