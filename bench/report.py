"""Performance report: runs the baseline benchmarks and writes Markdown, PNG plots and JSON.

Phases (each writes ``bench/out/<phase>.json``; ``report`` assembles whatever exists):

  replay   the simulator vs the real broker (local backend, warm pools) on a small trace
  execd    execd vs a raw bash pipe vs SWE-ReX (bench/execd_bench.py, imported)
  broker   warm hit vs cold acquire (bench/broker_bench.py --quick, same run's baselines)
  report   bench/out/report.md + *.png + report.json, also from scale.json / burst.json
           written by bench/scale.py and bench/burst.py

    .venv/bin/python bench/report.py [--phases replay,execd,broker,report]

Local-stack phases use their own state dir (bench/out/state-local) and ports, so they never
touch a `sandman up` running on the default state dir.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out"
sys.path.insert(0, str(REPO))


def local_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        SANDMAN_STATE_DIR=str(OUT / "state-local"),
        SANDMAN_EMBEDDED_PG_PORT="25432",
        SANDMAN_EMBEDDED_REDIS_PORT="26379",
        SANDMAN_BACKEND="local",
        SANDMAN_DATABASE_URL="",
        SANDMAN_REDIS_URL="",
        SANDMAN_INSTALLATION_ID="sandman-bench-local",
    )
    return env


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p90": pct(values, 90),
        "p99": pct(values, 99),
        "max": max(values) if values else math.nan,
    }


def save(name: str, doc: dict[str, Any]) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {path}", flush=True)
    return path


def load(name: str) -> dict[str, Any] | None:
    path = OUT / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


# -- replay: simulator vs the real broker ---------------------------------------------------


def phase_replay(args: argparse.Namespace) -> None:
    os.environ.update(local_env())
    from broker.client import SandboxClient
    from broker.db import make_engine, make_session_factory
    from broker.localservices import stop_postgres, stop_redis
    from broker.replay import Policy, write_trace
    from broker.replay.validate import drive, synthetic_trace
    from broker.settings import Settings
    from broker.stack import Stack

    settings = Settings.from_env()
    events = synthetic_trace(n=args.replay_n, span_s=args.replay_span)
    with (OUT / "replay-trace.jsonl").open("w") as fh:
        write_trace(events, fh)
    images = sorted({e.image for e in events})
    policy = Policy(warm={images[0]: 2, images[1]: 1}, idle_timeout_s=args.replay_idle)
    stack = Stack(settings)
    print("replay: starting a local stack ...", flush=True)
    stack.start(web=False, echo=False)
    engine = make_engine(stack.database_url)
    client = SandboxClient(stack.redis_url, owner="replay-bench", heartbeat_s=3600)
    try:
        job = f"replay-{int(time.time())}"
        doc = drive(
            client,
            make_session_factory(engine),
            events,
            job=job,
            policy=policy,
            speed=args.replay_speed,
        )
        doc["trace"] = str(OUT / "replay-trace.jsonl")
        m, p = doc["measured"], doc["predicted"]
        print(
            f"replay: measured hit {m['hit_rate']:.3f} creates {m['creates']}  |  predicted "
            f"hit {p['hit_rate']:.3f} creates {p['creates']}  (create_s "
            f"{doc['policy']['create_s']:.2f}s, errors {len(m['errors'])})",
            flush=True,
        )
        save("replay", doc)
        time.sleep(3)
    finally:
        client.close()
        engine.dispose()
        stack.stop()
        stop_postgres(settings)
        stop_redis(settings)


# -- execd vs raw pipe vs SWE-ReX --------------------------------------------------------------


def phase_execd(args: argparse.Namespace) -> None:
    import shutil
    import tempfile

    spec = importlib.util.spec_from_file_location("execd_bench", REPO / "bench" / "execd_bench.py")
    assert spec and spec.loader
    eb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eb)
    tmp = Path(tempfile.mkdtemp(prefix="report-execd-"))
    d = eb.Execd(sys.executable, tmp)
    try:
        ex = eb.bench_execd(d, args.execd_n)
        raw = eb.bench_raw_pipe(args.execd_n)
        sw, why = eb.bench_swerex(args.swerex_n)
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {
        "n": args.execd_n,
        "load": os.getloadavg()[0],
        "execd_s": ex,
        "raw_pipe_s": raw,
        "swerex_s": sw or [],
        "swerex_note": why,
        "execd": summary(ex),
        "raw_pipe": summary(raw),
        "swerex": summary(sw or []),
    }
    print(
        f"execd p50 {doc['execd']['p50'] * 1e3:.3f} ms, raw pipe {doc['raw_pipe']['p50'] * 1e3:.3f}"
        f" ms, swerex {doc['swerex']['p50'] * 1e3:.3f} ms ({why or 'ok'})",
        flush=True,
    )
    save("execd", doc)


# -- warm vs cold via broker_bench ------------------------------------------------------------

_LINE = re.compile(
    r"^(?P<name>.+?)\s+n=(?P<n>\d+)\s+p50=\s*(?P<p50>[\d.]+) ms p99=\s*(?P<p99>[\d.]+) ms"
)


def phase_broker(args: argparse.Namespace) -> None:
    cmd = [
        sys.executable,
        str(REPO / "bench" / "broker_bench.py"),
        "--quick",
        "--phases",
        "warm,cold",
    ]
    started = time.monotonic()
    proc = subprocess.run(
        cmd, env=local_env(), capture_output=True, text=True, timeout=1800, check=False, cwd=REPO
    )
    print(proc.stdout[-3000:], proc.stderr[-1500:] if proc.returncode else "", flush=True)
    rows = {}
    for line in proc.stdout.splitlines():
        m = _LINE.match(line)
        if m:
            rows[m["name"].strip()] = {
                "n": int(m["n"]),
                "p50_s": float(m["p50"]) / 1e3,
                "p99_s": float(m["p99"]) / 1e3,
                "line": line.strip(),
            }
    save(
        "broker",
        {
            "returncode": proc.returncode,
            "rows": rows,
            "stdout": proc.stdout,
            "wall_s": time.monotonic() - started,
        },
    )
    from broker.localservices import stop_postgres, stop_redis
    from broker.settings import Settings

    settings = Settings.from_env(local_env())
    stop_postgres(settings)
    stop_redis(settings)


# -- the report --------------------------------------------------------------------------------


def phase_report(args: argparse.Namespace) -> None:
    from bench_report_render import render  # type: ignore[import-not-found]

    render(OUT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phases", default="replay,execd,broker,report")
    parser.add_argument("--replay-n", type=int, default=60)
    parser.add_argument("--replay-span", type=float, default=120.0)
    parser.add_argument("--replay-speed", type=float, default=1.0)
    parser.add_argument("--replay-idle", type=float, default=20.0)
    parser.add_argument("--execd-n", type=int, default=1000)
    parser.add_argument("--swerex-n", type=int, default=100)
    args = parser.parse_args()
    for phase in args.phases.split(","):
        print(f"== {phase}", flush=True)
        globals()[f"phase_{phase}"](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
