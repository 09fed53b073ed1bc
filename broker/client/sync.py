"""The trainer-facing client: acquire a sandbox, talk to its execd, release it.

    client = SandboxClient(redis_url)
    with client.acquire(image="python:3.12", cpu="500m", memory="1Gi", job="rl-1") as sb:
        sb.exec("pytest -x", timeout=600)

Why it looks like this:
- A warm hit never leaves Redis: one atomic claim (``broker.wire.warm``), one /healthz to
  the sandbox, and the ledger hand-out is queued for a worker. A miss enqueues an
  acquire and blocks on the request's mailbox (BLPOP), so the lease arrives as soon as
  the worker has it, with no polling.
- Failures are typed: every infrastructure failure (AcquireTimeout, SandboxLost,
  ServiceUnavailable, CreateFailed) is a ``broker.errors.InfrastructureError``, so a
  trainer masks that sample instead of scoring it zero; command outcomes (non-zero exit,
  timeouts inside the sandbox) are results, not exceptions.
- Release happens on exit even on exceptions; one heartbeat thread keeps every held
  lease alive at a third of its length, and a crashed trainer stops heartbeating, so
  the GC reclaims its pods. A wait that is interrupted or times out cancels its mailbox
  and releases a lease that slipped in, so a given-up acquire never strands a sandbox.
- This module only does I/O (threads, redis-py, httpx); every decision is in
  ``broker.client.core``, shared with the asyncio client in ``broker.client.aio``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, Unpack

import httpx
import redis as redis_lib

from broker.client import core
from broker.client.base import ClientBase, ClientOptions, SandboxBase
from broker.errors import SandboxLost, SandboxReclaimed, SandmanError, ServiceUnavailable
from broker.names import Queue
from broker.wire import mailbox, warm
from broker.wire.execd import Call, ExecdCalls, ExecResult, RunChunk, RunResult
from broker.wire.snapshots import Snapshot
from broker.wire.types import Lease

__all__ = [
    "QUEUE_ACQUIRE",
    "QUEUE_RELEASE",
    "ExecResult",
    "Heartbeats",
    "RunChunk",
    "RunResult",
    "Sandbox",
    "SandboxClient",
]

QUEUE_ACQUIRE, QUEUE_RELEASE = Queue.ACQUIRE, Queue.RELEASE
SNAPSHOT_TIMEOUT_S = 600.0


class Sandbox(SandboxBase, ExecdCalls):
    """One acquired sandbox: execd calls over the client's shared keep-alive HTTP pool."""

    def __init__(self, client: SandboxClient, lease: Lease, *, acquire_s: float) -> None:
        super().__init__(lease, acquire_s=acquire_s)
        self.client = client

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, address={self.lease.address!r}, warm={self.lease.warm})"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _send(self, call: Call) -> dict[str, Any]:
        self._check_held()
        try:
            return self._execd.send(self.client.http, call)
        except SandboxLost as exc:
            raise self._lost(exc) from exc

    def _stream(self, call: Call) -> Iterator[RunChunk | RunResult]:
        self._check_held()
        return self._guarded(self._execd.stream(self.client.http, call))

    def _guarded(self, items: Iterator[RunChunk | RunResult]) -> Iterator[RunChunk | RunResult]:
        try:
            yield from items
        except SandboxLost as exc:
            raise self._lost(exc) from exc

    def _lost(self, exc: SandboxLost) -> SandboxLost:
        """A lost sandbox the broker reclaimed (idle) is said to be: SandboxReclaimed."""
        key = core.lost_key(exc, self.id)
        try:
            marker = self.client.redis.get(key) if key else None
        except redis_lib.RedisError:
            return exc  # cannot tell: the failure as it was
        error = core.lost_error(exc, self.id, marker)
        if isinstance(error, SandboxReclaimed):
            self.client.heartbeats.remove(self.id)  # its lease went with it
        return error

    def healthy(self, timeout: float = 2.0) -> bool:
        return self._execd.healthy(self.client.http, timeout)

    def start_heartbeat(self, interval_s: float) -> None:
        self.client.heartbeats.add(self.id, interval_s)

    def release(self) -> None:
        """Idempotent: queue the release (checked reuse or delete happens in a worker)."""
        if self._first_release():
            self.client.heartbeats.remove(self.id)
            self.client.send(*core.release_message(self.id))

    # -- snapshots (running processes are never captured: see broker.wire.snapshots) ----

    def snapshot(
        self,
        paths: list[str] | None = None,
        *,
        ttl_s: float | None = None,
        timeout: float = SNAPSHOT_TIMEOUT_S,
        release: bool = False,
    ) -> Snapshot:
        """Capture the workspace roots (default: the workdir and its git repository, or
        ``paths``) and the shell's cwd and exported variables; ``release`` frees the
        sandbox once the snapshot is stored (that is ``pause``)."""
        self._check_held()
        if release:
            self._first_release()
            self.client.heartbeats.remove(self.id)
        fields = {"sandbox_id": self.id, "paths": paths, "ttl_s": ttl_s, "release": release}
        try:
            return self.client._snapshot_op("capture", timeout, **fields)
        except BaseException:
            if release:  # the worker releases only after a stored snapshot: free it here
                with contextlib.suppress(SandmanError):
                    self.client.send(*core.release_message(self.id))
            raise

    def pause(self, paths: list[str] | None = None, **options: Any) -> Snapshot:
        """Snapshot, then release: ``client.resume(snap.id)`` continues from here."""
        return self.snapshot(paths, release=True, **options)

    def fork(
        self,
        n: int,
        paths: list[str] | None = None,
        *,
        ttl_s: float | None = None,
        timeout: float = SNAPSHOT_TIMEOUT_S,
    ) -> list[Sandbox | SandmanError]:
        """Snapshot, then n sandboxes restored from it, each settled on its own: an entry is
        a ready Sandbox (the caller releases it) or the typed error of that one fork."""
        snap = self.snapshot(paths, ttl_s=ttl_s, timeout=timeout)
        return self.client.restore_many(n, snap, **self.spec)


