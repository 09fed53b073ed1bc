"""The backend seam: the few calls the ownership protocol needs from a place to run pods.

A backend never decides ownership. It creates what it is told, reads back what exists,
deletes by name only when the caller passes the nonce it expects (so a pod that was
replaced under the same name is never removed), and lists everything carrying this
installation's label so the GC can compare the cluster with the ledger.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

# Label keys (defined in broker.names), re-exported: the backends speak in labels.
from broker.names import (
    LABEL_EGRESS,
    LABEL_INSTALLATION,
    LABEL_JOB,
    LABEL_NONCE,
    LABEL_ROLE,
    LABEL_SANDBOX,
    MANAGED_BY,
)

# How a sandbox's python starts execd on every backend (its options follow). ``-S``: no
# ``site`` (execd needs no site-packages; site's imports and path scans cost every sandbox
# memory and start time). ``-c``, not ``-m execd``: ``-m`` goes through ``runpy``, which
# imports ``importlib.util`` and ``contextlib``, 0.2 MiB in every sandbox for one module.
EXECD_LAUNCH = ("-S", "-c", "from execd.__main__ import main; raise SystemExit(main())")

__all__ = [
    "EXECD_LAUNCH",
    "LABEL_EGRESS",
    "LABEL_INSTALLATION",
    "LABEL_JOB",
    "LABEL_NONCE",
    "LABEL_ROLE",
    "LABEL_SANDBOX",
    "MANAGED_BY",
    "Backend",
    "PodInfo",
    "PodSpec",
]


@dataclass(frozen=True)
class PodSpec:
    """What to create: one sandbox pod. ``token`` is the execd bearer token (secret)."""

    name: str
    namespace: str
    installation: str
    job: str
    sandbox_id: str
    nonce: str
    role: str
    image: str
    cpu_m: int
    memory_b: int
    token: str = field(repr=False)
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, object]] = field(default_factory=list)
    egress_denied: bool = False
    simulated_readiness: bool = False

    def labels(self) -> dict[str, str]:
        labels = {
            LABEL_INSTALLATION: self.installation,
            LABEL_JOB: self.job,
            LABEL_SANDBOX: self.sandbox_id,
            LABEL_NONCE: self.nonce,
            LABEL_ROLE: self.role,
            MANAGED_BY: "sandman-broker",
        }
        if self.egress_denied:
            labels[LABEL_EGRESS] = "denied"
        return labels


@dataclass(frozen=True)
class PrePullSpec:
    """An image (pinned) to hold on the nodes a job's sandboxes may land on."""

    job: str
    image: str
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class PrePullInfo:
    """One pre-pull the backend holds: which image for which job, and how far it got."""

    name: str
    job: str
    image: str
    desired: int  # nodes it should be on
    ready: int  # nodes where the image is pulled and held
    uid: str | None = None


@dataclass(frozen=True)
class PodInfo:
    """What exists: a read-back of one pod, enough to decide ownership and readiness."""

    name: str
    namespace: str
    labels: dict[str, str]
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    ready: bool
    ip: str | None = None
    node: str | None = None
    deleting: bool = False
    created_at: dt.datetime | None = None
    address: str | None = None  # host:port where execd answers
    image_pull_s: float | None = None
    start_s: float | None = None
    # Whether this start had to fetch its image (None: the backend cannot tell, e.g. a
    # simulated node), and how long that took when it did.
    pulled: bool | None = None
    reason: str | None = None  # e.g. ErrImageNeverPull, CrashLoopBackOff
    detail: str | None = None  # the node's words for ``reason`` (e.g. why a pull failed)

    @property
    def nonce(self) -> str | None:
        return self.labels.get(LABEL_NONCE)

    @property
    def installation(self) -> str | None:
        return self.labels.get(LABEL_INSTALLATION)

    @property
    def terminal_failure(self) -> bool:
        """A pod that will never become Ready on its own."""
        return self.phase in ("Failed", "Succeeded") or self.reason in FATAL_REASONS


# The node cannot fetch the image: ImagePullFailed at once (kubelet's back-off would only
# repeat the same failure until the readiness budget runs out).
IMAGE_PULL_REASONS = frozenset(
    {"ErrImageNeverPull", "InvalidImageName", "ImagePullBackOff", "ErrImagePull"}
)

FATAL_REASONS = frozenset(
    {
        "ErrImageNeverPull",
        "InvalidImageName",
        "ImagePullBackOff",
        "ErrImagePull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "CrashLoopBackOff",
    }
)


@runtime_checkable
class BlobInbox(Protocol):
    """A backend whose sandboxes share the host's disk (the local one): each sandbox sees
    a directory of its own read-only (``INBOX`` inside), where a restore hard-links the
    blobs it needs, so execd copies them from disk instead of an HTTP stream."""

    def blob_inbox(self, name: str) -> Path | None:
        """The host directory of sandbox ``name``'s inbox; None when it has none (it was
        created without one)."""
        ...


INBOX = "/sandman/inbox"


class Backend(Protocol):
    """The operations the provider needs. Errors are broker.errors.Kube* types."""

    name: str

    def ensure_job_owner(self, namespace: str, job: str) -> None:
        """Create (idempotently) the per-job owner object that pods reference."""

    def ensure_egress_guard(self, namespace: str, job: str, allow: list[str]) -> None:
        """Install the per-job deny-egress policy; must exist before any denied pod."""

    def has_egress_guard(self, namespace: str, job: str) -> bool: ...

    def resolve_image(self, image: str, digest: str | None) -> str | None:
        """The manifest digest the sandbox will run (``digest``, when the request pinned
        one, is checked, not trusted), or None when this backend cannot know it (an image
        of a registry that is not configured: created by tag). Called by the provider's
        admission BEFORE the intent row is written, so a missing image (ImageNotFound) or a
        silent registry (RegistryUnavailable) leaves nothing behind."""

    def ensure_prepull(self, namespace: str, want: PrePullSpec) -> str:
        """Pull ``image`` (pinned) ahead onto the nodes the job's sandboxes may use, and
        keep it there; idempotent. Returns the pre-pull's name."""

    def prepulls(self, namespace: str) -> list[PrePullInfo]:
        """This installation's pre-pulls."""

    def remove_prepull(self, namespace: str, info: PrePullInfo) -> None: ...

    def pull_record(self, info: PodInfo) -> PodInfo:
        """``info`` of a Ready pod with ``pulled``/``image_pull_s`` as the node recorded
        them (whether this start fetched its image, and for how long)."""

    def create(self, spec: PodSpec) -> PodInfo:
        """Submit the pod. Raises KubeConflict when the name exists (read back then)."""

    def get(self, namespace: str, name: str) -> PodInfo | None: ...

    def delete(self, namespace: str, name: str, nonce: str) -> bool:
        """Delete only if the live pod carries ``nonce``; True when it is gone or going."""

    def list_installation(self, namespace: str, installation: str) -> list[PodInfo]: ...

    def list_all_labelled(self, namespace: str) -> list[PodInfo]:
        """Every pod with our label keys, any installation: foreign ones are reported."""

    def watch_ready(self, namespace: str, names: set[str], timeout_s: float) -> Iterator[PodInfo]:
        """Yield pod read-backs as they change, until ``timeout_s`` passes."""

    def wait_gone(self, namespace: str, name: str, timeout_s: float) -> bool:
        """True once the pod no longer exists; False if it is still there at the timeout."""
