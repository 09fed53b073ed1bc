"""The trainer-facing client: acquire a sandbox, talk to its execd, release it.

    client = SandboxClient(redis_url)
    with client.acquire(image="python:3.12", cpu="500m", memory="1Gi", job="rl-1") as sb:
        sb.exec("pytest -x", timeout=600)

Why it looks like this:
- A warm hit never leaves Redis: one atomic claim (``broker.pools.store``), one authenticated
  /healthz to the sandbox, and the ledger hand-out is queued for a worker. A miss
  enqueues an acquire and blocks on the request's mailbox (BLPOP), so the lease arrives
  as soon as the worker has it, with no polling.
- Failures are typed: every infrastructure failure (AcquireTimeout, SandboxLost,
  ServiceUnavailable, CreateFailed) is a ``broker.errors.InfrastructureError``, so a
  trainer masks that sample instead of scoring it zero; command outcomes (non-zero exit,
  timeouts inside the sandbox) are results, not exceptions.
- Release happens on exit even on exceptions; a heartbeat thread keeps long rollouts'
  leases alive, and a crashed trainer stops heartbeating, so the GC reclaims its pods.
- Importable without Flask or the kubernetes package (a unit test enforces it).
"""

from __future__ import annotations

import base64
import contextlib
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import redis as redis_lib

from broker.errors import (
    AcquireTimeout,
    ExecAuthError,
    ExecError,
    InvalidRequest,
    SandboxLost,
    SandmanError,
    ServiceUnavailable,
)
from broker.names import Queue, Task
from broker.pools.store import WarmStore, pool_key
from broker.wire import mailbox
from broker.wire.errors import raise_payload_error
from broker.wire.request import request_body
from broker.wire.types import Lease

QUEUE_ACQUIRE, QUEUE_RELEASE = Queue.ACQUIRE, Queue.RELEASE


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0
    session_restarted: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def execd_answer(resp: httpx.Response, path: str, who: str) -> dict[str, Any]:
    """Decode one execd reply; its error statuses become the typed tree.

    401/403 is ExecAuthError, 5xx or a non-JSON body means the sandbox is lost (an
    infrastructure failure), any other refusal is ExecError with execd's own code.
    """
    try:
        data: dict[str, Any] = resp.json()
    except ValueError as exc:
        raise SandboxLost(f"{who} sent a non-JSON answer") from exc
    if resp.status_code == 200:
        return data
    error = data.get("error") or {}
    message = f"{path}: {error.get('code')}: {error.get('message')}"
    if resp.status_code in (401, 403):
        raise ExecAuthError(message, status=resp.status_code, error_code="auth")
    if resp.status_code >= 500:
        raise SandboxLost(message)
    raise ExecError(message, status=resp.status_code, error_code=str(error.get("code")))


