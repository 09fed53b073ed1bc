"""One tool step through the OpenEnv adapter versus the Sandman client directly.

Needs a running stack and a job (``sandman up --no-web`` and ``sandman job create
rl-bench`` on the same ``SANDMAN_STATE_DIR``) and ``pip install 'sandman-broker[openenv]'``.
One sandbox is acquired through ``SandmanSessionFactory``; then ``--n`` rounds each time
one ``echo hi`` through ``SandmanSession.call_tool("bash", ...)`` and one through
``Sandbox.exec`` on the same sandbox, alternating so that load on the machine hits both
alike. Prints p50/p99 of each, their ratio and the adapter's own p50 overhead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import pct, save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="rl-bench")
    ap.add_argument("--image", default="localhost/sandman-task-base:v1")  # local store
    ap.add_argument("--n", type=int, default=1000)
    args = ap.parse_args()

    from broker.client import SandboxClient
    from broker.integrations.openenv import SandboxTask, SandmanSessionFactory
    from broker.settings import Settings

    client = SandboxClient.from_settings(Settings.from_env())
    factory = SandmanSessionFactory(client, image=args.image, job=args.job, timeout=120)
    direct: list[float] = []
    adapter: list[float] = []
    try:
        with factory.create(SandboxTask(prompt="bench", check="true")) as session:
            sb = session.sandbox
            for _ in range(50):  # warm the connection and the shell
                sb.exec("echo hi")
                session.call_tool("bash", {"command": "echo hi"})
            for _ in range(args.n):
                t0 = time.perf_counter()
                session.call_tool("bash", {"command": "echo hi"})
                t1 = time.perf_counter()
                sb.exec("echo hi")
                t2 = time.perf_counter()
                adapter.append(t1 - t0)
                direct.append(t2 - t1)
    finally:
        client.close()

    def line(name: str, xs: list[float]) -> str:
        return f"  {name:<28} p50 {pct(xs, 50) * 1e3:7.3f} ms   p99 {pct(xs, 99) * 1e3:7.3f} ms"

    print(f"echo hi, {args.n} rounds on one sandbox")
    print(line("client Sandbox.exec", direct))
    print(line("OpenEnv call_tool('bash')", adapter))
    ratio50, ratio99 = pct(adapter, 50) / pct(direct, 50), pct(adapter, 99) / pct(direct, 99)
    overhead = (pct(adapter, 50) - pct(direct, 50)) * 1e3
    print(f"  ratio adapter / client     p50 {ratio50:6.2f}x   p99 {ratio99:6.2f}x")
    print(f"  adapter overhead at p50    {overhead:+.3f} ms")
    save(
        "rl_adapter",
        {
            "n": args.n,
            "direct_s": {"p50": pct(direct, 50), "p99": pct(direct, 99)},
            "adapter_s": {"p50": pct(adapter, 50), "p99": pct(adapter, 99)},
        },
    )


if __name__ == "__main__":
    main()
