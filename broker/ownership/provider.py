"""The ownership protocol: one request in, one ready sandbox out, and never a leaked pod.

Order of operations (see ARCHITECTURE.md, "Ownership"):
1. ``intent``: write and COMMIT the row (nonce, deterministic pod name) before any create.
2. ``create``: requested -> creating (committed), then submit. A 409 or an unknown
   outcome (5xx, 429, timeout, transport) is settled by reading back and comparing the
   nonce: ours -> adopt; absent -> retry with backoff; anyone else's -> never touched.
3. Wait for Ready plus an authenticated execd answer within the job's readiness budget.
4. The provider owns the create until it settles: a caller that gives up (``give_up``
   event, or a release that flips the row to ``releasing``) still gets the pod deleted.
5. ``release``: confirmed delete (nonce-checked); a failed delete stays ``releasing``
   and the GC retries it.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from broker import failpoints
from broker.backends.base import IMAGE_PULL_REASONS, Backend, PodInfo, PodSpec
from broker.errors import (
    AcquireTimeout,
    AtCapacity,
    CreateFailed,
    EgressNotPermitted,
    ForeignPod,
    GuardMissing,
    ImagePullFailed,
    InvalidRequest,
    KubeConflict,
    KubeError,
    KubeInvalid,
    KubeThrottled,
    KubeUnavailable,
    QuotaExceeded,
    SandboxLost,
)
from broker.images import refs
from broker.ledger import store
from broker.ledger.models import Job, Sandbox, Tenant, new_id, utcnow
from broker.ledger.states import State
from broker.ownership.tokens import broker_key, derive_token
from broker.settings import Settings
from broker.wire.execd import execd_answers
from broker.wire.request import AcquireRequest
from broker.wire.types import Lease

log = logging.getLogger(__name__)

MAX_CREATE_ATTEMPTS = 6
DELETE_CONFIRM_S = 60.0
JOB_TTL_S = 2.0


QUOTA_WINDOW = dt.timedelta(minutes=1)  # what ``creates_per_minute`` counts over
LIVE_QUOTA_RETRY_S = 1.0  # a hint: a live slot frees when one of the tenant's is released


def check_quotas(session: Session, tenant: Tenant) -> None:
    """Raise ``QuotaExceeded`` when one more intent would put ``tenant`` over a quota.

    Counted under the tenant's advisory lock, held until the caller's transaction (which
    inserts the intent) ends: concurrent admissions for any of its jobs never overshoot."""
    now = utcnow()
    since = now - QUOTA_WINDOW
    live, recent = store.tenant_usage_locked(session, tenant.name, since)
    if tenant.max_live is not None and live >= tenant.max_live:
        raise QuotaExceeded(
            f"tenant {tenant.name} holds {live} live sandboxes, its quota is {tenant.max_live}",
            tenant=tenant.name,
            quota="max_live",
            retry_after=LIVE_QUOTA_RETRY_S,
        )
    limit = tenant.creates_per_minute
    if limit is not None and recent >= limit:
        # Room comes back when enough of the minute's intents age out of it.
        oldest = store.nth_intent_since(session, tenant.name, since, recent - limit)
        wait = ((oldest or now) + QUOTA_WINDOW - now).total_seconds()
        raise QuotaExceeded(
            f"tenant {tenant.name} made {recent} creates in the last minute, its quota is {limit}",
            tenant=tenant.name,
            quota="creates_per_minute",
            retry_after=round(max(wait, 0.001), 3),
        )


@dataclass(eq=False)
class Provider:
    """Creates, hands out and releases sandboxes; the only writer of pod lifecycles.

    A dataclass because the constructor only takes its parts; ``sleep``, ``probe`` and
    ``failpoint`` are the seams tests replace (no real waiting, no execd, a SIGKILL at a
    named crash window). ``eq=False`` keeps identity equality: two providers are never
    "the same" because their parts are."""

    settings: Settings
    sessions: sessionmaker[Session]
    backend: Backend
    _: KW_ONLY
    actor: str = "broker"
    sleep: Callable[[float], None] = time.sleep
    probe: Callable[[str, str], bool] = execd_answers
    # Named points where a test can kill the process to open a crash window; by default
    # the ones ``settings.failpoint`` arms (broker/failpoints.py), none in production.
    failpoint: Callable[[str], None] = failpoints.off
    _key: bytes = field(init=False, repr=False)
    _jobs: dict[str, tuple[float, Job]] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._key = broker_key(self.settings)
        if self.failpoint is failpoints.off:
            self.failpoint = failpoints.armed(self.settings.failpoint)

    # -- 1. intent --------------------------------------------------------------------

    def token_for(self, row: Sandbox) -> str:
        return derive_token(self._key, row.id, row.nonce)

    def intent(
        self, spec: AcquireRequest, *, abandoned: bool = False, enforce_cap: bool = True
    ) -> tuple[str, str]:
        """The one admission step of an acquire; return (sandbox id, token).

        In one transaction: idempotency (a row with this request id is returned as it
        is: a redelivered message converges on the same sandbox), then refusals that
        write nothing (``abandoned``: the trainer cancelled while the message queued;
        ``AtCapacity``: the job's live cap, counted under a per-job advisory lock so
        concurrent workers never overshoot it; ``QuotaExceeded``: its tenant's quotas,
        read fresh and counted the same way under a per-tenant lock), then the intent
        row, COMMITTED before any create. The request was validated when it was built
        (``AcquireRequest``).
        """
        with self.sessions() as session:  # cached: no query within JOB_TTL_S
            job = self.job(session, spec.job)
        if not abandoned and not (enforce_cap and (job.max_live or job.tenant)):
            # Nothing to count under a lock: idempotency and the intent in one statement.
            sandbox_id, token, where = self._new_intent(spec, job)
            found = store.insert_intent_once(self.sessions, spec, actor=self.actor, **where)
            if found is not None:
                if found.id == sandbox_id:
                    self.failpoint("after-intent")
                return found.id, derive_token(self._key, found.id, found.nonce)
            # A twin delivery committed the row meanwhile: read it like any other.
        with self.sessions.begin() as session:
            existing = store.id_by_request(session, spec.request_id)
            if existing is not None:
                return existing.id, derive_token(self._key, existing.id, existing.nonce)
            if abandoned:
                raise AcquireTimeout(
                    f"acquire {spec.request_id} was abandoned by its trainer while queued"
                )
            job = self.job(session, spec.job)
            if enforce_cap and job.max_live:
                live = store.count_live_locked(session, job.name)
                if live >= job.max_live:
                    raise AtCapacity(f"job {job.name} is at its cap of {job.max_live} live pods")
            tenant = session.get(Tenant, job.tenant) if job.tenant else None
            if enforce_cap and tenant is not None:
                check_quotas(session, tenant)
            sandbox_id, token, where = self._new_intent(spec, job)
            store.insert_intent(session, spec, actor=self.actor, **where)
        self.failpoint("after-intent")
        return sandbox_id, token

    def _new_intent(self, spec: AcquireRequest, job: Job) -> tuple[str, str, dict[str, object]]:
        """A new intent's id, token and row fields (``store.intent_values`` keywords)."""
        # Pods of simulated nodes never run their image: nothing to resolve.
        resolved = (
            spec.image_digest
            if self._simulated(job)
            else self.backend.resolve_image(spec.image, spec.image_digest)
        )
        sandbox_id, nonce = new_id(), store.new_nonce()
        token = derive_token(self._key, sandbox_id, nonce)
        margin = self.settings.create_lease_margin_s
        where: dict[str, object] = {
            "installation": self.settings.installation_id,
            "namespace": self.settings.namespace,
            "backend": self.backend.name,
            "sandbox_id": sandbox_id,
            "nonce": nonce,
            "token_hash": store.hash_token(token),
            # The creating lease bounds how long a dead worker can hold the row.
            "lease_expires_at": utcnow() + dt.timedelta(seconds=job.readiness_budget_s + margin),
            "egress_denied": sandbox_egress_denied(job, spec.egress),
            "tenant": job.tenant,
            "image_resolved": resolved,
        }
        return sandbox_id, token, where

    # -- 2/3/4. create ----------------------------------------------------------------

    def create(
        self,
        sandbox_id: str,
        token: str,
        *,
        give_up: threading.Event | None = None,
        workdir: str = "/",
        env: dict[str, str] | None = None,
    ) -> Lease:
        """Run the create protocol for a committed intent row and return its lease."""
        started = time.monotonic()
        # One committed statement moves requested/creating -> creating; any other state
        # is read under the row lock and answered here.
        row: Any = store.begin_create(self.sessions, sandbox_id, actor=self.actor)
        if row is None:
            with self.sessions.begin() as session:
                done = self._locked(session, sandbox_id)
                if done.state == State.READY:
                    return Lease.from_row(done, token)
                raise CreateFailed(f"sandbox {sandbox_id} is {done.state}: {done.last_error}")
        with self.sessions() as session:
            job = self.job(session, row.job)
            spec = self._pod_spec(row, job, token, workdir, env or {})
            budget = job.readiness_budget_s
            allow = list(job.egress_allow or [])
        self.failpoint("after-creating-commit")
        # The readiness audit row (API server + node time) rides on the ready or failure
        # commit instead of a transaction of its own.
        audit: list[dict[str, object]] = []
        try:
            self._ensure_guards(spec, allow)
            sent = time.monotonic()
            info = self._submit(spec)
            self.failpoint("after-create-sent")
            info = self._await_ready(spec, token, budget, started, give_up)
            if not spec.simulated_readiness:  # a simulated node pulls nothing
                info = self.backend.pull_record(info)
            audit.append(
                {"action": "ready", "outcome": "observed", "api_s": time.monotonic() - sent}
            )
            self.failpoint("before-ready-commit")
        except BaseException as exc:
            self._settle_failure(sandbox_id, spec, exc, audit)
            raise
        return self._mark_ready(sandbox_id, token, info, started, give_up, audit=audit, job=job)

    def _pod_spec(
        self, row: Any, job: Job, token: str, workdir: str, env: dict[str, str]
    ) -> PodSpec:
        """The pod of ``row`` (a ``Sandbox``, or the columns ``store.begin_create`` returns)."""
        return PodSpec(
            name=row.pod_name,
            namespace=row.namespace,
            installation=row.installation,
            job=row.job,
            sandbox_id=row.id,
            nonce=row.nonce,
            role=str(row.role),
            # By digest when one is known: every sandbox of the request runs the same bytes.
            image=refs.pinned(row.image, digest) if (digest := row.image_resolved) else row.image,
            cpu_m=row.cpu_m,
            memory_b=row.memory_b,
            token=token,
            workdir=workdir,
            env=env,
            node_selector=dict(job.node_selector or {}),
            tolerations=list(job.tolerations or []),
            egress_denied=row.egress_denied,
            simulated_readiness=bool((job.node_selector or {}).get("type") == "kwok"),
        )

    def _ensure_guards(self, spec: PodSpec, allow: list[str]) -> None:
        self.backend.ensure_job_owner(spec.namespace, spec.job)
        if spec.egress_denied:
            self.backend.ensure_egress_guard(spec.namespace, spec.job, allow)
            if not self.backend.has_egress_guard(spec.namespace, spec.job):
                raise GuardMissing(f"job {spec.job} denies egress but its policy is missing")

    def _submit(self, spec: PodSpec) -> PodInfo:
        """Create the pod; settle conflicts and unknown outcomes by nonce read-back."""
        delay = 0.2
        for attempt in range(1, MAX_CREATE_ATTEMPTS + 1):
            try:
                sent = time.monotonic()
                info = self.backend.create(spec)
                # Written at once, not batched: after a crash this row is what tells a
                # campaign (and an operator) that the pod was really created.
                self._api_event(
                    spec, "create", "created", attempt=attempt, api_s=time.monotonic() - sent
                )
                return info
            except KubeConflict:
                outcome = "conflict"
            except KubeThrottled as exc:
                outcome = "throttled"
                delay = max(delay, exc.retry_after or delay)
            except KubeUnavailable as exc:
                outcome = f"unknown:{exc.status or 'transport'}"
            except KubeInvalid as exc:
                self._api_event(spec, "create", "invalid", error=str(exc))
                raise CreateFailed(f"pod spec refused by the API server: {exc}") from exc
            self._api_event(spec, "create", outcome, attempt=attempt)
            found = self._read_back(spec)
            if found is not None:
                if found.nonce == spec.nonce and found.installation == spec.installation:
                    self._api_event(spec, "adopt", "nonce-match", attempt=attempt)
                    return found
                self._api_event(spec, "adopt", "foreign", foreign_nonce=found.nonce)
                raise ForeignPod(
                    f"pod {spec.name} exists but is not ours; left untouched",
                    pod_name=spec.name,
                    nonce=found.nonce,
                )
            self.sleep(min(delay, 10.0))
            delay *= 2
        raise CreateFailed(
            f"create of {spec.name} did not settle after {MAX_CREATE_ATTEMPTS} tries"
        )

    def _read_back(self, spec: PodSpec) -> PodInfo | None:
        delay = 0.2
        for _ in range(MAX_CREATE_ATTEMPTS):
            try:
                return self.backend.get(spec.namespace, spec.name)
            except (KubeUnavailable, KubeThrottled) as exc:
                self._api_event(spec, "read-back", "unavailable", error=str(exc))
                self.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise KubeUnavailable(f"cannot read back {spec.name}; the GC will settle it")

    def _await_ready(
        self,
        spec: PodSpec,
        token: str,
        budget: float,
        started: float,
        give_up: threading.Event | None,
    ) -> PodInfo:
        deadline = started + budget
        first = True
        while True:
            # The ledger is re-read from the second round on: the row was committed
            # `creating` moments ago, and the ready commit re-checks it under its lock.
            if (give_up is not None and give_up.is_set()) or (
                not first and self._cancelled(spec.sandbox_id, give_up)
            ):
                raise AcquireTimeout(f"caller gave up on {spec.sandbox_id} during create")
            first = False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CreateFailed(f"{spec.name} not ready within the {budget:.0f}s budget")
            latest: PodInfo | None = None
            try:
                for info in self.backend.watch_ready(
                    spec.namespace, {spec.name}, min(remaining, 2.0)
                ):
                    latest = info
                    if info.reason in IMAGE_PULL_REASONS:
                        raise ImagePullFailed(
                            f"{spec.name} cannot pull {spec.image}: {info.reason}: "
                            f"{info.detail or 'no detail from the node'}",
                            reason=info.reason or "",
                        )
                    if info.terminal_failure:
                        raise CreateFailed(
                            f"{spec.name} failed to start: {info.reason or info.phase}"
                        )
                    if info.ready:
                        break
            except (KubeUnavailable, KubeThrottled) as exc:
                # The pod exists; an API server that is briefly away does not make it
                # fail. Keep waiting within the readiness budget.
                log.info("readiness of %s: API unavailable (%s); waiting on", spec.name, exc)
                self.sleep(0.5)
                continue
            if latest is None or not latest.ready or not latest.address:
                continue
            if spec.simulated_readiness or self.probe(latest.address, token):
                return latest
            else:
                self.sleep(0.1)  # Ready but execd does not answer us yet: poll gently

    def _cancelled(self, sandbox_id: str, give_up: threading.Event | None) -> bool:
        if give_up is not None and give_up.is_set():
            return True
        with self.sessions() as session:
            state = store.state_of(session, sandbox_id)  # one column, no ORM object
            return state is None or state == State.RELEASING

    def _mark_ready(
        self,
        sandbox_id: str,
        token: str,
        info: PodInfo,
        started: float,
        give_up: threading.Event | None,
        *,
        audit: list[dict[str, object]],
        job: Job,
    ) -> Lease:
        if len(audit) == 1 and (give_up is None or not give_up.is_set()):
            # The common case in one statement; a row no longer ``creating`` (released
            # meanwhile) is settled by the general path below.
            observed = {
                "pod_ip": info.ip,
                "node_name": info.node,
                "address": info.address,
                "create_to_ready_s": time.monotonic() - started,
                "image_pull_s": info.image_pull_s,
                "start_s": info.start_s,
                "image_pulled": info.pulled,
                "readiness_simulated": self._simulated(job),
            }
            ready: Any = store.mark_ready(
                self.sessions,
                sandbox_id,
                actor=self.actor,
                lease_s=job.lease_s,
                observed=observed,
                audit=audit[0],
            )
            if ready is not None:
                return Lease.from_row(ready, token)
        with self.sessions.begin() as session:
            row = self._locked(session, sandbox_id)
            self._write_audit(session, row, audit)
            job = self.job(session, row.job)
            cancelled = row.state == State.RELEASING or (give_up is not None and give_up.is_set())
            if not cancelled:
                now = utcnow()
                store.transition(session, row, State.READY, actor=self.actor)
                row.pod_ip, row.node_name, row.address = info.ip, info.node, info.address
                row.create_to_ready_s = time.monotonic() - started
                row.image_pull_s, row.start_s = info.image_pull_s, info.start_s
                row.image_pulled = info.pulled
                row.readiness_simulated = self._simulated(job)
                if row.pool_key is None:
                    row.acquired_at = now
                    row.lease_expires_at = now + dt.timedelta(seconds=job.lease_s)
                    if row.enqueued_at is not None:
                        row.acquire_latency_s = (now - row.enqueued_at).total_seconds()
                else:
                    row.lease_expires_at = None
                return Lease.from_row(row, token)
        # The caller gave up: the pod is ours to remove (provider-owned cleanup). We are
        # the creator, so the row's `creating` state must not defer the delete to us.
        self.release(sandbox_id, actor=self.actor, reason="caller-gave-up", creator_gone=True)
        raise AcquireTimeout(f"caller gave up on {sandbox_id}; its pod was released")

    @staticmethod
    def _simulated(job: Job) -> bool:
        return bool((job.node_selector or {}).get("type") == "kwok")

    def _settle_failure(
        self, sandbox_id: str, spec: PodSpec, exc: BaseException, audit: list[dict[str, object]]
    ) -> None:
        """After any failure in create, the pod (if any) is deleted: no window leaks one."""
        foreign = isinstance(exc, ForeignPod)
        with self.sessions.begin() as session:
            row = self._locked(session, sandbox_id)
            self._write_audit(session, row, audit)
            if row.state in (State.CREATING, State.REQUESTED):
                target = State.FAILED if foreign else State.RELEASING
                store.transition(
                    session, row, target, actor=self.actor, error=f"{type(exc).__name__}: {exc}"
                )
        if not foreign:
            self.release(sandbox_id, actor=self.actor, reason="create-failed")

    # -- hand-out, heartbeat ----------------------------------------------------------

    def hand_out(
        self,
        sandbox_id: str,
        *,
        request_id: str | None,
        owner: str | None,
        enqueued_at: dt.datetime | None = None,
        latency_s: float | None = None,
    ) -> str:
        """Give a warm (ready, unclaimed) sandbox to a trainer: ledger only, no API call.

        One row lock writes the whole hand-out (owner, lease, latency); returns the job
        name so the caller can trigger the pool's replacement."""
        with self.sessions.begin() as session:
            row = self._locked(session, sandbox_id)
            job = self.job(session, row.job)
            if row.state != State.READY or row.acquired_at is not None:
                raise CreateFailed(f"sandbox {sandbox_id} is not an unclaimed ready sandbox")
            now = utcnow()
            row.request_id, row.owner, row.pool_key = request_id, owner, None
            row.acquired_at, row.lease_expires_at = now, now + dt.timedelta(seconds=job.lease_s)
            row.enqueued_at = enqueued_at or now
            if latency_s is None and enqueued_at is not None:
                latency_s = (now - enqueued_at).total_seconds()
            row.acquire_latency_s = latency_s
            store.append_event(
                session,
                row,
                kind="pool",
                action="hand-out",
                actor=self.actor,
                detail={"request_id": request_id, "owner": owner},
            )
            return row.job

    def heartbeat(self, sandbox_id: str, owner: str | None = None) -> dt.datetime:
        with self.sessions.begin() as session:
            row = self._locked(session, sandbox_id)
            if row.state != State.READY:
                raise SandboxLost(f"sandbox {sandbox_id} is {row.state}")
            job = store.get_job(session, row.job)
            row.lease_expires_at = utcnow() + dt.timedelta(seconds=job.lease_s)
            row.last_used_at = utcnow()
            return row.lease_expires_at

    # -- 5. release -------------------------------------------------------------------

    def release(
        self,
        sandbox_id: str,
        *,
        actor: str = "broker",
        reason: str = "released",
        creator_gone: bool = False,
    ) -> None:
        """Idempotent, confirmed release. A create in flight is left to its owner to delete,
        unless ``creator_gone`` (the GC saw its lease expire): then we delete it here."""
        with self.sessions.begin() as session:
            row = self._locked(session, sandbox_id)
            state = State(row.state)
            if state == State.DELETED:
                return
            if state in (
                State.REQUESTED,
                State.CREATING,
                State.READY,
                State.ABANDONED,
                State.FAILED,
            ):
                store.transition(
                    session, row, State.RELEASING, actor=actor, detail={"reason": reason}
                )
            if state == State.CREATING and not creator_gone:
                return  # the creating worker sees `releasing` and deletes (or the GC does)
            if state == State.REQUESTED and not creator_gone:
                store.transition(
                    session, row, State.DELETED, actor=actor, detail={"reason": "never-created"}
                )
                return
            namespace, name, nonce = row.namespace, row.pod_name, row.nonce
        self.failpoint("after-releasing-commit")
        self.delete_confirmed(sandbox_id, namespace, name, nonce, actor=actor)

    def delete_confirmed(
        self, sandbox_id: str, namespace: str, name: str, nonce: str, *, actor: str = "broker"
    ) -> bool:
        """Delete by nonce and wait until the pod is gone; True when deletion is confirmed."""
        error: str | None = None
        try:
            self.backend.delete(namespace, name, nonce)
            self.failpoint("after-delete-sent")
            if not self.backend.wait_gone(namespace, name, DELETE_CONFIRM_S):
                raise KubeUnavailable(f"{name} still present after {DELETE_CONFIRM_S}s")
        except KubeError as exc:
            error = f"{type(exc).__name__}: {exc}"
        with self.sessions.begin() as session:
            row = self._locked(session, sandbox_id)
            if error is None:
                if row.state == State.RELEASING:
                    store.transition(session, row, State.DELETED, actor=actor)
                return True
            row.delete_attempts += 1
            row.last_error = error
            store.append_event(
                session,
                row,
                kind="api",
                action="delete",
                outcome="pending",
                actor=actor,
                detail={"error": error},
            )
            return False

    # -- helpers ----------------------------------------------------------------------

    def job(self, session: Session, name: str) -> Job:
        """The job's settings, read at most every JOB_TTL_S per process.

        A detached copy: the acquire path reads a job three or four times per create,
        and job settings change rarely; a change is seen within JOB_TTL_S. Unknown jobs
        are never cached (UnknownJob is raised from the database each time).
        """
        now = time.monotonic()
        hit = self._jobs.get(name)
        if hit is not None and hit[0] > now:
            return hit[1]
        job = store.get_job(session, name)
        session.expunge(job)
        self._jobs[name] = (now + JOB_TTL_S, job)
        return job

    def _locked(self, session: Session, sandbox_id: str) -> Sandbox:
        row = store.lock_row(session, sandbox_id)
        if row is None:
            raise InvalidRequest(f"no sandbox {sandbox_id!r}")
        return row

    def _write_audit(self, session: Session, row: Sandbox, audit: list[dict[str, object]]) -> None:
        for item in audit:
            detail = {k: v for k, v in item.items() if k not in ("action", "outcome")}
            store.append_event(
                session,
                row,
                kind="api",
                action=str(item["action"]),
                outcome=str(item["outcome"]),
                actor=self.actor,
                detail=detail,
            )

    def _api_event(self, spec: PodSpec, action: str, outcome: str, **detail: object) -> None:
        about = store.Subject(spec.sandbox_id, spec.job, spec.name, spec.nonce)
        store.insert_audit(
            self.sessions,
            about,
            kind="api",
            action=action,
            outcome=outcome,
            actor=self.actor,
            detail=dict(detail),
        )


def sandbox_egress_denied(job: Job, requested: str | None) -> bool:
    """A sandbox's egress: the job's policy unless the request narrows it (``deny``).

    ``allow`` under a job that denies (or allow-lists) egress is refused before any row
    is written: a trainer cannot open a sandbox its operator closed. A denied sandbox is
    guarded like a denying job's pods (``_ensure_guards``): a backend without the guard
    refuses the create (GuardMissing) instead of running it open."""
    job_denies = job.egress != "allow"
    if requested == "allow" and job_denies:
        raise EgressNotPermitted(
            f"job {job.name} {'denies' if job.egress == 'deny' else 'allow-lists'} egress; "
            "a sandbox may narrow its job's egress policy, never widen it"
        )
    return job_denies or requested == "deny"
