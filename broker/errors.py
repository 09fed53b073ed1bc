"""One error tree for the whole broker, so trainers can tell infrastructure from task failures.

Every class says whether retrying the same call can help: it inherits ``TemporaryError``
(retry with backoff: Celery's ``autoretry_for`` on idempotent tasks uses exactly this) or
``PermanentError`` (retrying gives the same answer). Groups drawn without a mark
(InfrastructureError, KubeError, ExecError) are only for ``except``; raised bare they
count as permanent (``retryable`` is False), the safe default. ``code`` travels over the wire
(``broker.wire.errors``) and never changes: older clients decode it.

Every T error carries ``retry_after`` (seconds, when the refusing side said).

SandmanError                                                  retryable? (T/P)
├── ConfigError(ValueError)                                   P  bad settings or arguments
├── InvalidRequest(ValueError)                                P  malformed input; nothing was created
│   ├── UnknownJob(LookupError)                               P
│   ├── EgressNotPermitted                                    P  a request allowing egress its job denies
│   ├── UnknownTenant(LookupError)                            P
│   ├── TenantExists                                          P  create of a tenant that exists (use set)
│   ├── ImageNotFound(LookupError)          (images)          P  the image ref is not in the local store
│   ├── ImageInvalid                        (images)          P  an archive or layer the store refuses
│   ├── TaskSpecError                       (grading.spec)    P  a task file that cannot be graded
│   └── SnapshotNotFound(LookupError)       (snapshots)       P  no ready, unexpired snapshot of that id
├── InfrastructureError                                          not the agent's fault: mask the sample
│   ├── ServiceUnavailable(ConnectionError)                   T  Redis/PostgreSQL/broker down
│   ├── AcquireTimeout(TimeoutError)                          T  no sandbox within the caller's budget
│   ├── AtCapacity                                            T  the job holds max_live live sandboxes
│   ├── QuotaExceeded                                         T  the job's tenant is over a quota: answered
│   │                                                            at once, with retry_after_s
│   ├── SandboxLost                                           P  the pod or execd went away mid-rollout
│   │   └── SandboxReclaimed                                  P  idle past its job's idle_timeout_s:
│   │                                                            reclaimed; acquire another
│   ├── CreateFailed                                          P  the provider could not make a ready sandbox
│   │   ├── ForeignPod                                        P  a pod with our name is not ours (nonce or
│   │   │                                                        installation differ): left untouched
│   │   └── ImagePullFailed                 (images)          P  the node could not pull the pinned image
│   ├── RegistryUnavailable(ConnectionError) (images)         T  the registry did not answer a resolve
│   ├── KubeError                                                a Kubernetes API call failed
│   │   ├── KubeNotFound(LookupError)                         P  404
│   │   ├── KubeConflict                                      P  409 (settled by read-back, not retry)
│   │   ├── KubeInvalid(ValueError)                           P  422
│   │   ├── KubeThrottled                                     T  429 (carries retry_after)
│   │   ├── KubeUnavailable(ConnectionError)                  T  5xx, timeouts, transport errors:
│   │   │                                                        the outcome is UNKNOWN, read back
│   │   └── NamespaceUnavailable                              P  the sandbox namespace is missing or RBAC
│   │                                                            refuses: names it and the permission
│   ├── GuardMissing                                          P  egress-denied create without its policy
│   ├── SnapshotFailed                      (snapshots)       T  a capture could not complete: take it again
│   ├── SnapshotCorrupt                     (snapshots)       P  a restore did not verify: sandbox released
│   ├── GradingSandboxRejected              (grading.grade)   T  dirty or reused grading sandbox: take another
│   ├── ProbeFailed                         (grading.probe)   T  the run-conditions probe did not answer
│   ├── ProbeContradiction                  (grading.probe)   P  the pod contradicts the task's conditions
│   ├── VerifierSetupFailed                 (grading.harbor)  T  /tests or /logs/verifier not made fresh
│   └── VerifierUserUnavailable             (grading.harbor)  P  the sandbox cannot run test.sh as its user
├── SnapshotQuotaExceeded                   (snapshots)       P  the job's snapshot bytes quota: nothing written
├── TaskError                               (grading.grade)   P  the task itself is broken
├── PatchExtractionError                    (grading.patch)   P  the rollout repository yields no patch
├── IllegalTransition(RuntimeError)                           P  a ledger state jump the state machine forbids
├── OwnershipError(RuntimeError)                              P  a pod not provably ours was about to be touched
│   └── ActionRefused                       (ownership.leaks) P  a leak action that is not safe now
└── ExecError                                                    execd refused a call (bare: bad input, P)
    ├── ExecAuthError(PermissionError)                        P
    ├── ExecBusy                                              T  execd holds its maximum of runs/sessions
    ├── ExecSessionNotFound(LookupError)                      P  no named session of that name
    ├── ExecUserError                                         P  unknown user, or execd cannot switch user
    └── ExecTimeout(TimeoutError)                             P  the HTTP call timed out (not the command);
                                                                 the call may have run: never replayed
"""

