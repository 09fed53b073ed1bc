"""Both trainer transports, sync and async, against the real stack: the same tests run twice.

The ``trainer`` fixture yields one adapter over either client, so every feature (exec
output caps, file modes, edits, warm hits, batched groups, heartbeats at a third of the
lease, typed timeouts) is proven for both. The async client runs on a loop in a
background thread, as a trainer's would, so its heartbeat task really runs while the
test waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import select

from broker.client import AsyncSandboxClient, RunChunk, RunResult, SandboxClient
from broker.errors import (
    AcquireTimeout,
    ExecError,
    ExecSessionNotFound,
    ExecUserError,
    InfrastructureError,
    SandboxLost,
    UnknownJob,
)
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.ledger.states import State
from broker.names import Task
from broker.pools.store import WarmStore
from broker.settings import Settings
from broker.wire.warm import pool_key
from tests.support.images import TASK_IMAGE

pytestmark = pytest.mark.integration
IMAGE = TASK_IMAGE


class Handle:
    """Calls on a client or sandbox of either flavour, made synchronous for the test."""

    def __init__(self, target: Any, run: Callable[[Any], Any]) -> None:
        self.target = target
        self._run = run

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.target, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            out = attr(*args, **kwargs)
            return self._run(out) if inspect.isawaitable(out) else out

        return call


class Trainer:
    """One client (sync or async) with the sync-looking surface the tests use."""

    def __init__(self, flavour: str, redis_url: str, **kwargs: Any) -> None:
        self.flavour = flavour
        self._loop: asyncio.AbstractEventLoop | None = None
        if flavour == "async":
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
            self._thread.start()
            client: Any = self.run(self._make_async(redis_url, kwargs))
        else:
            client = SandboxClient(redis_url, **kwargs)
        self.client = Handle(client, self.run)

    @staticmethod
    async def _make_async(redis_url: str, kwargs: dict[str, Any]) -> AsyncSandboxClient:
        return AsyncSandboxClient(redis_url, **kwargs)  # built on the loop it will run on

    def run(self, awaitable: Any) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(awaitable, self._loop).result()

    def open(self, **kwargs: Any) -> Handle:
        return Handle(self.client.open(**kwargs), self.run)

    @contextlib.contextmanager
    def acquire_many(self, n: int, **kwargs: Any) -> Iterator[list[Handle]]:
        cm = self.client.target.acquire_many(n, **kwargs)
        enter, leave = (cm.__aenter__, cm.__aexit__) if self._loop else (cm.__enter__, cm.__exit__)
        group = self._call(enter)
        try:
            yield [Handle(sb, self.run) for sb in group]
        except BaseException as exc:
            if not self._call(leave, type(exc), exc, exc.__traceback__):
                raise
        else:
            self._call(leave, None, None, None)

    def drain(self, items: Any) -> list[Any]:
        """Every item of a sync iterator or (on the client's loop) an async one."""
        if hasattr(items, "__aiter__"):

            async def collect() -> list[Any]:
                return [item async for item in items]

            return list(self.run(collect()))
        return list(items)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        out = fn(*args)
        return self.run(out) if inspect.isawaitable(out) else out

    def close(self) -> None:
        if self._loop is None:
            self.client.close()
            return
        self.client.aclose()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@pytest.fixture(params=["sync", "async"])
def make_trainer(request: pytest.FixtureRequest, stack: Settings) -> Iterator[Any]:
    made: list[Trainer] = []

    def make(**kwargs: Any) -> Trainer:
        made.append(Trainer(request.param, stack.redis_url, **kwargs))
        return made[-1]

    yield make
    for trainer in made:
        trainer.close()


@pytest.fixture
def trainer(make_trainer: Callable[..., Trainer]) -> Trainer:
    return make_trainer(owner="transports")


def _job(sessions: Any, name: str, **config: Any) -> str:
    with sessions.begin() as session:
        store.ensure_job(session, name, **config)
    return name


def _row(sessions: Any, sandbox_id: str) -> Sandbox:
    with sessions() as session:
        row = session.get(Sandbox, sandbox_id)
        assert row is not None
        return row


def _until(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_exec_caps_modes_edits_and_files(trainer: Trainer, sessions: Any) -> None:
    job = _job(sessions, "transports")
    sb = trainer.open(image=IMAGE, job=job, timeout=30)
    try:
        assert sb.write_file("/workspace/run.sh", "echo ran\n", mode=0o755) == 9
        assert sb.exec("/workspace/run.sh").stdout == "ran\n"  # the mode made it executable
        big = sb.exec("head -c 100000 /dev/zero | tr '\\0' x", max_output_bytes=1000)
        assert big.truncated and len(big.stdout) < 100000
        assert not sb.exec("echo small", max_output_bytes=1000).truncated
        sb.write_file("/workspace/x.py", b"print('hello')\n")
        sb.edit("/workspace/x.py", "hello", "world")
        assert sb.read_text("/workspace/x.py") == "print('world')\n"
        assert sb.read_file("/workspace/x.py") == b"print('world')\n"
        assert sb.exec("cd /workspace && export A=1").ok
        assert sb.exec("echo $A; pwd").stdout.split() == ["1", "/workspace"]  # one shell
        assert sb.exec("exit 3").exit_code == 3  # a task outcome, not an exception
    finally:
        sb.release()
    with pytest.raises(SandboxLost):
        sb.exec("true")  # a released lease is never used again
    _until(lambda: _row(sessions, sb.id).state == State.DELETED, "release never finished")


def test_runs_streams_and_named_sessions(trainer: Trainer, sessions: Any) -> None:
    job = _job(sessions, "runs")
    sb = trainer.open(image=IMAGE, job=job, timeout=30)
    try:
        r = sb.run(["cat"], input=b"\x00\xffdata", binary=True, env={"A": "1"})
        assert isinstance(r, RunResult) and r.ok and r.stdout_bytes == b"\x00\xffdata"
        shell = sb.run("cd /tmp && echo $A; pwd; exit 4", env={"A": "x"}, cwd="/workspace")
        assert (shell.exit_code, shell.stdout) == (4, "x\n/tmp\n")
        assert sb.run(["pwd"], cwd="/workspace").stdout == "/workspace\n"  # nothing persisted
        assert sb.run("sleep 100", timeout=1).timed_out
        assert sb.run("kill -TERM $$").exit_code == 143
        assert sb.run(["pwd"]).stdout_bytes is None
        with pytest.raises(ExecError) as refused:
            sb.run(["true"], env={"LD_PRELOAD": "x"})
        assert refused.value.error_code == "reserved_env"
        with pytest.raises(ExecUserError):
            sb.run(["true"], user="no-such-user")
        # The local backend's bubblewrap gives its root no CAP_SETUID: the switch is refused,
        # typed (test_runs.py proves the switch itself against a plain execd run as root).
        with pytest.raises(ExecUserError) as no_switch:
            sb.run(["id"], user="nobody")
        assert no_switch.value.error_code == "cannot_switch_user"
        items = trainer.drain(sb.run_stream("echo one; echo two >&2; exit 3"))
        chunks, result = items[:-1], items[-1]
        assert all(isinstance(c, RunChunk) for c in chunks)
        assert "".join(c.text for c in chunks if c.stream == "stdout") == "one\n"
        assert "".join(c.text for c in chunks if c.stream == "stderr") == "two\n"
        assert isinstance(result, RunResult) and result.exit_code == 3
        assert sb.open_session("side")["name"] == "side"
        sb.exec("cd /tmp", session="side")
        assert sb.exec("pwd", session="side").stdout == "/tmp\n"
        assert sb.exec("pwd").stdout != "/tmp\n"  # the default session is its own
        sb.close_session("side")
        with pytest.raises(ExecSessionNotFound):
            sb.exec("pwd", session="side")
    finally:
        sb.release()


def test_heartbeats_at_a_third_of_a_short_lease(trainer: Trainer, sessions: Any) -> None:
    """A lease of 6 s is renewed about every 2 s: the old fixed 60 s beat lost it."""
    job = _job(sessions, "short-lease", lease_s=6.0)
    sb = trainer.open(image=IMAGE, job=job, timeout=30)
    try:
        assert sb.lease.lease_expires_at is not None
        first = _row(sessions, sb.id).lease_expires_at
        assert first is not None
        _until(
            lambda: (_row(sessions, sb.id).lease_expires_at or first) > first,
            "the lease was never renewed",
            timeout=6.0,  # the lease's own length: later than this it has run out
        )
        assert trainer.client.heartbeats.held() == 1
    finally:
        sb.release()
    assert trainer.client.heartbeats.held() == 0


def test_group_is_one_publish_batch_and_released_together(
    make_trainer: Callable[..., Trainer], sessions: Any
) -> None:
    job = _job(sessions, "group", lease_s=60.0)
    trainer = make_trainer(owner="group-trainer", heartbeat_s=0.3)
    batches: list[tuple[str, int]] = []
    enqueuer = trainer.client.enqueuer
    send_many = enqueuer.send_many

    def counting(name: str, argsets: list[list[Any]], queue: str) -> None:
        batches.append((name, len(argsets)))
        send_many(name, argsets, queue)

    enqueuer.send_many = counting
    with trainer.acquire_many(3, image=IMAGE, job=job, timeout=30) as group:
        assert len({sb.id for sb in group}) == 3
        assert [b for b in batches if b[0] == Task.ACQUIRE] == [(Task.ACQUIRE, 3)]
        before = [_row(sessions, sb.id).lease_expires_at for sb in group]
        _until(
            lambda: all(
                (_row(sessions, sb.id).lease_expires_at or b) > b  # type: ignore[operator]
                for sb, b in zip(group, before, strict=True)
            ),
            "the group's leases were not renewed",
        )
        assert trainer.client.heartbeats.held() == 3  # one renewal loop serves the group
    assert trainer.client.heartbeats.held() == 0
    for sb in group:
        _until(lambda sb=sb: _row(sessions, sb.id).state == State.DELETED, "not released")


def test_warm_hit_from_either_transport(trainer: Trainer, sessions: Any) -> None:
    cpu_m, mem = 310, 310 << 20
    job = _job(
        sessions,
        f"warm-{trainer.flavour}",
        warm_pools=[{"image": IMAGE, "cpu_m": cpu_m, "memory_b": mem, "size": 1}],
    )
    key = pool_key(IMAGE, None, None, cpu_m, mem)
    trainer.client.send(Task.POOL_UPKEEP, [], "pool")
    r = redis_lib.Redis.from_url(trainer.client.redis_url)
    _until(lambda: WarmStore(r).size(job, key) >= 1, "pool never filled")
    # A request with env of its own is never served by a warm pod (started without it).
    pinned = trainer.open(
        image=IMAGE, cpu=f"{cpu_m}m", memory=mem, job=job, timeout=60, env={"TZ": "IST-5:30"}
    )
    try:
        assert not pinned.lease.warm
        assert pinned.exec("echo $TZ").stdout == "IST-5:30\n"
    finally:
        pinned.release()
    sb = trainer.open(image=IMAGE, cpu=f"{cpu_m}m", memory=mem, job=job, timeout=10)
    try:
        assert sb.lease.warm
        assert sb.exec("echo warm").stdout == "warm\n"
        _until(lambda: _row(sessions, sb.id).owner == "transports", "hand-out never recorded")
    finally:
        sb.release()
        with sessions.begin() as session:  # stop the pool; upkeep drains it
            store.ensure_job(session, job, warm_pools=[])
        trainer.client.send(Task.POOL_UPKEEP, [], "pool")
        r.close()


def test_failures_are_typed(trainer: Trainer, sessions: Any) -> None:
    with pytest.raises(UnknownJob):
        trainer.open(image=IMAGE, job="no-such-job", timeout=10)
    job = _job(sessions, f"capped-{trainer.flavour}", max_live=1)
    held = trainer.open(image=IMAGE, job=job, timeout=30)
    try:
        with pytest.raises(AcquireTimeout) as info:
            trainer.open(image=IMAGE, job=job, timeout=1.5)
        assert isinstance(info.value, InfrastructureError)
    finally:
        held.release()


def test_a_cancelled_async_wait_gives_up_its_mailbox(stack: Settings, sessions: Any) -> None:
    """Task cancellation is a give-up like a timeout: the cancel flag is set, so the
    sandbox the worker makes later is released by the worker, never stranded."""
    job = _job(sessions, "cancelled", max_live=1)
    r = redis_lib.Redis.from_url(stack.redis_url)

    async def main() -> None:
        async with AsyncSandboxClient(stack.redis_url, owner="canceller") as client:
            held = await client.open(image=IMAGE, job=job, timeout=30)
            before = set(r.scan_iter("sandman:cancel:*"))
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.open(image=IMAGE, job=job, timeout=60), 1.0)
            assert len(set(r.scan_iter("sandman:cancel:*")) - before) == 1
            await held.release()

    try:
        asyncio.run(main())
        _until(lambda: _live(sessions, job) == 0, "a sandbox of the cancelled acquire stayed")
    finally:
        r.close()


def _live(sessions: Any, job: str) -> int:
    with sessions() as session:
        rows = session.scalars(select(Sandbox).where(Sandbox.job == job)).all()
        return sum(row.state not in (State.DELETED, State.FAILED) for row in rows)


def test_async_sandboxes_each_have_a_pool_closed_on_release(stack: Settings, sessions: Any) -> None:
    """Each held sandbox's execd calls go through its own pool (a shared one scans every
    connection of every sandbox per request); release closes it."""
    job = _job(sessions, "pools")

    async def main() -> None:
        async with AsyncSandboxClient(stack.redis_url, owner="pools") as client:
            a = await client.open(image=IMAGE, job=job, timeout=60)
            b = await client.open(image=IMAGE, job=job, timeout=60)
            assert a.http is not b.http
            assert (await a.exec("echo a")).stdout == "a\n"
            assert (await b.exec("echo b")).stdout == "b\n"
            await a.release()
            assert a.http.is_closed and not b.http.is_closed
            assert not await a.healthy()
            assert (await b.exec("echo b")).stdout == "b\n"
            await b.release()
            assert b.http.is_closed

    asyncio.run(main())
    _until(lambda: _live(sessions, job) == 0, "a released sandbox stayed")
