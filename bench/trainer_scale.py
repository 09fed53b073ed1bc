"""One trainer process, the async client, N live local sandboxes, M concurrent exec streams.

    flock /work/bench.lock .venv/bin/python bench/trainer_scale.py            # 500 / 200
    .venv/bin/python bench/trainer_scale.py --sandboxes 50 --streams 20       # a smoke run

Two parts, in one run:

1. **execd idle memory, old launch vs new** (no broker): ``--mem-n`` daemons of the
   execd at ``--baseline-ref`` (the last commit before the idle-memory work) started as
   the local backend used to (``python3 -m execd``), and as many of this tree's execd
   started as it does now (``python3 -S -m execd`` on a byte-compiled copy),
   all alive at once within each set: median RSS, PSS and USS (``smaps_rollup``) fresh
   and after three execs each, and the ratio new/old.
2. **The trainer at scale**: an own stack (embedded PostgreSQL and Redis, the Celery
   workers, pacing relaxed to 1,000 creates/s so the acquire is not what is measured),
   ``--sandboxes`` acquired by one ``AsyncSandboxClient`` (``--acquire-concurrency`` at
   a time), then ``--streams`` coroutines each running ``--execs`` short commands
   back to back, stream ``s`` on sandboxes ``s, s+M, s+2M, ...`` in turn so every
   sandbox serves. Exec p50/p90/p99, execs/s, the trainer's CPU seconds per exec
   (``getrusage`` of this process over the exec phase), the idle memory of the N live
   execds (found by ancestry from this run's bubblewrap processes) before and after
   the streams, and the machine's MemAvailable before, at peak and after release.

Everything is released at the end (and on a crash: atexit stops the stack); the run
checks that no execd of its own is left. Writes bench/out/trainer_scale.json.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import http.client
import json
import os
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, bench_env, free_port, save, stop_services, summary

IMAGE = "localhost/sandman-task-base:v1"  # in the local store (make local-images)
JOB = "trainer-scale"
BASELINE_REF = "efa8cfe"  # main before execd's idle-memory work
PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


# -- memory of processes ------------------------------------------------------------------


def mem_kib(pid: int) -> dict[str, int] | None:
    """RSS, PSS and USS (private clean + dirty) of ``pid`` in KiB, None if it is gone."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss", "Private_Clean", "Private_Dirty"):
                    out[key] = int(rest.split()[0])
    except OSError:
        return None
    return {
        "rss": out["Rss"],
        "pss": out["Pss"],
        "uss": out["Private_Clean"] + out["Private_Dirty"],
    }


def mem_summary(pids: list[int]) -> dict[str, Any]:
    """Median and total of RSS/PSS/USS over ``pids`` in MiB."""
    got = [m for m in map(mem_kib, pids) if m is not None]
    out: dict[str, Any] = {"n": len(got)}
    for k in ("rss", "pss", "uss"):
        vals = [m[k] / 1024 for m in got]
        out[f"{k}_median_mib"] = statistics.median(vals) if vals else float("nan")
        out[f"{k}_total_mib"] = sum(vals)
    return out


def mem_available_mib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, cmdline) of every process visible here."""
    table: dict[int, tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        table[int(name)] = (ppid, cmd)
    return table


def our_execds(marker: str) -> list[int]:
    """execd processes below a bubblewrap whose command line names ``marker`` (this run's
    state dir): other runs' sandboxes on the same machine are not counted."""
    table = process_table()
    roots = {p for p, (_, cmd) in table.items() if "bwrap" in cmd and marker in cmd}
    found = []
    for pid, (ppid, cmd) in table.items():
        if "-m execd" not in cmd or "bwrap" in cmd:
            continue
        p, seen = ppid, 0
        while p > 1 and seen < 8:
            if p in roots:
                found.append(pid)
                break
            p, seen = table.get(p, (0, ""))[0], seen + 1
    return found


# -- part 1: execd idle memory, old launch vs new -----------------------------------------