from __future__ import annotations


class SandmanError(Exception):
    """Root of every error the broker raises on purpose."""

    code = "sandman_error"

    def __init__(self, *args: object, **details: object) -> None:
        """The one constructor of the tree: ``details`` set the attributes a class declares
        with a default (``field``, ``status``, ``retry_after``...), so no class needs an
        ``__init__`` of its own to carry them, and a keyword no class declares is a bug."""
        super().__init__(*args)
        for name, value in details.items():
            if not hasattr(type(self), name):
                raise TypeError(f"{type(self).__name__} has no detail {name!r}")
            setattr(self, name, value)

    @property
    def retryable(self) -> bool:
        """True when the same call, retried later, can succeed."""
        return isinstance(self, TemporaryError)


class TemporaryError(SandmanError):
    """Retrying later can help (a service, the API server or a cap may free up).

    ``retry_after`` is how long the refusing side asked us to wait (seconds), when it
    said: it belongs to "retry later", so every temporary error can carry it."""

    retry_after: float | None = None


class PermanentError(SandmanError):
    """Retrying gives the same answer: report it, do not loop."""


class ConfigError(PermanentError, ValueError):
    code = "config_error"


class InvalidRequest(PermanentError, ValueError):
    """Malformed input; ``field`` names the offending request field when there is one."""

    code = "invalid_request"
    field: str | None = None


class EgressNotPermitted(InvalidRequest):
    """A request asked to allow egress under a job that denies it: a sandbox may narrow
    its job's egress policy, never widen it."""

    code = "egress_not_permitted"


class UnknownJob(InvalidRequest, LookupError):
    code = "unknown_job"


class UnknownTenant(InvalidRequest, LookupError):
    code = "unknown_tenant"


class TenantExists(InvalidRequest):
    """A create of a tenant name that is taken: a conflict (409), change it with set."""

    code = "tenant_exists"


class ImageNotFound(InvalidRequest, LookupError):
    """The image reference is in no store this backend reads (raised before any row or
    process exists: ``sandman image import`` it first)."""

    code = "image_not_found"


class ImageInvalid(InvalidRequest):
    """An image archive or layer the store refuses: unknown format, a digest that does
    not match, or an entry that would escape the root (``..``, absolute paths, links out,
    device nodes). Nothing of it is used."""

    code = "image_invalid"


class InfrastructureError(SandmanError):
    """Raised when the failure is the sandbox system's, never the agent's."""

    code = "infrastructure_error"


class ServiceUnavailable(InfrastructureError, TemporaryError, ConnectionError):
    code = "service_unavailable"


class AcquireTimeout(InfrastructureError, TemporaryError, TimeoutError):
    code = "acquire_timeout"


class AtCapacity(InfrastructureError, TemporaryError):
    """The job holds ``max_live`` live sandboxes; nothing was written."""

    code = "at_capacity"


class QuotaExceeded(InfrastructureError, TemporaryError):
    """The job's tenant is over one of its quotas (``quota``: ``max_live``,
    ``creates_per_minute`` or ``snapshot_bytes``); nothing was written and no pod exists.

    Unlike ``AtCapacity`` (a job's own cap, waited out in the queue), a tenant's quota is
    answered to the trainer at once: a team over its share should hear so, not queue.
    ``retry_after_s`` is when asking again can succeed: exact for the create rate (the
    oldest create leaves the minute) and for snapshot bytes (enough of the tenant's
    snapshots expire), a hint for the live quota (a release frees it)."""

    code = "quota_exceeded"
    tenant: str | None = None
    quota: str | None = None

    @property
    def retry_after_s(self) -> float | None:
        return self.retry_after


class SandboxLost(InfrastructureError, PermanentError):
    """The pod or its execd went away mid-rollout: the sample is lost, not failed."""

    code = "sandbox_lost"


class SandboxReclaimed(SandboxLost):
    """The broker reclaimed this held sandbox: no call and no running command for its
    job's ``idle_timeout_s``. Every later call on it raises this (execd refuses it, and
    once the pod is gone the client recognises the reclaim), never a silent hang.

    A ``SandboxLost`` (so existing handlers mask the sample), with its own code: a trainer
    that sees it should acquire another sandbox, and, if this was not expected, keep the
    sandbox busy or raise the job's timeout (``sandman job create J --idle-timeout-s``)."""

    code = "sandbox_reclaimed"


