"""The demo's self-checking rollouts, many times, with the CPU saturated (#20 item 13).

Under load the demo once failed a few steps with ``edit: no_match`` on a file the
rollout had itself just written: two rollouts had been handed one warm sandbox (pool
upkeep re-published a member a trainer had claimed a moment before). Each rollout
checks every write, edit and command against its own model of the file and looks for
any other rollout's marker in its workspace, so any shared or reset sandbox fails a step.
Busy loops keep both cores saturated while warm claims, hand-outs and upkeep interleave.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import func, select

from broker.client.sync import SandboxClient
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.ledger.states import State
from broker.local.demo import CPU, DEMO_IMAGE, MEMORY, Tally, rollout
from broker.names import Queue, Task
from broker.pools.store import WarmStore, pool_key
from broker.settings import Settings
from broker.wire.validation import parse_cpu, parse_memory
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
JOB = "rollouts-under-load"
WARM, ROUNDS, ROLLOUTS, CONCURRENCY, COMMANDS = 6, 3, 24, 8, 9
LIVE = (State.REQUESTED, State.CREATING, State.READY, State.RELEASING, State.ABANDONED)


@pytest.fixture
def busy_cpus() -> Iterator[None]:
    """One busy loop per core, ended by PID when the test ends."""
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        yield
    finally:
        for loop in loops:
            with contextlib.suppress(ProcessLookupError):
                os.kill(loop.pid, signal.SIGKILL)
            loop.wait()


def _live(sessions: Any) -> int:
    with sessions() as session:
        query = select(func.count()).select_from(Sandbox)
        return session.scalar(query.where(Sandbox.job == JOB, Sandbox.state.in_(LIVE))) or 0


def test_rollouts_never_see_each_others_state_under_cpu_load(
    stack: Settings, sessions: Any, busy_cpus: None
) -> None:
    pool = {
        "image": DEMO_IMAGE, "cpu_m": parse_cpu(CPU), "memory_b": parse_memory(MEMORY),
        "size": WARM, "idle_timeout_s": 300,
    }  # fmt: skip
    with sessions.begin() as session:
        store.ensure_job(session, JOB, warm_pools=[pool], lease_s=120.0, max_live=64)
    client = SandboxClient(stack.redis_url, owner="under-load")
    warm = WarmStore(client.redis)
    key = pool_key(DEMO_IMAGE, None, None, pool["cpu_m"], pool["memory_b"])
    try:
        client.send(Task.POOL_UPKEEP, [], Queue.POOL)
        wait_until(lambda: warm.size(JOB, key) >= WARM, timeout=180, what="a full warm pool")
        tally = Tally()
        for _ in range(ROUNDS):
            with ThreadPoolExecutor(CONCURRENCY) as threads:
                done = [
                    threads.submit(rollout, client, COMMANDS, tally, JOB) for _ in range(ROLLOUTS)
                ]
                for future in done:
                    future.result()
        assert tally.errors == [] and tally.failed_steps == 0
        assert len(tally.acquire_s) == ROUNDS * ROLLOUTS, f"masked: {tally.masked}"
        assert tally.warm > 0, "the warm path (where claims meet upkeep) was never taken"
    finally:
        with sessions.begin() as session:
            store.ensure_job(session, JOB, warm_pools=[])
        client.send(Task.POOL_UPKEEP, [], Queue.POOL)
        client.close()
    wait_until(lambda: _live(sessions) == 0, timeout=180, what="every sandbox released")