class Sandbox:
    """One acquired sandbox: execd calls over a shared keep-alive HTTP pool."""

    def __init__(self, client: SandboxClient, lease: Lease, *, acquire_s: float) -> None:
        self.client = client
        self.lease = lease
        self.id = lease.sandbox_id
        self.acquire_s = acquire_s
        self.released = False
        self._base = f"http://{lease.address}"
        self._headers = {"Authorization": f"Bearer {lease.token}"}

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, address={self.lease.address!r}, warm={self.lease.warm})"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- execd -------------------------------------------------------------------------

    def _call(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.released:
            raise SandboxLost(f"sandbox {self.id} was already released")
        try:
            resp = self.client.http.post(
                self._base + path, json=body, headers=self._headers, timeout=timeout
            )
        except httpx.TimeoutException as exc:
            raise SandboxLost(f"execd of {self.id} did not answer {path} in {timeout}s") from exc
        except httpx.TransportError as exc:
            raise SandboxLost(f"execd of {self.id} is unreachable: {exc}") from exc
        return execd_answer(resp, path, f"execd of {self.id}")

    def exec(
        self, command: str, *, timeout: float = 60.0, max_output_bytes: int | None = None
    ) -> ExecResult:
        body: dict[str, Any] = {"command": command, "timeout": timeout}
        if max_output_bytes is not None:
            body["max_output_bytes"] = max_output_bytes
        data = self._call("/v1/exec", body, timeout + 15.0)
        fields = ExecResult.__dataclass_fields__
        return ExecResult(**{k: v for k, v in data.items() if k in fields})

    def read_file(self, path: str) -> bytes:
        data = self._call("/v1/files/read", {"path": path}, 60.0)
        return base64.b64decode(data["content_b64"])

    def read_text(self, path: str) -> str:
        return self.read_file(path).decode()

    def write_file(self, path: str, content: bytes | str, *, mode: int | None = None) -> int:
        raw = content.encode() if isinstance(content, str) else content
        body: dict[str, Any] = {"path": path, "content_b64": base64.b64encode(raw).decode()}
        if mode is not None:
            body["mode"] = mode
        return int(self._call("/v1/files/write", body, 60.0)["size"])

    def edit(self, path: str, old: str, new: str) -> dict[str, Any]:
        return self._call("/v1/files/edit", {"path": path, "old": old, "new": new}, 60.0)

    def reset(self) -> dict[str, Any]:
        return self._call("/v1/reset", {}, 60.0)

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            resp = self.client.http.get(
                self._base + "/healthz", headers=self._headers, timeout=timeout
            )
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    # -- lease -------------------------------------------------------------------------

    def start_heartbeat(self, interval_s: float) -> None:
        self.client.heartbeats.add(self.id, interval_s)

    def release(self) -> None:
        """Idempotent: queue the release (checked reuse or delete happens in a worker)."""
        if self.released:
            return
        self.released = True
        self.client.heartbeats.remove(self.id)
        self.client.send(Task.RELEASE, [self.id, "released"], QUEUE_RELEASE)


class Heartbeats:
    """One thread per client renews every lease it holds.

    A thread per sandbox would mean thousands of threads for a trainer holding a large
    rollout group; here due renewals are collected and sent as one pipelined batch.
    """

    def __init__(self, client: SandboxClient) -> None:
        self.client = client
        self._next: dict[str, tuple[float, float]] = {}  # id -> (due, interval)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, sandbox_id: str, interval_s: float) -> None:
        with self._lock:
            self._next[sandbox_id] = (time.monotonic() + interval_s, interval_s)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="sandman-heartbeats", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def remove(self, sandbox_id: str) -> None:
        with self._lock:
            self._next.pop(sandbox_id, None)

    def held(self) -> int:
        with self._lock:
            return len(self._next)

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        while not self._closed:
            now = time.monotonic()
            with self._lock:
                due = [sid for sid, (at, _) in self._next.items() if at <= now]
                for sid in due:
                    self._next[sid] = (now + self._next[sid][1], self._next[sid][1])
                soonest = min((at for at, _ in self._next.values()), default=now + 60.0)
            if due:
                with contextlib.suppress(Exception):  # the next round retries
                    self.client.send_many(
                        Task.HEARTBEAT,
                        [[sid, self.client.owner] for sid in due],
                        QUEUE_RELEASE,
                    )
            self._wake.wait(max(0.05, min(soonest - time.monotonic(), 60.0)))
            self._wake.clear()


class SandboxClient:
    """Entry point for trainers. Thread-safe; one per process is enough."""

    def __init__(
        self,
        redis_url: str,
        *,
        owner: str | None = None,
        heartbeat_s: float | None = None,
        max_connections: int = 512,
    ) -> None:
        from celery import Celery

        self.redis_url = redis_url
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}"
        self.heartbeat_s = heartbeat_s
        self.redis = redis_lib.Redis.from_url(
            # Blocking pops wait up to 5 s: the socket timeout must be longer (redis-py 8
            # defaults it to 5 s).
            redis_url,
            max_connections=max_connections,
            socket_timeout=30,
            socket_connect_timeout=5,
        )
        self.warm = WarmStore(self.redis)
        self.http = httpx.Client(
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            timeout=60.0,
        )
        self.celery = Celery("sandman-client", broker=redis_url, set_as_current=False)
        self.celery.conf.update(
            task_serializer="json",
            accept_content=["json"],
            result_backend=None,
            task_ignore_result=True,
            broker_connection_retry_on_startup=True,
        )
        self.heartbeats = Heartbeats(self)
        # Ledger hand-outs of warm hits are sent off the trainer's critical path.
        self._later: queue.SimpleQueue[tuple[str, list[Any], str] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_later, name="sandman-send", daemon=True)
        self._sender.start()

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
            groups: dict[tuple[str, str], list[list[Any]]] = {}
            for name, args, q in batch:
                groups.setdefault((name, q), []).append(args)
            for (name, q), argsets in groups.items():
                with contextlib.suppress(ServiceUnavailable):
                    self.send_many(name, argsets, q)

    @classmethod
    def from_settings(cls, settings: Any, **kwargs: Any) -> SandboxClient:
        url = settings.redis_url
        if not url:
            from broker.local.services import ensure_services

            url = ensure_services(settings).redis_url
        return cls(url, **kwargs)

    def close(self) -> None:
        self.heartbeats.close()
        self._later.put(None)
        self._sender.join(timeout=10)
        self.http.close()
        self.redis.close()

    def send(self, name: str, args: list[Any], queue: str) -> None:
        try:
            self.celery.send_task(name, args=args, queue=queue)
        except Exception as exc:  # kombu/redis errors: the broker side is unreachable
            raise ServiceUnavailable(f"cannot enqueue {name}: {exc}") from exc

    def send_many(self, name: str, argsets: list[list[Any]], queue: str) -> None:
        """Enqueue many tasks in pipelined Redis round trips (kombu publish batches).

        A rollout group or a burst of a thousand acquires costs a few round trips instead
        of one per message, so the whole burst is queued well inside a second."""
        try:
            with self.celery.producer_or_acquire() as producer, producer.batch(max_size=500):
                for args in argsets:
                    self.celery.send_task(name, args=args, queue=queue, producer=producer)
        except Exception as exc:
            raise ServiceUnavailable(f"cannot enqueue {len(argsets)} x {name}: {exc}") from exc

    # -- acquire -----------------------------------------------------------------------

    def open(
        self,
        *,
        image: str,
        job: str,
        cpu: str | int | float = 1,
        memory: str | int = "1Gi",
        timeout: float = 300.0,
        role: str = "rollout",
        image_digest: str | None = None,
        base_commit: str | None = None,
        workdir: str = "/",
        env: dict[str, str] | None = None,
    ) -> Sandbox:
        """Acquire a sandbox the caller must ``release()`` (prefer ``acquire``)."""
        request = request_body(
            image=image,
            cpu=cpu,
            memory=memory,
            job=job,
            role=role,
            image_digest=image_digest,
            base_commit=base_commit,
            workdir=workdir,
            env=env,
            owner=self.owner,
            timeout=timeout,
        )
        sandbox = self._claim_warm(request)
        if sandbox is None:
            self.send(Task.ACQUIRE, [request], QUEUE_ACQUIRE)
            sandbox = self._wait(request)
        return self._started(sandbox)

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
        """A rollout group: all n acquires are enqueued at once and released together."""
        if not 1 <= n <= 10_000:
            raise InvalidRequest(f"group size {n} outside 1..10000")
        timeout = float(kwargs.pop("timeout", 300.0))
        role = str(kwargs.pop("role", "rollout"))
        args = _acquire_args(kwargs)
        requests = [
            request_body(owner=self.owner, timeout=timeout, role=role, **args) for _ in range(n)
        ]
        got: list[Sandbox] = []
        try:
            pending = []
            for request in requests:
                sandbox = self._claim_warm(request)
                if sandbox is None:
                    pending.append(request)
                else:
                    got.append(self._started(sandbox))
            if pending:
                self.send_many(Task.ACQUIRE, [[r] for r in pending], QUEUE_ACQUIRE)
            for request in pending:
                got.append(self._started(self._wait(request)))
            yield got
        finally:
            for sandbox in got:
                with contextlib.suppress(SandmanError):
                    sandbox.release()

    def _claim_warm(self, request: dict[str, Any]) -> Sandbox | None:
        """Try the job's warm pool: atomic claim, then an authenticated health check."""
        key = pool_key(
            request["image"],
            request["image_digest"],
            request["base_commit"],
            request["cpu_m"],
            request["memory_b"],
        )
        try:
            while True:
                lease = self.warm.claim(request["job"], key, request["request_id"])
                if lease is None:
                    return None
                sandbox = Sandbox(self, lease, acquire_s=time.time() - request["enqueued_at"])
                if sandbox.healthy(timeout=1.0):
                    self._later.put(
                        (
                            Task.CLAIMED,
                            [
                                lease.sandbox_id,
                                request["request_id"],
                                self.owner,
                                sandbox.acquire_s,
                                request["enqueued_at"],
                            ],
                            QUEUE_RELEASE,
                        )
                    )
                    return sandbox
                self.send(Task.RELEASE, [lease.sandbox_id, "warm-unhealthy"], QUEUE_RELEASE)
        except redis_lib.RedisError as exc:
            raise ServiceUnavailable(f"Redis unreachable: {exc}") from exc

    def _wait(self, request: dict[str, Any]) -> Sandbox:
        rid = request["request_id"]
        try:
            while True:
                remaining = request["deadline"] - time.time()
                if remaining <= 0:
                    late = mailbox.cancel(self.redis, rid)
                    if late and "lease" in late:
                        self.send(
                            Task.RELEASE,
                            [late["lease"]["sandbox_id"], "released"],
                            QUEUE_RELEASE,
                        )
                    raise AcquireTimeout(f"no sandbox for {rid} within the timeout")
                got = self.redis.blpop([mailbox.result_key(rid)], timeout=min(remaining, 5.0))
                if got is not None:
                    break
        except redis_lib.RedisError as exc:
            raise ServiceUnavailable(f"Redis unreachable: {exc}") from exc
        payload = mailbox.parse(got[1])
        if "lease" not in payload:
            raise_payload_error(payload)
        lease = Lease.from_dict(payload["lease"])
        return Sandbox(self, lease, acquire_s=time.time() - request["enqueued_at"])

    def _started(self, sandbox: Sandbox) -> Sandbox:
        interval = self.heartbeat_s
        if interval is None and sandbox.lease.lease_expires_at:
            import datetime as dt

            expires = dt.datetime.fromisoformat(sandbox.lease.lease_expires_at)
            interval = (expires - dt.datetime.now(dt.UTC)).total_seconds() / 3
        # A third of the lease: two renewals can be lost before it runs out.
        sandbox.start_heartbeat(max(1.0, interval or 60.0))
        return sandbox


def _acquire_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    allowed = ("image", "cpu", "memory", "job", "image_digest", "base_commit", "workdir", "env")
    unknown = set(kwargs) - set(allowed)
    if unknown:
        raise InvalidRequest(f"unknown acquire arguments: {sorted(unknown)}")
    defaults: dict[str, Any] = {
        "cpu": 1,
        "memory": "1Gi",
        "image_digest": None,
        "base_commit": None,
        "workdir": "/",
        "env": None,
    }
    return {**defaults, **{k: v for k, v in kwargs.items() if k in allowed}}
