"""One error tree for the whole broker, so trainers can tell infrastructure from task failures.

SandmanError
├── ConfigError(SandmanError, ValueError)            bad settings or arguments
├── InvalidRequest(SandmanError, ValueError)         malformed acquire/task input; nothing was created
│   └── UnknownJob(InvalidRequest, LookupError)
├── InfrastructureError(SandmanError)                not the agent's fault: mask the sample, don't score it
│   ├── ServiceUnavailable(InfrastructureError, ConnectionError)   Redis/PostgreSQL/broker down
│   ├── AcquireTimeout(InfrastructureError, TimeoutError)          no sandbox within the caller's budget
│   ├── SandboxLost(InfrastructureError)                           the pod or execd went away mid-rollout
│   ├── CreateFailed(InfrastructureError)                          the provider could not make a ready sandbox
│   ├── KubeError(InfrastructureError)                             a Kubernetes API call failed
│   │   ├── KubeNotFound(KubeError, LookupError)                   404
│   │   ├── KubeConflict(KubeError)                                409
│   │   ├── KubeInvalid(KubeError, ValueError)                     422
│   │   ├── KubeThrottled(KubeError)                               429 (carries retry_after)
│   │   ├── KubeUnavailable(KubeError, ConnectionError)            5xx, timeouts, transport errors:
│   │   │                                                          the outcome is UNKNOWN, read back
│   │   └── NamespaceUnavailable(KubeError)                        the sandbox namespace is missing or RBAC
│   │                                                              refuses: names it and the permission
│   └── GuardMissing(InfrastructureError)                          egress-denied create without its policy
├── IllegalTransition(SandmanError, RuntimeError)    a ledger state jump that the state machine forbids
├── OwnershipError(SandmanError, RuntimeError)       a pod that is not provably ours was about to be touched
└── ExecError(SandmanError)                          execd refused a call (bad input, auth)
    ├── ExecAuthError(ExecError, PermissionError)
    └── ExecTimeout(ExecError, TimeoutError)         the HTTP call itself timed out (not the command)
"""

from __future__ import annotations


class SandmanError(Exception):
    """Root of every error the broker raises on purpose."""

    code = "sandman_error"


class ConfigError(SandmanError, ValueError):
    code = "config_error"


class InvalidRequest(SandmanError, ValueError):
    code = "invalid_request"


class UnknownJob(InvalidRequest, LookupError):
    code = "unknown_job"


class InfrastructureError(SandmanError):
    """Raised when the failure is the sandbox system's, never the agent's."""

    code = "infrastructure_error"


class ServiceUnavailable(InfrastructureError, ConnectionError):
    code = "service_unavailable"


class AcquireTimeout(InfrastructureError, TimeoutError):
    code = "acquire_timeout"


class SandboxLost(InfrastructureError):
    code = "sandbox_lost"


class CreateFailed(InfrastructureError):
    code = "create_failed"


class KubeError(InfrastructureError):
    code = "kube_error"

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class KubeNotFound(KubeError, LookupError):
    code = "kube_not_found"


class KubeConflict(KubeError):
    code = "kube_conflict"


class KubeInvalid(KubeError, ValueError):
    code = "kube_invalid"


class KubeThrottled(KubeError):
    code = "kube_throttled"

    def __init__(
        self, message: str, *, status: int | None = 429, retry_after: float | None = None
    ) -> None:
        super().__init__(message, status=status)
        self.retry_after = retry_after


class KubeUnavailable(KubeError, ConnectionError):
    """The call may or may not have taken effect: callers must read back before deciding."""

    code = "kube_unavailable"


class NamespaceUnavailable(KubeError):
    """Pods cannot be made in the sandbox namespace: it does not exist (and this process may
    not create it) or RBAC refuses a call there. Retrying cannot help until an operator acts,
    so the message says what to do; ``missing`` names the refused permission, if any."""

    code = "namespace_unavailable"

    def __init__(
        self, message: str, *, namespace: str, missing: str = "", status: int | None = None
    ) -> None:
        super().__init__(message, status=status)
        self.namespace = namespace
        self.missing = missing


class GuardMissing(InfrastructureError):
    code = "guard_missing"


class IllegalTransition(SandmanError, RuntimeError):
    code = "illegal_transition"


class OwnershipError(SandmanError, RuntimeError):
    code = "ownership_error"


class ExecError(SandmanError):
    code = "exec_error"

    def __init__(self, message: str, *, status: int | None = None, error_code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.error_code = error_code


class ExecAuthError(ExecError, PermissionError):
    code = "exec_auth_error"


class ExecTimeout(ExecError, TimeoutError):
    code = "exec_timeout"


def is_infrastructure(error: BaseException) -> bool:
    """True when a trainer should mask the sample instead of scoring the agent."""
    return isinstance(error, InfrastructureError)
