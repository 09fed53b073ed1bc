"""The asyncio transport of the trainer client: the same features and typed errors as sync.

    async with AsyncSandboxClient(redis_url) as client:
        async with client.acquire(image=..., job=...) as sb:
            await sb.exec("make test", timeout=600)

Redis calls use ``redis.asyncio``; each sandbox's execd calls go through a keep-alive
``httpx.AsyncClient`` of its own (``SandboxPools``); only the enqueue goes through
Celery's (blocking) producer, in a thread.
Every decision (messages, claim, mailbox wait, heartbeat schedule) comes from
``broker.client.core``, as in ``broker.client.sync``: leases are renewed at a third of
their length by one task per client, group acquires are one publish batch, and a wait
that times out or is cancelled gives up its mailbox and releases a late lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ssl
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, Unpack

import httpx
import redis.asyncio as aredis
from redis.exceptions import RedisError

from broker.client import core
from broker.client.base import ClientBase, ClientOptions, SandboxBase
from broker.errors import SandboxLost, SandboxReclaimed, SandmanError, ServiceUnavailable
from broker.wire import mailbox, warm
from broker.wire.execd import AsyncExecdCalls, Call, RunChunk, RunResult
from broker.wire.snapshots import Snapshot
from broker.wire.types import Lease

SNAPSHOT_TIMEOUT_S = 600.0


class AsyncSandbox(SandboxBase, AsyncExecdCalls):
    """One acquired sandbox; ``await sb.exec(...)`` and friends."""

    def __init__(self, client: AsyncSandboxClient, lease: Lease, *, acquire_s: float) -> None:
        super().__init__(lease, acquire_s=acquire_s)
        self.client = client
        self.http = client.pools.open(self)

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r}, address={self.lease.address!r})"

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()

    async def _send(self, call: Call) -> dict[str, Any]:
        self._check_held()
        try:
            return await self._execd.send_async(self.http, call)
        except SandboxLost as exc:
            raise await self._lost(exc) from exc

    def _stream(self, call: Call) -> AsyncIterator[RunChunk | RunResult]:
        self._check_held()
        return self._guarded(self._execd.stream_async(self.http, call))

    async def _guarded(
        self, items: AsyncIterator[RunChunk | RunResult]
    ) -> AsyncIterator[RunChunk | RunResult]:
        try:
            async for item in items:
                yield item
        except SandboxLost as exc:
            raise await self._lost(exc) from exc

    async def _lost(self, exc: SandboxLost) -> SandboxLost:
        """A lost sandbox the broker reclaimed (idle) is said to be: SandboxReclaimed."""
        key = core.lost_key(exc, self.id)
        try:
            marker = await self.client.redis.get(key) if key else None
        except RedisError:
            return exc  # cannot tell: the failure as it was
        error = core.lost_error(exc, self.id, marker)
        if isinstance(error, SandboxReclaimed):
            self.client.heartbeats.remove(self.id)  # its lease went with it
        return error

    async def healthy(self, timeout: float = 2.0) -> bool:
        if self.released:  # its pool is closed; the lease is no longer this trainer's
            return False
        return await self._execd.healthy_bare(timeout)

    def start_heartbeat(self, interval_s: float) -> None:
        self.client.heartbeats.add(self.id, interval_s)

    async def release(self) -> None:
        """Idempotent: queue the release (checked reuse or delete happens in a worker)."""
        if self._first_release():
            self.client.heartbeats.remove(self.id)
            try:
                await self.client.send(*core.release_message(self.id))
            finally:
                await self.client.pools.close(self)

    # -- snapshots (running processes are never captured: see broker.wire.snapshots) ----

    async def snapshot(
        self,
        paths: list[str] | None = None,
        *,
        ttl_s: float | None = None,
        timeout: float = SNAPSHOT_TIMEOUT_S,
        release: bool = False,
    ) -> Snapshot:
        """As ``Sandbox.snapshot`` of the sync client."""
        self._check_held()
        if release:
            self._first_release()
            self.client.heartbeats.remove(self.id)
            await self.client.pools.close(self)
        fields = {"sandbox_id": self.id, "paths": paths, "ttl_s": ttl_s, "release": release}
        try:
            return await self.client._snapshot_op("capture", timeout, **fields)
        except BaseException:
            if release:  # the worker releases only after a stored snapshot: free it here
                with contextlib.suppress(SandmanError):
                    await self.client.send(*core.release_message(self.id))
            raise

    async def pause(self, paths: list[str] | None = None, **options: Any) -> Snapshot:
        """Snapshot, then release: ``client.resume(snap.id)`` continues from here."""
        return await self.snapshot(paths, release=True, **options)

    async def fork(
        self,
        n: int,
        paths: list[str] | None = None,
        *,
        ttl_s: float | None = None,
        timeout: float = SNAPSHOT_TIMEOUT_S,
    ) -> list[AsyncSandbox | SandmanError]:
        """Snapshot, then n restored sandboxes, each settled on its own (sync ``fork``)."""
        snap = await self.snapshot(paths, ttl_s=ttl_s, timeout=timeout)
        return await self.client.restore_many(n, snap, **self.spec)


class SandboxPools:
    """One small ``httpx.AsyncClient`` (connection pool) per held sandbox.

    One pool shared by every sandbox does not scale with how many a trainer holds:
    httpcore scans all of a pool's connections and queued requests on every request
    and every release, under one lock, so 500 sandboxes (500+ connections) with 200
    concurrent execs cost the trainer 7-13 ms of CPU per exec and capped it at 17-33
    execs/s (bench/trainer_scale.py; 0.6 ms and 700-900/s with a pool per sandbox).
    Pools share one SSL context: httpx would otherwise build one per client (28 ms
    and 0.8 MiB each; execd is plain HTTP, so it is never used).
    """

    def __init__(self, options: dict[str, Any]) -> None:
        self._options = options
        self._ssl: ssl.SSLContext | None = None
        self._open: dict[int, httpx.AsyncClient] = {}

    def open(self, sandbox: AsyncSandbox) -> httpx.AsyncClient:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        http = httpx.AsyncClient(verify=self._ssl, **self._options)
        self._open[id(sandbox)] = http
        return http

    async def close(self, sandbox: AsyncSandbox) -> None:
        http = self._open.pop(id(sandbox), None)
        if http is not None:
            await http.aclose()

    async def close_all(self) -> None:
        pools, self._open = list(self._open.values()), {}
        await asyncio.gather(*(p.aclose() for p in pools), return_exceptions=True)


class AsyncHeartbeats:
    """One task per client renews every lease it holds, due renewals in one batch."""

    def __init__(self, client: AsyncSandboxClient) -> None:
        self.client = client
        self._schedule = core.HeartbeatSchedule()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def add(self, sandbox_id: str, interval_s: float) -> None:
        sooner = self._schedule.add(sandbox_id, interval_s, time.monotonic())
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="sandman-heartbeats"
            )
        if sooner:  # else the loop already wakes in time: a burst of acquires stays quiet
            self._wake.set()

    def remove(self, sandbox_id: str) -> None:
        self._schedule.remove(sandbox_id)

    def held(self) -> int:
        return self._schedule.held()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            due = self._schedule.due(time.monotonic())
            if due:
                with contextlib.suppress(Exception):  # the next round retries
                    await self.client.send_all(core.heartbeat_messages(due, self.client.owner))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._schedule.wait_s(time.monotonic()))
            self._wake.clear()


class AsyncSandboxClient(ClientBase):
    """asyncio entry point for trainers; use as ``async with``."""

    def __init__(self, redis_url: str, **options: Unpack[ClientOptions]) -> None:
        super().__init__(redis_url, **options)
        # A blocking pool: past ``max_connections`` in flight (a thousand concurrent
        # acquires), a call waits for a free connection instead of failing with
        # "Too many connections" (the default pool's answer, a ServiceUnavailable here).
        pool: Any = aredis.BlockingConnectionPool.from_url(
            redis_url, timeout=core.POOL_WAIT_S, **self.redis_options()
        )
        # from_pool: the client owns the pool and closes it (stubs predate redis 5)
        self.redis: aredis.Redis[bytes] = aredis.Redis.from_pool(pool)  # type: ignore[attr-defined]
        self.pools = SandboxPools(self.sandbox_http_options())
        self.heartbeats = AsyncHeartbeats(self)
        # Ledger hand-outs of warm hits are sent off the trainer's critical path, the
        # hand-outs of all claims that land together as one publish batch.
        self._later: set[asyncio.Task[None]] = set()
        self._handouts: list[core.Outbound] = []
        self._health_turns = asyncio.Semaphore(core.WARM_HEALTH_CONCURRENCY)
        self._claim = self.redis.register_script(warm.CLAIM_LUA)
        self._cancel = self.redis.register_script(mailbox.CANCEL_LUA)

    @classmethod
    async def from_settings(cls, settings: Any, **kwargs: Any) -> AsyncSandboxClient:
        """As ``SandboxClient.from_settings``: never starts a service."""
        url = core.redis_url_for(settings)
        client = cls(url, **kwargs)
        try:
            await client.redis.ping()
        except RedisError as exc:
            await client.aclose()
            raise core.not_answering(url, exc) from exc
        return client

    async def __aenter__(self) -> AsyncSandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.heartbeats.close()
        await asyncio.gather(*self._later, return_exceptions=True)
        await self.pools.close_all()
        await self.redis.aclose()  # type: ignore[attr-defined]  # stubs predate redis 5
        self.enqueuer.close()

    async def send(self, name: str, args: list[Any], queue: str) -> None:
        await asyncio.to_thread(self.enqueuer.send, name, args, queue)

    async def send_many(self, name: str, argsets: list[list[Any]], queue: str) -> None:
        await asyncio.to_thread(self.enqueuer.send_many, name, argsets, queue)

    async def send_all(self, messages: Iterable[core.Outbound]) -> None:
        await asyncio.to_thread(self.enqueuer.send_all, list(messages))

    # -- acquire -----------------------------------------------------------------------

    async def open(self, **kwargs: Any) -> AsyncSandbox:
        """Acquire a sandbox the caller must ``await release()`` (prefer ``acquire``);
        ``snapshot=id`` restores that snapshot into it (released again if that fails)."""
        kwargs, snapshot = core.split_snapshot(kwargs)
        request = core.new_request(self.owner, **kwargs)
        sandbox = await self._claim_warm(request)
        if sandbox is None:
            await self.send(*core.acquire_message(request))
            sandbox = await self._wait(request)
        sandbox.spec = kwargs
        sandbox = self._started(sandbox)
        if snapshot is not None:
            await self._restore_into(sandbox, snapshot, float(kwargs.get("timeout", 300.0)))
        return sandbox

    # -- snapshots ---------------------------------------------------------------------

    async def _snapshot_op(self, op: str, timeout: float, **fields: Any) -> Snapshot:
        request, outbound = core.snapshot_op(op, timeout, self.owner, **fields)
        await self.send(*outbound)
        return await self._wait_snapshot(request)

    async def _wait_snapshot(self, request: dict[str, Any]) -> Snapshot:
        wait = core.MailboxWait(request)
        got = None
        try:
            while got is None and (pop_s := wait.next_pop(time.time())) is not None:
                got = await self.redis.blpop([wait.key], timeout=pop_s)
        except RedisError as exc:
            raise ServiceUnavailable(f"Redis unreachable: {exc}") from exc
        if got is None:
            keys, args = wait.cancel_call()
            with contextlib.suppress(Exception):
                await self._cancel(keys=keys, args=args)
            raise wait.timed_out()
        return core.settle_snapshot(got[1])

    async def _restore_into(self, sandbox: AsyncSandbox, snapshot_id: str, timeout: float) -> None:
        try:
            await self._snapshot_op(
                "restore", timeout, sandbox_id=sandbox.id, snapshot_id=snapshot_id
            )
        except BaseException:
            with contextlib.suppress(SandmanError):
                await sandbox.release()
            raise

    async def describe(self, snapshot_id: str, timeout: float = 60.0) -> Snapshot:
        """A ready snapshot's record (SnapshotNotFound when removed or expired)."""
        return await self._snapshot_op("describe", timeout, snapshot_id=snapshot_id)

    async def resume(self, snapshot: Snapshot | str, **kwargs: Any) -> AsyncSandbox:
        """A new sandbox restored from ``snapshot``; the caller releases it."""
        snap = snapshot if isinstance(snapshot, Snapshot) else await self.describe(snapshot)
        return await self.open(**core.resume_args(snap, kwargs))

    async def restore_many(
        self, n: int, snapshot: Snapshot | str, **kwargs: Any
    ) -> list[AsyncSandbox | SandmanError]:
        """n sandboxes restored from ``snapshot``, all settled (see the sync client)."""
        snap = snapshot if isinstance(snapshot, Snapshot) else await self.describe(snapshot)
        args = core.resume_args(snap, kwargs)
        args.pop("snapshot")
        timeout = float(args.get("timeout", 300.0))

        async def one() -> AsyncSandbox:
            sandbox = await self.open(**args)
            await self._restore_into(sandbox, snap.id, timeout)
            return sandbox

        results = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
        out: list[AsyncSandbox | SandmanError] = []
        for r in results:
            if isinstance(r, AsyncSandbox | SandmanError):
                out.append(r)
            else:  # not ours to swallow (a bug, a cancellation): free the others first
                await asyncio.gather(
                    *(s.release() for s in results if isinstance(s, AsyncSandbox)),
                    return_exceptions=True,
                )
                raise r
        return out

    @contextlib.asynccontextmanager
    async def acquire(self, **kwargs: Any) -> AsyncIterator[AsyncSandbox]:
        sandbox = await self.open(**kwargs)
        try:
            yield sandbox
        finally:
            await sandbox.release()

    @contextlib.asynccontextmanager
    async def acquire_many(self, n: int, **kwargs: Any) -> AsyncIterator[list[AsyncSandbox]]:
        """A rollout group: all n acquires are enqueued in one batch and released together."""
        requests = core.group_requests(n, self.owner, **kwargs)
        got: list[AsyncSandbox] = []
        pending: list[dict[str, Any]] = []
        try:
            for request in requests:
                sandbox = await self._claim_warm(request)
                if sandbox is None:
                    pending.append(request)
                else:
                    got.append(self._started(sandbox))
            if pending:
                await self.send_all(core.acquire_message(r) for r in pending)
            results = await asyncio.gather(
                *(self._wait(r) for r in pending), return_exceptions=True
            )
            pending = []  # every wait settled or gave up itself
            got.extend(self._started(r) for r in results if isinstance(r, AsyncSandbox))
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            yield got
        finally:
            for request in pending:  # not answered: give up (a second give-up is harmless)
                with contextlib.suppress(SandmanError, RedisError):
                    await self._give_up(core.MailboxWait(request))
            await asyncio.gather(*(s.release() for s in got), return_exceptions=True)

    async def _claim_warm(self, request: dict[str, Any]) -> AsyncSandbox | None:
        """Try the job's warm pool: atomic claim, then a health check; retry past the sick."""
        if not core.warm_eligible(request):
            return None
        keys, args = core.warm_claim(request)
        try:
            while (
                lease := warm.claimed_lease(await self._claim(keys=keys, args=args))
            ) is not None:
                sandbox = AsyncSandbox(
                    self, lease, acquire_s=core.acquire_seconds(request, time.time())
                )
                async with self._health_turns:
                    healthy = await sandbox.healthy(timeout=core.WARM_HEALTH_TIMEOUT_S)
                outcome = core.warm_outcome(lease, request, self.owner, sandbox.acquire_s, healthy)
                if healthy:
                    self._hand_out_later(outcome)
                    return sandbox
                await self.pools.close(sandbox)
                await self.send(*outcome)
        except RedisError as exc:
            raise ServiceUnavailable(f"Redis unreachable: {exc}") from exc
        return None

    def _hand_out_later(self, outcome: core.Outbound) -> None:
        """Queue a hand-out; the first of a burst starts the task that sends them all.

        One publish (a thread hop and a Redis round trip) per claim cost the trainer more
        CPU than the claim itself; a thousand concurrent claims now share a few batches."""
        self._handouts.append(outcome)
        if len(self._handouts) == 1:
            task = asyncio.get_running_loop().create_task(self._send_handouts())
            self._later.add(task)
            task.add_done_callback(self._later.discard)

    async def _send_handouts(self) -> None:
        await asyncio.sleep(0)  # the claims settling in this same loop pass join the batch
        while self._handouts:
            batch, self._handouts = self._handouts, []
            try:
                await self.send_all(batch)
            except SandmanError:  # lost as one unsent hand-out was before: the claim's
                continue  # marker keeps upkeep from offering that sandbox again meanwhile

    async def _wait(self, request: dict[str, Any]) -> AsyncSandbox:
        wait = core.MailboxWait(request)
        got = None
        try:
            while got is None and (pop_s := wait.next_pop(time.time())) is not None:
                got = await self.redis.blpop([wait.key], timeout=pop_s)
        except RedisError as exc:
            raise ServiceUnavailable(f"Redis unreachable: {exc}") from exc
        except BaseException:  # cancelled: give up so a late lease is released, not lost
            with contextlib.suppress(Exception):
                await asyncio.shield(self._give_up(wait))
            raise
        if got is None:
            await self._give_up(wait)
            raise wait.timed_out()
        lease = core.settle(got[1])
        return AsyncSandbox(self, lease, acquire_s=core.acquire_seconds(request, time.time()))

    async def _give_up(self, wait: core.MailboxWait) -> None:
        keys, args = wait.cancel_call()
        try:
            late = await self._cancel(keys=keys, args=args)
        except RedisError as exc:
            raise ServiceUnavailable(f"Redis unreachable: {exc}") from exc
        await self.send_all(core.late_releases(late))

    def _started(self, sandbox: AsyncSandbox) -> AsyncSandbox:
        now = dt.datetime.now(dt.UTC)
        sandbox.start_heartbeat(core.heartbeat_interval(sandbox.lease, self.heartbeat_s, now))
        return sandbox
