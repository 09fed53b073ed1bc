"""The asyncio flavour of ``broker.client.sync``: same protocol, same typed errors.

    async with AsyncSandboxClient(redis_url) as client:
        async with client.acquire(image=..., job=...) as sb:
            await sb.exec("make test", timeout=600)

Redis calls use ``redis.asyncio`` and execd calls one shared ``httpx.AsyncClient``
(keep-alive); only the enqueue goes through Celery's (blocking) producer, in a thread.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import redis.asyncio as aredis

from broker.client.sync import (
    QUEUE_ACQUIRE,
    QUEUE_RELEASE,
    ExecResult,
    SandboxClient,
    execd_answer,
)
from broker.errors import (
    AcquireTimeout,
    InvalidRequest,
    SandboxLost,
    ServiceUnavailable,
)
from broker.names import Task
from broker.pools.store import _CLAIM_LUA, CLAIM_TTL_S, WarmStore, pool_key
from broker.wire import mailbox
from broker.wire.errors import raise_payload_error
from broker.wire.request import request_body
from broker.wire.types import Lease


class AsyncSandbox:
    """One acquired sandbox; ``await sb.exec(...)`` and friends."""

    def __init__(self, client: AsyncSandboxClient, lease: Lease, *, acquire_s: float) -> None:
        self.client, self.lease, self.id, self.acquire_s = (
            client,
            lease,
            lease.sandbox_id,
            acquire_s,
        )
        self.released = False
        self._base = f"http://{lease.address}"
        self._headers = {"Authorization": f"Bearer {lease.token}"}
        self._beat: asyncio.Task[None] | None = None

    async def _call(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.released:
            raise SandboxLost(f"sandbox {self.id} was already released")
        try:
            resp = await self.client.http.post(
                self._base + path, json=body, headers=self._headers, timeout=timeout
            )
        except httpx.TimeoutException as exc:
            raise SandboxLost(f"execd of {self.id} did not answer {path} in {timeout}s") from exc
        except httpx.TransportError as exc:
            raise SandboxLost(f"execd of {self.id} is unreachable: {exc}") from exc
        return execd_answer(resp, path, f"execd of {self.id}")

    async def exec(self, command: str, *, timeout: float = 60.0) -> ExecResult:
        data = await self._call("/v1/exec", {"command": command, "timeout": timeout}, timeout + 15)
        fields = ExecResult.__dataclass_fields__
        return ExecResult(**{k: v for k, v in data.items() if k in fields})

    async def read_file(self, path: str) -> bytes:
        data = await self._call("/v1/files/read", {"path": path}, 60.0)
        return base64.b64decode(data["content_b64"])

    async def write_file(self, path: str, content: bytes | str) -> int:
        raw = content.encode() if isinstance(content, str) else content
        body = {"path": path, "content_b64": base64.b64encode(raw).decode()}
        return int((await self._call("/v1/files/write", body, 60.0))["size"])

    async def edit(self, path: str, old: str, new: str) -> dict[str, Any]:
        return await self._call("/v1/files/edit", {"path": path, "old": old, "new": new}, 60.0)

    async def reset(self) -> dict[str, Any]:
        return await self._call("/v1/reset", {}, 60.0)

    async def healthy(self, timeout: float = 1.0) -> bool:
        try:
            resp = await self.client.http.get(
                self._base + "/healthz", headers=self._headers, timeout=timeout
            )
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def start_heartbeat(self, interval_s: float) -> None:
        async def beat() -> None:
            while True:
                await asyncio.sleep(interval_s)
                with contextlib.suppress(Exception):
                    await self.client.send(
                        Task.HEARTBEAT, [self.id, self.client.owner], QUEUE_RELEASE
                    )

        self._beat = asyncio.get_running_loop().create_task(beat())

    async def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self._beat is not None:
            self._beat.cancel()
        await self.client.send(Task.RELEASE, [self.id, "released"], QUEUE_RELEASE)


class AsyncSandboxClient:
    """asyncio entry point for trainers; use as ``async with``."""

    def __init__(
        self, redis_url: str, *, owner: str | None = None, heartbeat_s: float = 60.0
    ) -> None:
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}"
        self.heartbeat_s = heartbeat_s
        self.redis = aredis.Redis.from_url(redis_url, socket_timeout=30, socket_connect_timeout=5)
        self.http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=512)
        )
        self._sync = SandboxClient(redis_url, owner=self.owner)  # Celery producer only
        self._claim = self.redis.register_script(_CLAIM_LUA)

    async def __aenter__(self) -> AsyncSandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.redis.aclose()  # type: ignore[attr-defined]  # stubs predate redis 5
        self._sync.close()

    async def send(self, name: str, args: list[Any], queue: str) -> None:
        await asyncio.to_thread(self._sync.send, name, args, queue)

    async def open(
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
    ) -> AsyncSandbox:
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
        sandbox = await self._claim_warm(request)
        if sandbox is None:
            await self.send(Task.ACQUIRE, [request], QUEUE_ACQUIRE)
            sandbox = await self._wait(request)
        sandbox.start_heartbeat(self.heartbeat_s)
        return sandbox

    @contextlib.asynccontextmanager
    async def acquire(self, **kwargs: Any) -> AsyncIterator[AsyncSandbox]:
        sandbox = await self.open(**kwargs)
        try:
            yield sandbox
        finally:
            await sandbox.release()

    @contextlib.asynccontextmanager
    async def acquire_many(self, n: int, **kwargs: Any) -> AsyncIterator[list[AsyncSandbox]]:
        """A rollout group acquired concurrently; all released together."""
        if not 1 <= n <= 10_000:
            raise InvalidRequest(f"group size {n} outside 1..10000")
        results = await asyncio.gather(
            *(self.open(**kwargs) for _ in range(n)), return_exceptions=True
        )
        got = [r for r in results if isinstance(r, AsyncSandbox)]
        try:
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            yield got
        finally:
            await asyncio.gather(*(s.release() for s in got), return_exceptions=True)

    async def _claim_warm(self, request: dict[str, Any]) -> AsyncSandbox | None:
        key = pool_key(
            request["image"],
            request["image_digest"],
            request["base_commit"],
            request["cpu_m"],
            request["memory_b"],
        )
        ids, leases = WarmStore._keys(request["job"], key)
        try:
            while True:
                raw = await self._claim(
                    keys=[ids, leases], args=[request["request_id"], CLAIM_TTL_S]
                )
                if not raw:
                    return None
                lease = Lease.from_dict(json.loads(raw))
                sb = AsyncSandbox(self, lease, acquire_s=time.time() - request["enqueued_at"])
                if await sb.healthy():
                    await self.send(
                        Task.CLAIMED,
                        [
                            lease.sandbox_id,
                            request["request_id"],
                            self.owner,
                            sb.acquire_s,
                            request["enqueued_at"],
                        ],
                        QUEUE_RELEASE,
                    )
                    return sb
                await self.send(Task.RELEASE, [lease.sandbox_id, "warm-unhealthy"], QUEUE_RELEASE)
        except aredis.RedisError as exc:
            raise ServiceUnavailable(f"Redis unreachable: {exc}") from exc

    async def _wait(self, request: dict[str, Any]) -> AsyncSandbox:
        rid = request["request_id"]
        try:
            while True:
                remaining = request["deadline"] - time.time()
                if remaining <= 0:
                    late = await asyncio.to_thread(mailbox.cancel, self._sync.redis, rid)
                    if late and "lease" in late:
                        await self.send(
                            Task.RELEASE,
                            [late["lease"]["sandbox_id"], "released"],
                            QUEUE_RELEASE,
                        )
                    raise AcquireTimeout(f"no sandbox for {rid} within the timeout")
                got = await self.redis.blpop([mailbox.result_key(rid)], timeout=min(remaining, 5.0))
                if got is not None:
                    break
        except aredis.RedisError as exc:
            raise ServiceUnavailable(f"Redis unreachable: {exc}") from exc
        payload = mailbox.parse(got[1])
        if "lease" not in payload:
            raise_payload_error(payload)
        return AsyncSandbox(
            self, Lease.from_dict(payload["lease"]), acquire_s=time.time() - request["enqueued_at"]
        )
