"""Exec round trip (``echo hi``) through each harness adapter, the Sandman client, and each
harness's own local environment, measured in one run.

Run: ``SANDMAN_STATE_DIR=... .venv/bin/python bench/adapters.py [--n 1000]`` (needs the
``dev`` extra: inspect-ai, mini-swe-agent, swe-rex). Starts its own stack (embedded
PostgreSQL and Redis, real Celery workers, local bubblewrap sandboxes), acquires one
sandbox per adapter, and times, in rounds (shuffled each round) so drift hits every series alike:

* the adapter's call (Inspect ``exec``, mini-swe-agent ``execute``, SWE-ReX ``execute``
  and ``run_in_session``),
* the Sandman client call that adapter makes, on the same sandbox (the difference is the
  adapter's own overhead),
* the harness's own local environment (Inspect's ``local`` sandbox, mini-swe-agent's
  ``LocalEnvironment``, SWE-ReX's ``LocalRuntime``): no sandbox at all, a floor;
* then each adapter's own code alone, with the client call it makes answered in-process
  by a reply recorded from the sandbox (on a loaded machine the paired in-situ
  difference is mostly noise; this is the adapter's cost).

Prints p50, p99, the ratio to the client call and the adapter's p50 overhead. A
benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

from bench.common import ms, pct, save, summary  # noqa: E402
from broker.local.demo import DEMO_IMAGE  # noqa: E402

IMAGE = DEMO_IMAGE  # in the local store (make local-images)
Call = Callable[[], Awaitable[Any]]


def sync(fn: Callable[[], Any]) -> Call:
    async def call() -> Any:
        return fn()

    return call


async def measure(series: dict[str, Call], n: int) -> dict[str, list[float]]:
    """Each series n times, in rounds (a fresh order each round), after 20 warm-up calls."""
    for call in series.values():
        for _ in range(20):
            await call()
    times: dict[str, list[float]] = {name: [] for name in series}
    order = list(series.items())
    for _ in range(n):
        random.shuffle(order)  # no series always follows the same (noisy) neighbour
        for name, call in order:
            t0 = time.perf_counter()
            await call()
            times[name].append(time.perf_counter() - t0)
    return times


async def run(redis_url: str, job: str, n: int) -> dict[str, list[float]]:
    from inspect_ai.util._sandbox.local import LocalSandboxEnvironment
    from minisweagent.environments.local import LocalEnvironment
    from swerex.runtime.abstract import BashAction, Command, CreateBashSessionRequest
    from swerex.runtime.local import LocalRuntime

    from broker.client import AsyncSandboxClient
    from broker.integrations.inspectai import SandmanSandboxConfig, SandmanSandboxEnvironment
    from broker.integrations.minisweagent import SandmanEnvironment
    from broker.integrations.swerex import SandmanDeployment

    config = SandmanSandboxConfig(image=IMAGE, job=job, redis_url=redis_url)
    await SandmanSandboxEnvironment.task_init("bench", config)
    envs = await SandmanSandboxEnvironment.sample_init("bench", config, {})
    inspect_env = envs["default"]
    assert isinstance(inspect_env, SandmanSandboxEnvironment)
    inspect_local = (await LocalSandboxEnvironment.sample_init("bench", None, {}))["default"]
    mini = SandmanEnvironment(image=IMAGE, job=job, redis_url=redis_url)
    assert mini.sandbox is not None
    mini_sandbox = mini.sandbox
    mini_local = LocalEnvironment(cwd=tempfile.gettempdir())
    rex = SandmanDeployment(image=IMAGE, job=job, redis_url=redis_url)
    await rex.start()
    assert rex.sandbox is not None
    rex_sandbox = rex.sandbox
    await rex.runtime.create_session(CreateBashSessionRequest())
    rex_local = LocalRuntime()
    client = AsyncSandboxClient(redis_url)
    direct = await client.open(image=IMAGE, job=job)
    echo = ["echo", "hi"]
    try:
        series: dict[str, Call] = {
            "client run (async)": lambda: direct.run(echo),
            "client exec session (async)": lambda: direct.exec("echo hi"),
            "inspect: adapter exec": lambda: inspect_env.exec(echo),
            "inspect: client call": lambda: inspect_env.sandbox.run(
                echo, max_output_bytes=10 * 1024 * 1024
            ),
            "inspect: local sandbox": lambda: inspect_local.exec(echo),
            "mini: adapter execute": sync(lambda: mini.execute({"command": "echo hi"})),
            "mini: client call": sync(
                lambda: mini_sandbox.run(
                    "exec 2>&1\necho hi",
                    env={},
                    timeout=30,
                    max_output_bytes=mini.config.max_output_bytes,
                )
            ),
            "mini: LocalEnvironment": sync(lambda: mini_local.execute({"command": "echo hi"})),
            "swerex: adapter execute": lambda: rex.runtime.execute(Command(command=echo)),
            "swerex: client call": lambda: rex_sandbox.run(echo),
            "swerex: LocalRuntime execute": lambda: rex_local.execute(Command(command=echo)),
            "swerex: adapter run_in_session": lambda: rex.runtime.run_in_session(
                BashAction(command="echo hi")
            ),
        }
        times = await measure(series, n)
        # The adapters' own code alone: the client call they make answers at once with a
        # reply recorded from this sandbox (the network and execd taken out).
        canned = await direct.run(echo)
        merged = await direct.run("exec 2>&1\necho hi")

        async def answer(*_: Any, **__: Any) -> Any:
            return canned

        inspect_env.sandbox.run = answer  # type: ignore[method-assign]
        mini_sandbox.run = lambda *_, **__: merged  # type: ignore[method-assign]
        rex_sandbox.run = answer  # type: ignore[method-assign]
        code_only: dict[str, Call] = {
            "inspect: adapter code only": lambda: inspect_env.exec(echo),
            "mini: adapter code only": sync(lambda: mini.execute({"command": "echo hi"})),
            "swerex: adapter code only": lambda: rex.runtime.execute(Command(command=echo)),
        }
        times.update(await measure(code_only, 10 * n))
        return times
    finally:
        await direct.release()
        await client.aclose()
        await rex.stop()
        await rex_local.close()
        mini.cleanup()
        await SandmanSandboxEnvironment.sample_cleanup("bench", config, envs, False)
        await SandmanSandboxEnvironment.task_cleanup("bench", config, True)
        await LocalSandboxEnvironment.sample_cleanup(
            "bench", None, {"default": inspect_local}, False
        )


PAIRS = {  # adapter series -> the client call it makes, on the same sandbox
    "inspect: adapter exec": "inspect: client call",
    "mini: adapter execute": "mini: client call",
    "swerex: adapter execute": "swerex: client call",
}


def overhead(times: dict[str, list[float]], adapter: str) -> float:
    """The adapter's p50 cost in situ: the median of the paired differences (adapter call i
    minus the client call of the same round), robust to the drift a shared machine adds."""
    client = times[PAIRS[adapter]]
    return pct([a - c for a, c in zip(times[adapter], client, strict=True)], 50)


def report(times: dict[str, list[float]]) -> None:
    print(f"\n{'series':<38} {'p50':>11} {'p99':>11}   p50 vs client call")
    for name, values in times.items():
        if name.endswith("code only"):
            continue
        harness = name.split(":")[0]
        ref = next((c for a, c in PAIRS.items() if a.startswith(harness + ":")), None)
        extra = ""
        if ref is not None and name != ref:
            extra = f"   x{pct(values, 50) / pct(times[ref], 50):6.2f}"
        print(f"{name:<38} {ms(pct(values, 50))} {ms(pct(values, 99))}{extra}")
    print("\nadapter overhead, p50 of paired differences (adapter minus its client call):")
    for adapter in PAIRS:
        print(f"  {adapter:<36} {overhead(times, adapter) * 1e6:8.0f} us")
    print("\nadapter code alone (the client call answered in-process), p50:")
    for name, values in times.items():
        if name.endswith("code only"):
            print(f"  {name:<36} {pct(values, 50) * 1e6:8.1f} us")
    print(
        "\nrun_in_session checks the syntax first (`bash -n`, one more run) as SWE-ReX does."
        " SWE-ReX's own LocalRuntime run_in_session (a pexpect pty, about 0.1 s a call here)"
        " is left out; bench/execd_bench.py compares execd with swerex-remote."
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="round trips per series")
    args = parser.parse_args()

    from broker.ledger import store
    from broker.ledger.db import make_engine, make_session_factory
    from broker.local.stack import Stack, running_stack
    from broker.settings import Settings

    settings = Settings.from_env()
    if running_stack(settings):
        print("a `sandman up` is running on this state dir; stop it first", file=sys.stderr)
        return 2
    stack = Stack(settings)
    print("starting the stack ...", flush=True)
    stack.start(web=False, echo=False)
    try:
        job = f"bench-adapters-{secrets.token_hex(2)}"
        with make_session_factory(make_engine(stack.database_url)).begin() as session:
            store.ensure_job(session, job)
        times = asyncio.run(run(stack.redis_url, job, args.n))
    finally:
        stack.stop()
    report(times)
    doc: dict[str, Any] = {name: summary(values) for name, values in times.items()}
    doc["overhead_p50_s"] = {adapter: overhead(times, adapter) for adapter in PAIRS}
    save("adapters", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