class Daemon:
    """One execd on a loopback port, started with ``flags`` from ``pythonpath``."""

    def __init__(self, pythonpath: Path, flags: list[str], workdir: Path) -> None:
        self.token = secrets.token_hex(16)
        self.port = free_port()
        env = dict(os.environ, SANDMAN_EXECD_TOKEN=self.token, PYTHONPATH=str(pythonpath))
        options = ["--workdir", str(workdir), "--log-level", "WARNING"]
        self.proc = subprocess.Popen(
            [PYTHON, *flags, "-m", "execd", "--listen", f"127.0.0.1:{self.port}", *options],
            cwd=workdir,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            headers = {"Authorization": f"Bearer {self.token}"}
            conn.request(method, path, json.dumps(body) if body else None, headers)
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                if self.call("GET", "/healthz") == 200:
                    return
            except OSError:
                time.sleep(0.05)
        raise SystemExit(f"execd on port {self.port} did not start")


def daemon_set(n: int, pythonpath: Path, flags: list[str], workdir: Path) -> dict[str, Any]:
    daemons = [Daemon(pythonpath, flags, workdir) for _ in range(n)]
    try:
        deadline = time.monotonic() + 120
        for d in daemons:
            d.wait_ready(deadline)
        time.sleep(1.0)  # the session's bash is up and idle
        pids = [d.proc.pid for d in daemons]
        fresh = mem_summary(pids)
        for d in daemons:
            for i in range(3):
                assert d.call("POST", "/v1/exec", {"command": f"echo {i}"}) == 200
        time.sleep(0.5)
        used = mem_summary(pids)
    finally:
        for d in daemons:
            d.proc.terminate()
        for d in daemons:
            d.proc.wait(timeout=30)
    return {"fresh": fresh, "after_execs": used}


def memory_part(n: int, ref: str) -> dict[str, Any]:
    from broker.backends import localpyc

    work = Path(tempfile.mkdtemp(prefix="sandman-trainer-mem-"))
    try:
        base = work / "baseline"
        base.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", ref, "execd"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        copy = localpyc.compiled_copy(work / "pods", [PYTHON], REPO / "execd")
        if copy is None:
            raise SystemExit("could not compile execd's bytecode")
        # Run where it lies (the sandbox sees it at /sandman/execd; only tracebacks differ).
        old = daemon_set(n, base, [], work)
        new = daemon_set(n, copy.parent, list(localpyc.EXECD_FLAGS), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = {
        f"{k}_{when}": new[when][f"{k}_median_mib"] / old[when][f"{k}_median_mib"]
        for k in ("rss", "pss", "uss")
        for when in ("fresh", "after_execs")
    }
    return {"baseline_ref": ref, "n": n, "old": old, "new": new, "ratio_new_over_old": ratio}


# -- part 2: the trainer at scale ----------------------------------------------------------


async def trainer_part(args: argparse.Namespace, redis_url: str, marker: str) -> dict[str, Any]:
    from broker.client.aio import AsyncSandbox, AsyncSandboxClient
    from broker.errors import SandmanError

    out: dict[str, Any] = {"mem_available_before_mib": mem_available_mib()}
    held: list[AsyncSandbox] = []
    errors: dict[str, int] = {}
    async with AsyncSandboxClient(redis_url, owner="trainer-scale") as client:
        gate = asyncio.Semaphore(args.acquire_concurrency)
        acquire_s: list[float] = []

        async def one() -> None:
            async with gate:
                t0 = time.monotonic()
                try:
                    sb = await client.open(
                        image=IMAGE, job=JOB, cpu="100m", memory="64Mi", timeout=900
                    )
                except SandmanError as exc:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    return
                acquire_s.append(time.monotonic() - t0)
                held.append(sb)

        t0 = time.monotonic()
        try:
            await asyncio.gather(*(one() for _ in range(args.sandboxes)))
            out["acquire_wall_s"] = time.monotonic() - t0
            out["acquire"] = summary(acquire_s)
            out["held"] = len(held)
            print(f"held {len(held)} in {out['acquire_wall_s']:.1f} s", flush=True)
            await asyncio.sleep(2.0)
            execds = our_execds(marker)
            out["execd_pids_found"] = len(execds)
            out["execd_idle_before"] = mem_summary(execds)
            out["mem_available_held_mib"] = mem_available_mib()
            out.update(await streams(args, held, errors))
            await asyncio.sleep(2.0)
            out["execd_idle_after"] = mem_summary(our_execds(marker))
        finally:
            await asyncio.gather(*(sb.release() for sb in held), return_exceptions=True)
    out["errors"] = errors
    return out


async def streams(
    args: argparse.Namespace, held: list[Any], errors: dict[str, int]
) -> dict[str, Any]:
    from broker.errors import SandmanError

    lat: list[float] = []
    n = len(held)

    async def stream(s: int) -> None:
        for k in range(args.execs):
            sb = held[(s + k * args.streams) % n]
            t0 = time.perf_counter()
            try:
                r = await sb.exec(f"echo {k}", timeout=60)
            except SandmanError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                continue
            lat.append(time.perf_counter() - t0)
            if r.exit_code != 0 or r.stdout != f"{k}\n":
                errors["bad_output"] = errors.get("bad_output", 0) + 1

    if not held:
        return {}
    for sb in held[: args.streams]:  # warm: each connection opened before the clock
        await sb.exec("true", timeout=60)
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    await asyncio.gather(*(stream(s) for s in range(args.streams)))
    ru1, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - t0
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return {
        "exec": summary(lat),
        "execs": len(lat),
        "exec_wall_s": wall,
        "execs_per_s": len(lat) / wall,
        "trainer_cpu_s": cpu,
        "trainer_cpu_ms_per_exec": 1000 * cpu / max(1, len(lat)),
        "trainer_cpu_share_of_one_core": cpu / wall,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sandboxes", type=int, default=500)
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--execs", type=int, default=25, help="execs per stream")
    p.add_argument("--acquire-concurrency", type=int, default=64)
    p.add_argument("--mem-n", type=int, default=50, help="daemons per set in part 1")
    p.add_argument("--baseline-ref", default=BASELINE_REF)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-trainer", action="store_true")
    p.add_argument("--min-free-mib", type=int, default=4096, help="refuse to start below")
    args = p.parse_args()

    doc: dict[str, Any] = {"args": vars(args), "cpus": os.cpu_count()}
    if not args.skip_memory:
        doc["memory"] = memory_part(args.mem_n, args.baseline_ref)
        print(json.dumps(doc["memory"]["ratio_new_over_old"], indent=1), flush=True)
    if not args.skip_trainer:
        # About 25 MiB per sandbox (bwrap, execd, bash, page cache of its root) and margin.
        need = args.sandboxes * 25 + args.min_free_mib
        if mem_available_mib() < need:
            raise SystemExit(f"{mem_available_mib():.0f} MiB available, {need} needed")
        doc["trainer"] = run_stack(args)
    print(json.dumps(doc, indent=1, default=str))
    save("trainer_scale", doc)
    return 0


def run_stack(args: argparse.Namespace) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="sandman-trainer-"))
    os.environ.update(
        bench_env(
            state,
            pg_port=free_port(),
            redis_port=free_port(),
            backend="local",
            installation=f"trainer-{secrets.token_hex(3)}",
            SANDMAN_CREATE_RATE="1000",
            SANDMAN_CREATE_BURST="1000",
            SANDMAN_GC_INTERVAL_S="3600",
            SANDMAN_LOG_LEVEL="WARNING",
        )
    )
    from broker.acquire.root import TOOL, Root
    from broker.errors import ServiceUnavailable
    from broker.ledger import store
    from broker.local.stack import Stack
    from broker.settings import Settings

    settings = Settings.from_env()
    stack = Stack(settings)

    def cleanup() -> None:
        stack.stop()
        stop_services(settings)

    atexit.register(cleanup)
    print(f"starting the stack in {state} ...", file=sys.stderr, flush=True)
    try:
        stack.start(web=False, echo=False)
    except ServiceUnavailable:
        stack.wait_ready(timeout=300)
    for name in [n for n in stack.procs if n == "beat"]:
        stack.procs.pop(name).kill()  # no beat: pool upkeep and GC stay out of the figures
    root = Root(settings, TOOL, database_url=stack.database_url, actor="trainer-scale")
    with root.sessions.begin() as s:
        store.ensure_job(s, JOB, lease_s=3600.0)
    marker = str(state.resolve())
    try:
        out = asyncio.run(trainer_part(args, stack.redis_url, marker))
        deadline = time.monotonic() + 300
        while our_execds(marker) and time.monotonic() < deadline:
            time.sleep(1.0)  # releases are deleted by the workers
        out["execds_left_after_release"] = len(our_execds(marker))
        out["mem_available_after_mib"] = mem_available_mib()
    finally:
        root.dispose()
        cleanup()
        atexit.unregister(cleanup)
        shutil.rmtree(state, ignore_errors=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