class CreateFailed(InfrastructureError, PermanentError):
    """The provider could not make a ready sandbox (the row says why in ``last_error``)."""

    code = "create_failed"


class SnapshotNotFound(InvalidRequest, LookupError):
    """No ready, unexpired snapshot has this id (never taken, removed, or collected)."""

    code = "snapshot_not_found"


class SnapshotQuotaExceeded(PermanentError):
    """The job's snapshots would hold more than its ``snapshot_bytes`` quota; nothing was
    written. Remove or let expire older snapshots (``sandman snapshot rm``)."""

    code = "snapshot_quota_exceeded"


class SnapshotFailed(InfrastructureError, TemporaryError):
    """A capture could not complete (a file changed while it was read, execd went away);
    the partial snapshot is collected by the GC. Taking it again can succeed."""

    code = "snapshot_failed"


class SnapshotCorrupt(InfrastructureError, PermanentError):
    """A restore did not match its snapshot (a blob's SHA-256 or size differed, or the
    restored tree did not verify); the sandbox it went into was released."""

    code = "snapshot_corrupt"


class ForeignPod(CreateFailed):
    """A pod with our deterministic name carries another nonce or installation.

    It keeps ``create_failed`` as its wire code, so clients that predate it still decode
    it as CreateFailed; the provider marks the row failed and never touches the pod.
    """

    pod_name: str = ""
    nonce: str | None = None


class ImagePullFailed(CreateFailed):
    """The node reported it cannot pull the pod's image (``ErrImagePull``,
    ``ImagePullBackOff``, ``InvalidImageName``...): raised as soon as the node says so, not
    after the readiness budget. ``reason`` is the node's reason, the message its words."""

    code = "image_pull_failed"
    reason: str = ""


class RegistryUnavailable(InfrastructureError, TemporaryError, ConnectionError):
    """The registry that serves an image did not answer a resolve (connection refused,
    time-out, 5xx): nothing was created; the same acquire later can succeed."""

    code = "registry_unavailable"


class KubeError(InfrastructureError):
    code = "kube_error"
    status: int | None = None


class KubeNotFound(KubeError, PermanentError, LookupError):
    code = "kube_not_found"


class KubeConflict(KubeError, PermanentError):
    code = "kube_conflict"


class KubeInvalid(KubeError, PermanentError, ValueError):
    code = "kube_invalid"


class KubeThrottled(KubeError, TemporaryError):
    code = "kube_throttled"
    status: int | None = 429


class KubeUnavailable(KubeError, TemporaryError, ConnectionError):
    """The call may or may not have taken effect: callers must read back before deciding."""

    code = "kube_unavailable"


class NamespaceUnavailable(KubeError, PermanentError):
    """Pods cannot be made in the sandbox namespace: it does not exist (and this process may
    not create it) or RBAC refuses a call there. Retrying cannot help until an operator acts,
    so the message says what to do; ``missing`` names the refused permission, if any."""

    code = "namespace_unavailable"
    namespace: str = ""
    missing: str = ""


class GuardMissing(InfrastructureError, PermanentError):
    """An egress-denied job would get a pod without its NetworkPolicy: refused, not risked."""

    code = "guard_missing"


class IllegalTransition(PermanentError, RuntimeError):
    """A ledger state jump the state machine forbids (a bug, or a race lost to another writer)."""

    code = "illegal_transition"


class OwnershipError(PermanentError, RuntimeError):
    """A pod not provably ours was about to be touched: never delete on a guess."""

    code = "ownership_error"


class ExecError(SandmanError):
    """execd refused a call; ``status`` and ``error_code`` are its answer.

    A group, unmarked like KubeError, because one refusal (busy) is temporary and the
    others are not; raised bare (bad input) it is permanent, the safe default."""

    code = "exec_error"
    status: int | None = None
    error_code: str = ""


class ExecAuthError(ExecError, PermanentError, PermissionError):
    code = "exec_auth_error"


class ExecTimeout(ExecError, PermanentError, TimeoutError):
    code = "exec_timeout"


class ExecBusy(ExecError, TemporaryError):
    """execd already runs its maximum of one-shot runs (or holds its maximum of named
    sessions): a refusal, not a hang; retrying once others finished can succeed."""

    code = "exec_busy"


class ExecSessionNotFound(ExecError, PermanentError, LookupError):
    """A named session that was never opened, or was closed."""

    code = "exec_session_not_found"


class ExecUserError(ExecError, PermanentError):
    """A run's ``user`` is unknown in the sandbox, or execd (not root, or without
    CAP_SETUID) cannot switch to it."""

    code = "exec_user_error"


def is_infrastructure(error: BaseException) -> bool:
    """True when a trainer should mask the sample instead of scoring the agent."""
    return isinstance(error, InfrastructureError)