class Heartbeats:
    """One thread per client renews every lease it holds.

    A thread per sandbox would mean thousands of threads for a trainer holding a large
    rollout group; here due renewals are collected and sent as one pipelined batch.
    """

    def __init__(self, client: SandboxClient) -> None:
        self.client = client
        self._schedule = core.HeartbeatSchedule()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, sandbox_id: str, interval_s: float) -> None:
        with self._lock:
            self._schedule.add(sandbox_id, interval_s, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="sandman-heartbeats", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def remove(self, sandbox_id: str) -> None:
        with self._lock:
            self._schedule.remove(sandbox_id)

    def held(self) -> int:
        with self._lock:
            return self._schedule.held()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        while not self._closed:
            with self._lock:
                due = self._schedule.due(time.monotonic())
            if due:
                with contextlib.suppress(Exception):  # the next round retries
                    self.client.enqueuer.send_all(core.heartbeat_messages(due, self.client.owner))
            with self._lock:
                wait_s = self._schedule.wait_s(time.monotonic())
            self._wake.wait(wait_s)
            self._wake.clear()


class SandboxClient(ClientBase):
    """Entry point for trainers. Thread-safe; one per process is enough."""

    def __init__(self, redis_url: str, **options: Unpack[ClientOptions]) -> None:
        super().__init__(redis_url, **options)
        self.redis = redis_lib.Redis.from_url(redis_url, **self.redis_options())
        self.http = httpx.Client(**self.http_options())
        self.heartbeats = Heartbeats(self)
        # Ledger hand-outs of warm hits are sent off the trainer's critical path.
        self._later: queue.SimpleQueue[core.Outbound | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_later, name="sandman-send", daemon=True)
        self._sender.start()
        self._claim = self.redis.register_script(warm.CLAIM_LUA)
        self._cancel = self.redis.register_script(mailbox.CANCEL_LUA)

    def _send_later(self) -> None:
        """Drain whatever queued up and send it in pipelined batches: during a burst of
        warm hits this thread would otherwise take the GIL once per message."""
        while (item := self._later.get()) is not None:
            batch = [item]
            while len(batch) < 500:
                try:
                    nxt = self._later.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._later.put(None)
                    break
                batch.append(nxt)
            with contextlib.suppress(ServiceUnavailable):
                self.enqueuer.send_all(batch)

    @classmethod
    def from_settings(cls, settings: Any, **kwargs: Any) -> SandboxClient:
        """A client for the broker these settings describe; it never starts a service.

        ``settings.redis_url`` when set, else the embedded Redis that ``sandman up`` left
        in the state dir; ServiceUnavailable (saying what to run) when neither answers.
        """
        url = core.redis_url_for(settings)
        client = cls(url, **kwargs)
        try:
            client.redis.ping()
        except redis_lib.RedisError as exc:
            client.close()
            raise core.not_answering(url, exc) from exc
        return client

    def close(self) -> None:
        self.heartbeats.close()
        self._later.put(None)
        self._sender.join(timeout=10)
        self.http.close()
        self.redis.close()
        self.enqueuer.close()

    def send(self, name: str, args: list[Any], queue: str) -> None:
        self.enqueuer.send(name, args, queue)

    def send_many(self, name: str, argsets: list[list[Any]], queue: str) -> None:
        self.enqueuer.send_many(name, argsets, queue)

    # -- acquire -----------------------------------------------------------------------

    def open(self, **kwargs: Any) -> Sandbox:
        """Acquire a sandbox the caller must ``release()`` (prefer ``acquire``).

        Arguments: image, job (required); cpu, memory, timeout, role, image_digest,
        base_commit, workdir, env, visible_cpus, egress (see
        ``broker.client.core.ACQUIRE_DEFAULTS``).
        """
        kwargs, snapshot = core.split_snapshot(kwargs)
        request = core.new_request(self.owner, **kwargs)
        sandbox = self._claim_warm(request)
        if sandbox is None:
            self.send(*core.acquire_message(request))
            sandbox = self._wait(request)
        sandbox.spec = kwargs
        sandbox = self._started(sandbox)
        if snapshot is not None:
            self._restore_into(sandbox, snapshot, float(kwargs.get("timeout", 300.0)))
        return sandbox

    # -- snapshots ---------------------------------------------------------------------

    def _snapshot_op(self, op: str, timeout: float, **fields: Any) -> Snapshot:
        request, outbound = core.snapshot_op(op, timeout, self.owner, **fields)
        self.send(*outbound)
        return self._wait_snapshot(request)

    def _wait_snapshot(self, request: dict[str, Any]) -> Snapshot:
        wait = core.MailboxWait(request)
        got = None
        try:
            while got is None and (pop_s := wait.next_pop(time.time())) is not None:
                got = self.redis.blpop([wait.key], timeout=pop_s)
        except redis_lib.RedisError as exc:
            raise ServiceUnavailable(f"Redis unreachable: {exc}") from exc
        if got is None:
            keys, args = wait.cancel_call()
            with contextlib.suppress(Exception):
                self._cancel(keys=keys, args=args)
            raise wait.timed_out()
        return core.settle_snapshot(got[1])

    def _restore_into(self, sandbox: Sandbox, snapshot_id: str, timeout: float) -> None:
        """Restore or release: a sandbox whose restore failed is never handed out."""
        try:
            self._snapshot_op("restore", timeout, sandbox_id=sandbox.id, snapshot_id=snapshot_id)
        except BaseException:
            with contextlib.suppress(SandmanError):
                sandbox.release()
            raise

    def describe(self, snapshot_id: str, timeout: float = 60.0) -> Snapshot:
        """A ready snapshot's record (SnapshotNotFound when removed or expired)."""
        return self._snapshot_op("describe", timeout, snapshot_id=snapshot_id)

    def resume(self, snapshot: Snapshot | str, **kwargs: Any) -> Sandbox:
        """A new sandbox restored from ``snapshot`` (of its image, in its job unless the
        caller names others); the caller releases it."""
        snap = snapshot if isinstance(snapshot, Snapshot) else self.describe(snapshot)
        return self.open(**core.resume_args(snap, kwargs))

    def restore_many(
        self, n: int, snapshot: Snapshot | str, **kwargs: Any
    ) -> list[Sandbox | SandmanError]:
        """n sandboxes restored from ``snapshot``, all settled: each entry is a ready
        Sandbox or that fork's typed error. Acquires are batched (warm claims first), the
        restores run in parallel on the workers."""
        snap = snapshot if isinstance(snapshot, Snapshot) else self.describe(snapshot)
        args = core.resume_args(snap, kwargs)
        args.pop("snapshot")
        requests = core.group_requests(n, self.owner, **args)
        out: list[Sandbox | SandmanError | None] = [None] * n
        try:
            pending = []
            for i, request in enumerate(requests):
                try:
                    out[i] = self._claim_warm(request)
                except SandmanError as exc:
                    out[i] = exc
                if out[i] is None:
                    pending.append(i)
            if pending:
                self.enqueuer.send_all(core.acquire_message(requests[i]) for i in pending)
            for i in pending:
                try:
                    out[i] = self._wait(requests[i])
                except SandmanError as exc:
                    out[i] = exc
            restores: dict[int, dict[str, Any]] = {}
            outbound = []
            for i, got in enumerate(out):
                if isinstance(got, Sandbox):
                    got.spec = args
                    self._started(got)
                    restores[i], message = core.snapshot_op(
                        "restore",
                        float(args.get("timeout", 300.0)),
                        self.owner,
                        sandbox_id=got.id,
                        snapshot_id=snap.id,
                    )
                    outbound.append(message)
            self.enqueuer.send_all(outbound)
            for i, request in restores.items():
                sandbox = out[i]
                assert isinstance(sandbox, Sandbox)
                try:
                    self._wait_snapshot(request)
                except SandmanError as exc:
                    sandbox.release()
                    out[i] = exc
        except BaseException:
            for got in out:
                if isinstance(got, Sandbox):
                    with contextlib.suppress(SandmanError):
                        got.release()
            raise
        return [got for got in out if got is not None]

    @contextlib.contextmanager
    def acquire(self, **kwargs: Any) -> Iterator[Sandbox]:
        """``with client.acquire(image=..., job=...) as sb:``; released on exit, always."""
        sandbox = self.open(**kwargs)
        try:
            yield sandbox
        finally:
            sandbox.release()

    @contextlib.contextmanager
    def acquire_many(self, n: int, **kwargs: Any) -> Iterator[list[Sandbox]]:
        """A rollout group: all n acquires are enqueued in one batch and released together."""
        requests = core.group_requests(n, self.owner, **kwargs)
        got: list[Sandbox] = []
        pending: list[dict[str, Any]] = []
        try:
            for request in requests:
                sandbox = self._claim_warm(request)
                if sandbox is None:
                    pending.append(request)
                else:
                    got.append(self._started(sandbox))
            if pending:
                self.enqueuer.send_all(core.acquire_message(r) for r in pending)
            while pending:
                got.append(self._started(self._wait(pending[0])))
                pending.pop(0)
            yield got
        finally:
            for request in pending:  # not answered: give up (a second give-up is harmless)
                with contextlib.suppress(SandmanError, redis_lib.RedisError):
                    self._give_up(core.MailboxWait(request))
            for sandbox in got:
                with contextlib.suppress(SandmanError):
                    sandbox.release()

    def _claim_warm(self, request: dict[str, Any]) -> Sandbox | None:
        """Try the job's warm pool: atomic claim, then a health check; retry past the sick."""
        if not core.warm_eligible(request):
            return None
        keys, args = core.warm_claim(request)
        try:
            while (lease := warm.claimed_lease(self._claim(keys=keys, args=args))) is not None:
                sandbox = Sandbox(self, lease, acquire_s=core.acquire_seconds(request, time.time()))
                healthy = sandbox.healthy(timeout=core.WARM_HEALTH_TIMEOUT_S)
                outcome = core.warm_outcome(lease, request, self.owner, sandbox.acquire_s, healthy)
                if healthy:
                    self._later.put(outcome)
                    return sandbox
                self.send(*outcome)
        except redis_lib.RedisError as exc:
            raise ServiceUnavailable(f"Redis unreachable: {exc}") from exc
        return None

    def _wait(self, request: dict[str, Any]) -> Sandbox:
        wait = core.MailboxWait(request)
        got = None
        try:
            while got is None and (pop_s := wait.next_pop(time.time())) is not None:
                got = self.redis.blpop([wait.key], timeout=pop_s)
        except redis_lib.RedisError as exc:
            raise ServiceUnavailable(f"Redis unreachable: {exc}") from exc
        except BaseException:  # interrupted: give up so a late lease is released, not lost
            with contextlib.suppress(Exception):
                self._give_up(wait)
            raise
        if got is None:
            self._give_up(wait)
            raise wait.timed_out()
        lease = core.settle(got[1])
        return Sandbox(self, lease, acquire_s=core.acquire_seconds(request, time.time()))

    def _give_up(self, wait: core.MailboxWait) -> None:
        keys, args = wait.cancel_call()
        try:
            late = self._cancel(keys=keys, args=args)
        except redis_lib.RedisError as exc:
            raise ServiceUnavailable(f"Redis unreachable: {exc}") from exc
        self.enqueuer.send_all(core.late_releases(late))

    def _started(self, sandbox: Sandbox) -> Sandbox:
        now = dt.datetime.now(dt.UTC)
        sandbox.start_heartbeat(core.heartbeat_interval(sandbox.lease, self.heartbeat_s, now))
        return sandbox
