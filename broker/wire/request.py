"""The acquire request: one typed value, validated once, from the trainer to the ledger.

Why one type: the request used to be a plain dict checked three times (in the client, in
the service, in the provider), each with its own idea of a default. Now the only ways to
get an ``AcquireRequest`` are ``new`` (the trainer's arguments: '500m', '1Gi', a timeout)
and ``parse`` (a message read from the queue, written by anyone who can reach Redis);
both end in the dataclass constructor, whose ``__post_init__`` holds every check. The
value is frozen, so nothing downstream (task, service, provider, ledger) re-checks it.

Field errors are ``InvalidRequest`` with ``field`` set: a trainer (or the fuzz tests)
learns which argument was wrong, and nothing was enqueued or written for it.
"""

from __future__ import annotations

import datetime as dt
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from broker.errors import InvalidRequest
from broker.names import ENV_VISIBLE_CPUS
from broker.wire import validation as v
from broker.wire.roles import Role

MAX_TIMEOUT_S = 24 * 3600.0
MAX_VISIBLE_CPUS = 1024
SANDBOX_EGRESS = frozenset({None, "allow", "deny"})


def new_request_id() -> str:
    return f"r-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class AcquireRequest:
    """One sandbox request. ``request_id`` makes an acquire idempotent end to end.

    ``deadline`` is the trainer's wall-clock give-up time (None: no caller waits, as for
    warm-pool refills); ``pool_key`` is set only for warm-pool creates and never read
    from the queue, so a trainer cannot create pods into a pool.
    """

    job: str
    image: str
    cpu_m: int = 1000
    memory_b: int = 1 << 30
    role: Role = Role.ROLLOUT
    request_id: str = field(default_factory=new_request_id)
    image_digest: str | None = None
    base_commit: str | None = None
    workdir: str = "/"
    env: Mapping[str, str] = field(default_factory=dict)
    owner: str | None = None
    enqueued_at: float = field(default_factory=time.time)
    deadline: float | None = None
    pool_key: str | None = None
    visible_cpus: int | None = None  # execd pins every command to this many CPUs
    # This sandbox's own egress: "deny" (guarded like a denying job's pods) or "allow"
    # (only under a job that allows egress: a request never widens the job's policy);
    # None: the job's policy.
    egress: str | None = None

    def __post_init__(self) -> None:
        v.check_text("job", self.job, optional=False, max_len=63)
        v.validate_image(self.image)
        v.check_int_range("cpu_m", self.cpu_m, v.MIN_CPU_M, v.MAX_CPU_M)
        v.check_int_range("memory_b", self.memory_b, v.MIN_MEMORY_B, v.MAX_MEMORY_B)
        if not isinstance(self.role, Role):
            raise InvalidRequest(f"role must be a Role, not {self.role!r}", field="role")
        v.check_request_id(self.request_id)
        v.check_digest(self.image_digest)
        # Lengths are the ledger's column sizes (broker/ledger/models.py): a longer value
        # would fail at INSERT, after the pacer slot and the port lock were taken.
        v.check_text("base_commit", self.base_commit, optional=True, max_len=64)
        v.check_workdir(self.workdir)
        object.__setattr__(self, "env", v.check_env(self.env))
        v.check_text("owner", self.owner, optional=True, max_len=128)
        v.check_time("enqueued_at", self.enqueued_at)
        if self.deadline is not None:
            v.check_time("deadline", self.deadline)
        v.check_text("pool_key", self.pool_key, optional=True, max_len=64)
        if self.visible_cpus is not None:
            v.check_int_range("visible_cpus", self.visible_cpus, 1, MAX_VISIBLE_CPUS)
        if self.egress not in SANDBOX_EGRESS:
            raise InvalidRequest(
                f"egress must be one of {sorted(e for e in SANDBOX_EGRESS if e)} or None, "
                f"not {self.egress!r}",
                field="egress",
            )

    # -- the two doors ---------------------------------------------------------------------

    @classmethod
    def new(
        cls,
        *,
        image: str,
        job: str,
        cpu: str | int | float = 1,
        memory: str | int = "1Gi",
        role: str = Role.ROLLOUT.value,
        image_digest: str | None = None,
        base_commit: str | None = None,
        workdir: str = "/",
        env: Mapping[str, str] | None = None,
        owner: str | None = None,
        timeout: float = 300.0,
        request_id: str | None = None,
        pool_key: str | None = None,
        visible_cpus: int | None = None,
        egress: str | None = None,
    ) -> AcquireRequest:
        """From a trainer's arguments: human units, a timeout instead of a deadline."""
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(timeout)
            or not 0 < timeout <= MAX_TIMEOUT_S
        ):
            raise InvalidRequest(
                f"timeout {timeout!r} must be in (0, {MAX_TIMEOUT_S:.0f}] seconds",
                field="timeout",
            )
        now = time.time()
        return cls(
            job=job,
            image=image,
            cpu_m=v.parse_cpu(cpu),
            memory_b=v.parse_memory(memory),
            role=_role(role),
            request_id=request_id or new_request_id(),
            image_digest=image_digest,
            base_commit=base_commit,
            workdir=workdir,
            env={} if env is None else env,
            owner=owner,
            enqueued_at=now,
            deadline=now + timeout,
            pool_key=pool_key,
            visible_cpus=visible_cpus,
            egress=egress,
        )

    @classmethod
    def parse(cls, data: object) -> AcquireRequest:
        """From a queue message (``to_wire`` output, or anything else someone wrote)."""
        if not isinstance(data, Mapping):
            raise InvalidRequest("an acquire message must be a JSON object", field="request")
        for name in ("request_id", "job", "image"):
            if name not in data:
                raise InvalidRequest(f"{name} is required", field=name)
        enqueued = data.get("enqueued_at")
        return cls(
            request_id=data["request_id"],
            job=data["job"],
            image=data["image"],
            cpu_m=data.get("cpu_m", 1000),
            memory_b=data.get("memory_b", 1 << 30),
            role=_role(data.get("role", Role.ROLLOUT.value)),
            image_digest=data.get("image_digest"),
            base_commit=data.get("base_commit"),
            workdir=data.get("workdir") or "/",
            env={} if data.get("env") is None else data["env"],
            owner=data.get("owner"),
            enqueued_at=time.time() if enqueued is None else enqueued,
            deadline=data.get("deadline"),
            visible_cpus=data.get("visible_cpus"),
            egress=data.get("egress"),
        )

    def to_wire(self) -> dict[str, Any]:
        """The JSON-safe queue message; ``parse(to_wire())`` gives back an equal value."""
        return {
            "request_id": self.request_id,
            "job": self.job,
            "image": self.image,
            "cpu_m": self.cpu_m,
            "memory_b": self.memory_b,
            "role": self.role.value,
            "image_digest": self.image_digest,
            "base_commit": self.base_commit,
            "workdir": self.workdir,
            "env": dict(self.env),
            "owner": self.owner,
            "enqueued_at": self.enqueued_at,
            "deadline": self.deadline,
            "visible_cpus": self.visible_cpus,
            "egress": self.egress,
        }

    def sandbox_env(self) -> dict[str, str]:
        """The sandbox's environment: the request's env plus the broker's own channel to
        execd (``SANDMAN_*``, which a request's env may not set)."""
        env = dict(self.env)
        if self.visible_cpus is not None:
            env[ENV_VISIBLE_CPUS] = str(self.visible_cpus)
        return env

    # -- derived -------------------------------------------------------------------------

    @property
    def enqueued_utc(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self.enqueued_at, dt.UTC)

    def seconds_left(self, default_s: float = 600.0) -> float:
        """Wall-clock budget left (``default_s`` when no caller waits on a deadline)."""
        return default_s if self.deadline is None else self.deadline - time.time()


def _role(value: object) -> Role:
    if isinstance(value, str) and value in Role._value2member_map_:
        return Role(value)
    raise InvalidRequest(
        f"role must be one of {[r.value for r in Role]}, not {value!r}", field="role"
    )


def request_body(**arguments: Any) -> dict[str, Any]:
    """The client's one call (keywords of ``AcquireRequest.new``): validate strictly,
    nothing is enqueued for nonsense, and return the queue message."""
    return AcquireRequest.new(**arguments).to_wire()
