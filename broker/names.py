"""Every name two processes must agree on: queues, tasks, pod labels and Redis keys.

A worker, a trainer, the beat and the admin UI run in different processes and often
different versions during an upgrade; they agree only through these strings. Keeping
them in one module means a rename is one edit, and a reader can see the whole wire
vocabulary (and so what an upgrade must keep stable) on one screen.
"""

from __future__ import annotations

from enum import StrEnum


class Queue(StrEnum):
    """Celery queues. Acquires get their own workers so a burst never starves releases."""

    ACQUIRE = "acquire"
    RELEASE = "release"
    POOL = "pool"


class Task(StrEnum):
    """Celery task names (stable across versions: queued messages outlive deploys)."""

    ACQUIRE = "sandman.acquire"
    RELEASE = "sandman.release"
    CLAIMED = "sandman.claimed"
    HEARTBEAT = "sandman.heartbeat"
    POOL_REFILL = "sandman.pool_refill"
    POOL_UPKEEP = "sandman.pool_upkeep"
    GC = "sandman.gc"
    SNAPSHOT = "sandman.snapshot"


# Which queue each task travels on; the Celery route table is built from this.
TASK_QUEUE: dict[Task, Queue] = {
    Task.ACQUIRE: Queue.ACQUIRE,
    Task.RELEASE: Queue.RELEASE,
    Task.CLAIMED: Queue.RELEASE,
    Task.HEARTBEAT: Queue.RELEASE,
    Task.POOL_REFILL: Queue.POOL,
    Task.POOL_UPKEEP: Queue.POOL,
    Task.GC: Queue.POOL,
    Task.SNAPSHOT: Queue.ACQUIRE,
}


def queue_of(task: str) -> Queue:
    """The queue ``task`` is routed to (a KeyError names a task nobody consumes)."""
    return TASK_QUEUE[Task(task)]


class LeakKind(StrEnum):
    """What the GC found (``leaks.kind``); the admin API filters by these and refuses others."""

    UNOWNED_POD = "unowned_pod"  # a pod of ours that no live row owns
    LATE_POD = "late_pod"  # a pod that appeared after its row was deleted
    STUCK_CREATE = "stuck_create"  # a creating row past its lease
    ABANDONED = "abandoned"  # a lease that expired with no heartbeat
    IDLE = "idle"  # a ready sandbox unused past the idle timeout (warm: the pool's)
    POD_LOST = "pod_lost"  # a live row whose pod is gone
    PENDING_DELETE = "pending_delete"  # a delete the GC finished
    # Written by earlier versions: kept so their rows can still be filtered.
    DANGLING_ROW = "dangling_row"
    FOREIGN_POD = "foreign_pod"


# Tenant names, ASCII only: the OpenAPI document states the same pattern, so a name the
# schema allows is never refused (str.isalnum would also accept "é").
TENANT_NAME_PATTERN = r"^[A-Za-z0-9.-]{1,63}$"
TENANT_MAX_QUOTA = 10_000_000  # the largest quota value the API accepts (null: no limit)
# ... except for a quota in bytes, where ten million would be ten megabytes: 1 PiB.
TENANT_MAX_QUOTA_BYTES = 1 << 50

# Pod labels: the GC trusts only pods whose installation label and nonce it wrote.
LABEL_INSTALLATION = "sandman.io/installation"
LABEL_JOB = "sandman.io/job"
LABEL_SANDBOX = "sandman.io/sandbox"
LABEL_NONCE = "sandman.io/nonce"
LABEL_ROLE = "sandman.io/role"
LABEL_EGRESS = "sandman.io/egress"  # "denied" when the job denies egress
# On pre-pull DaemonSets and their pods, INSTEAD of the installation label: they are no
# sandboxes (no nonce, no row), so the pod GC never lists them; the pre-pull reconciler
# owns them (broker/pools/prepull.py).
LABEL_PREPULL = "sandman.io/prepull-installation"
LABEL_PREPULL_JOB = "sandman.io/prepull-job"
# The sandbox env var execd reads to pin itself (and so every command) to N CPUs
# (execd/cpus.py); set by the broker from a request's visible_cpus, never by a request.
ENV_VISIBLE_CPUS = "SANDMAN_EXECD_VISIBLE_CPUS"
# On a namespace: its pods may call sandboxes' execd (the broker's own namespace and the
# trainers'). Every other pod, other sandboxes included, is refused by the ingress guard.
LABEL_EXECD_ACCESS = "sandman.io/execd-access"
EXECD_ACCESS_ALLOWED = "allowed"
LABEL_NODE_KIND = "sandman.io/node-kind"  # "real" on the local cluster's kubelet node
MANAGED_BY = "app.kubernetes.io/managed-by"

# Redis keys. Prefixes end without a separator; the helpers below add it.
PACE_PREFIX = "sandman:pace"  # token buckets and create semaphores, per scope
PACE_BUCKET_GLOBAL = f"{PACE_PREFIX}:bucket:global"
PACE_SEM_GLOBAL = f"{PACE_PREFIX}:sem:global"
WARM_PREFIX = "sandman:warm"  # never-used pods per pool key
WARM_CLAIMED_PREFIX = "sandman:warm-claimed:"  # claimed warm pods awaiting their hand-out
GC_LAST_KEY = "sandman:gc:last"  # the latest GC pass summary (UI, /metrics)
POOL_UPKEEP_LOCK_PREFIX = "sandman:pool-upkeep:"  # one upkeep per job at a time
RESULT_PREFIX = "sandman:result:"  # an acquire's outcome, popped by the waiting trainer
CANCEL_PREFIX = "sandman:cancel:"  # set by a trainer that gave up on an acquire
ACQUIRED_PREFIX = "sandman:acquired:"  # the outcome kept briefly for idempotent retries
# Idle reclaim (broker/acquire/idle.py): each held sandbox of a job with an idle timeout,
# scored by the earliest time it could be idle that long; and the ids reclaimed, kept a
# day so the trainer's next call says SandboxReclaimed even after the pod is gone.
IDLE_DEADLINES_KEY = "sandman:idle:deadlines"
RECLAIMED_PREFIX = "sandman:reclaimed:"


def result_key(request_id: str) -> str:
    return RESULT_PREFIX + request_id


def cancel_key(request_id: str) -> str:
    return CANCEL_PREFIX + request_id


def acquired_key(request_id: str) -> str:
    return ACQUIRED_PREFIX + request_id


def reclaimed_key(sandbox_id: str) -> str:
    return RECLAIMED_PREFIX + sandbox_id


def warm_claimed_key(sandbox_id: str) -> str:
    return WARM_CLAIMED_PREFIX + sandbox_id


def pool_upkeep_lock(job: str) -> str:
    return POOL_UPKEEP_LOCK_PREFIX + job
