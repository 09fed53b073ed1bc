"""What every benchmark needs, done one way: percentiles, pacing figures, threads, ports, output.

Each bench used to carry its own percentile (three definitions, so a p99 in one report
was not the p99 of another), its own free-port finder and its own JSON writer. They live
here so that figures from different benches are comparable and a fix lands everywhere.

Scripts in bench/ are run by path (``python bench/scale.py``), which puts bench/ and not
the repository root on ``sys.path``; each script therefore inserts the root first and
imports ``bench.common`` by its full name (never ``import common``: that would load a
second copy of the module under another name).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out"
T = TypeVar("T")


# -- statistics -------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (q in 0-100); NaN for no values.

    Nearest rank always returns a measured value (no interpolation), which is what a p99
    of latencies should be: the call that really took that long."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summary(values: list[float]) -> dict[str, float]:
    """n, p50, p90, p99 and max: the shape every bench's JSON uses for a latency series."""
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p90": pct(values, 90),
        "p99": pct(values, 99),
        "max": max(values) if values else math.nan,
    }


def ms(v: float) -> str:
    """A duration in seconds as a fixed-width millisecond figure for text tables."""
    return f"{v * 1000:8.2f} ms"


# -- pacing figures (creating_at stamps of the ledger) ----------------------------------------


def achieved_rate(stamps: list[float], burst: int) -> float:
    """Creates per second after the initial burst, over the span of the stamps."""
    ordered = sorted(stamps)
    span = ordered[-1] - ordered[0] if len(ordered) > 1 else 0.0
    return (len(ordered) - burst) / span if span > 0 else math.nan


def pacing_windows(stamps: list[float], rate: float, burst: int) -> tuple[int, float]:
    """(most creates in any 1-s window, worst excess over ``rate * t + burst`` in any window).

    The excess is checked over windows of up to ``4 * burst + 200`` creates from each start:
    a token bucket can only be exceeded within about one refill of the burst, so longer
    windows add time and no information."""
    s = sorted(stamps)
    if not s:
        return 0, math.nan
    worst, j = 0, 0
    for i in range(len(s)):
        while j < len(s) and s[j] - s[i] < 1.0:
            j += 1
        worst = max(worst, j - i)
    excess = max(
        (b - a + 1) - (rate * (s[b] - s[a]) + burst)
        for a in range(len(s))
        for b in range(a, min(len(s), a + 4 * burst + 200))
    )
    return worst, excess


def rate_series(stamps: list[float], t0: float, bucket: float = 5.0) -> list[tuple[float, float]]:
    """Events per second in ``bucket``-second buckets from ``t0``: a plot's rate line."""
    if not stamps:
        return []
    counts = [0] * (int((max(stamps) - t0) / bucket) + 1)
    for s in stamps:
        if s >= t0:
            counts[int((s - t0) / bucket)] += 1
    return [(i * bucket, c / bucket) for i, c in enumerate(counts)]


# -- concurrency ------------------------------------------------------------------------------


def run_threads(n_threads: int, per_thread: int, fn: Callable[[], T]) -> list[T]:
    """Call ``fn`` ``per_thread`` times in each of ``n_threads`` threads; every result."""
    out: list[T] = []
    lock = threading.Lock()

    def body() -> None:
        for _ in range(per_thread):
            value = fn()
            with lock:
                out.append(value)

    threads = [threading.Thread(target=body) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# -- machine and cluster ----------------------------------------------------------------------


def free_port() -> int:
    """A loopback port nothing listens on now (for a bench's own services)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kubeconfig_path() -> str:
    """``SANDMAN_TEST_KUBECONFIG``, or the local cluster's (up.sh is idempotent and prints it)."""
    path = os.environ.get("SANDMAN_TEST_KUBECONFIG") or ""
    if path:
        return path
    out = subprocess.run(
        [str(REPO / "deploy/localcluster/up.sh")], capture_output=True, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1]


# -- output -----------------------------------------------------------------------------------


def save(name: str, doc: dict[str, Any], indent: int = 1) -> Path:
    """Write ``bench/out/<name>.json`` (read back by bench/report.py) and say so."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(doc, indent=indent, default=str))
    print(f"wrote {path}", flush=True)
    return path


def load(name: str) -> dict[str, Any] | None:
    """``bench/out/<name>.json`` if a bench has written it."""
    path = OUT / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


# -- the broker's own services ----------------------------------------------------------------


def bench_env(
    state_dir: Path,
    *,
    pg_port: int,
    redis_port: int,
    backend: str,
    installation: str,
    **extra: str,
) -> dict[str, str]:
    """This process's environment for a bench stack of its own.

    Its own state dir and ports (so it never touches a ``sandman up`` on the default state
    dir), embedded services (the URLs emptied, so a developer's exported URL is not used)
    and its own installation id (so its GC never sees another run's pods)."""
    env = dict(os.environ)
    env.update(
        SANDMAN_STATE_DIR=str(state_dir),
        SANDMAN_EMBEDDED_PG_PORT=str(pg_port),
        SANDMAN_EMBEDDED_REDIS_PORT=str(redis_port),
        SANDMAN_DATABASE_URL="",
        SANDMAN_REDIS_URL="",
        SANDMAN_BACKEND=backend,
        SANDMAN_INSTALLATION_ID=installation,
        **extra,
    )
    return env


def stop_services(settings: Any) -> None:
    """Stop the embedded PostgreSQL and Redis a bench started for ``settings``."""
    from broker.local.services import stop_postgres, stop_redis

    stop_postgres(settings)
    stop_redis(settings)


def acquire_request(
    image: str, cpu: str, memory: str, job: str, owner: str, timeout: float
) -> dict[str, Any]:
    """An acquire request as the client would send it: for benches that enqueue a burst
    themselves and wait for the leases apart from the send."""
    from broker.wire.request import request_body

    return request_body(
        image=image,
        cpu=cpu,
        memory=memory,
        job=job,
        role="rollout",
        image_digest=None,
        base_commit=None,
        workdir="/",
        env=None,
        owner=owner,
        timeout=timeout,
    )
