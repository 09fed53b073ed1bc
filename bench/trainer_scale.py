"""One trainer process, the async client, N live local sandboxes, M concurrent exec streams.

    .venv/bin/python bench/trainer_scale.py                                   # 500 / 200
    .venv/bin/python bench/trainer_scale.py --sandboxes 50 --streams 20       # a smoke run
    .venv/bin/python bench/trainer_scale.py --skip-trainer --baseline-ref REV \
        --baseline-launch compiled                       # part 1 only: REV's execd vs this

Two parts, in one run:

1. **execd idle memory, old launch vs new** (no broker): ``--mem-n`` daemons of the
   execd at ``--baseline-ref`` (by default the last commit before the idle-memory work)
   started as the local backend used to (``python3 -m execd``; with
   ``--baseline-launch compiled``, ``python3 -S -m execd`` on a byte-compiled copy), and
   as many of this tree's execd started as the local backend does now
   (``EXECD_LAUNCH`` on a byte-compiled copy),
   all alive at once within each set: median RSS, PSS and USS (``smaps_rollup``) fresh,
   after three execs each, and after one one-shot run more (runs are imported on first
   use), and the ratio new/old.
2. **The trainer at scale**: an own stack (embedded PostgreSQL and Redis, the Celery
   workers, pacing relaxed to 1,000 creates/s so the acquire is not what is measured),
   ``--sandboxes`` acquired by one ``AsyncSandboxClient`` (``--acquire-concurrency`` at
   a time), then ``--streams`` coroutines each running ``--execs`` short commands
   back to back, stream ``s`` on sandboxes ``s, s+M, s+2M, ...`` in turn so every
   sandbox serves. Twice over the same live sandboxes: first ``--baseline-execs`` per
   stream through one ``httpx.AsyncClient`` shared by all sandboxes (the client before
   it kept a pool per sandbox), then ``--execs`` per stream through ``sb.exec``. For
   each: exec p50/p90/p99, execs/s, errors, the trainer's CPU seconds per exec
   (``getrusage`` of this process over the phase) and the ratios. Also the idle memory
   of the N live execds (found by ancestry from this run's bubblewrap processes)
   before and after the streams, and the machine's MemAvailable before, held, after.

Everything is released at the end (and on a crash: atexit stops the stack); the run
checks that no execd of its own is left. Writes bench/out/trainer_scale.json.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import cProfile
import http.client
import json
import os
import pstats
import resource
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, bench_env, free_port, save, stop_services, summary
from bench.meter import descendants

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


def is_execd(cmd: list[bytes]) -> bool:
    """Whether a command line (split at NULs) is an execd: ``python3 [-S] -m execd ...``
    or ``python3 -S -c "from execd.__main__ import ..."`` (not the bwrap around it)."""
    if cmd[0].endswith(b"bwrap"):
        return False
    return (b"-m" in cmd and b"execd" in cmd) or any(b"execd.__main__" in a for a in cmd)


def our_execds(mark_root: Path) -> list[int]:
    """The execd of every sandbox marked under ``mark_root`` (this run's state dir: other
    runs' sandboxes on the same machine are not counted), found below its bubblewrap."""
    from broker.backends import localprocs

    found = set()
    for sandbox in localprocs.scan(mark_root):
        for pid in descendants(sandbox.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if is_execd(cmd):
                found.add(pid)
    return sorted(found)


# -- part 1: execd idle memory, old launch vs new -----------------------------------------


class Daemon:
    """One execd on a loopback port, started as ``python3 *launch`` from ``pythonpath``."""

    def __init__(self, pythonpath: Path, launch: list[str], workdir: Path) -> None:
        self.token = secrets.token_hex(16)
        # A socket bound here and inherited (as the local backend does): a port picked
        # free and bound later by the daemon could be taken by another one meanwhile.
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        env = dict(os.environ, SANDMAN_EXECD_TOKEN=self.token, PYTHONPATH=str(pythonpath))
        options = ["--workdir", str(workdir), "--log-level", "WARNING"]
        fd = listener.fileno()
        self.proc = subprocess.Popen(
            [PYTHON, *launch, "--listen-fd", str(fd), *options],
            cwd=workdir,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(fd,),
        )
        listener.close()

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


def daemon_set(n: int, pythonpath: Path, launch: list[str], workdir: Path) -> dict[str, Any]:
    daemons = [Daemon(pythonpath, launch, workdir) for _ in range(n)]
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
        for d in daemons:
            assert d.call("POST", "/v1/run", {"argv": ["true"]}) == 200
        time.sleep(0.5)
        ran = mem_summary(pids)
    finally:
        for d in daemons:
            d.proc.terminate()
        for d in daemons:
            d.proc.wait(timeout=30)
    return {"fresh": fresh, "after_execs": used, "after_run": ran}


def memory_part(n: int, ref: str, launch: str) -> dict[str, Any]:
    """``launch``: how the baseline starts, "module" (``python3 -m execd`` from source, the
    local backend before the idle-memory work) or "compiled" (as this tree's)."""
    from broker.backends import localpyc
    from broker.backends.base import EXECD_LAUNCH

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
        if launch == "compiled":
            # Its own key (its sources differ): compiled once, like this tree's.
            base_copy = localpyc.compiled_copy(work / "pods", [PYTHON], base / "execd")
            if base_copy is None:
                raise SystemExit("could not compile the baseline's bytecode")
            old = daemon_set(n, base_copy.parent, ["-S", "-m", "execd"], work)
        else:
            old = daemon_set(n, base, ["-m", "execd"], work)
        # Run where it lies (the sandbox sees it at /sandman/execd; only tracebacks differ).
        new = daemon_set(n, copy.parent, list(EXECD_LAUNCH), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = {
        f"{k}_{when}": new[when][f"{k}_median_mib"] / old[when][f"{k}_median_mib"]
        for k in ("rss", "pss", "uss")
        for when in ("fresh", "after_execs", "after_run")
    }
    return {
        "baseline_ref": ref,
        "baseline_launch": launch,
        "n": n,
        "old": old,
        "new": new,
        "ratio_new_over_old": ratio,
    }


# -- part 2: the trainer at scale ----------------------------------------------------------


async def trainer_part(args: argparse.Namespace, redis_url: str, marker: Path) -> dict[str, Any]:
    import httpx

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
            if held and args.baseline_execs:
                async with httpx.AsyncClient(**client.http_options()) as shared:
                    out["shared_pool"] = await streams(
                        args, held, via_shared_pool(shared), args.baseline_execs
                    )
                print(f"shared pool: {out['shared_pool']['execs_per_s']:.0f} execs/s", flush=True)
            if held:
                out["own_pools"] = await streams(args, held, via_own_pool, args.execs)
                for k in ("execs_per_s", "trainer_cpu_ms_per_exec"):
                    if "shared_pool" in out:
                        out[f"{k}_ratio_own_over_shared"] = (
                            out["own_pools"][k] / out["shared_pool"][k]
                        )
            await asyncio.sleep(2.0)
            out["execd_idle_after"] = mem_summary(our_execds(marker))
        finally:
            await asyncio.gather(*(sb.release() for sb in held), return_exceptions=True)
    out["acquire_errors"] = errors
    return out


# One exec: (sandbox, k) -> (exit code, stdout).
ExecOne = Callable[[Any, int], Awaitable[tuple[int, str]]]


async def via_own_pool(sb: Any, k: int) -> tuple[int, str]:
    """The client as it is: ``sb.exec`` (the sandbox's own connection pool)."""
    r = await sb.exec(f"echo {k}", timeout=60)
    return r.exit_code, r.stdout


def via_shared_pool(http: Any) -> ExecOne:
    """The baseline: the same call through one ``httpx.AsyncClient`` shared by every
    sandbox, as the async client did before it kept a pool per sandbox."""
    from broker.wire.execd import session_exec_call

    async def one(sb: Any, k: int) -> tuple[int, str]:
        doc = await sb._execd.send_async(http, session_exec_call(f"echo {k}", timeout=60))
        return int(doc["exit_code"]), str(doc["stdout"])

    return one


async def streams(
    args: argparse.Namespace, held: list[Any], exec_one: ExecOne, execs: int
) -> dict[str, Any]:
    """``args.streams`` coroutines, ``execs`` calls each, stream s on sandboxes s, s+M, ..."""
    from broker.errors import SandmanError

    lat: list[float] = []
    errors: dict[str, int] = {}
    n = len(held)

    async def stream(s: int) -> None:
        for k in range(execs):
            sb = held[(s + k * args.streams) % n]
            t0 = time.perf_counter()
            try:
                code, out = await exec_one(sb, k)
            except SandmanError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                continue
            lat.append(time.perf_counter() - t0)
            if code != 0 or out != f"{k}\n":
                errors["bad_output"] = errors.get("bad_output", 0) + 1

    for sb in held[: args.streams]:  # warm: a connection each before the clock starts
        await exec_one(sb, 0)
    prof = cProfile.Profile() if args.profile else None
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    if prof is not None:
        prof.enable()
    await asyncio.gather(*(stream(s) for s in range(args.streams)))
    if prof is not None:
        prof.disable()
    ru1, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - t0
    if prof is not None:  # where the trainer's CPU per exec goes (the figures above include
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)  # the profiler's overhead)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return {
        "exec": summary(lat),
        "execs": len(lat),
        "exec_wall_s": wall,
        "execs_per_s": len(lat) / wall,
        "trainer_cpu_s": cpu,
        "trainer_cpu_ms_per_exec": 1000 * cpu / max(1, len(lat)),
        "trainer_cpu_share_of_one_core": cpu / wall,
        "errors": errors,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sandboxes", type=int, default=500)
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--execs", type=int, default=25, help="execs per stream")
    p.add_argument(
        "--baseline-execs",
        type=int,
        default=5,
        help="execs per stream through one shared pool first (the old client; 0: skip)",
    )
    p.add_argument("--acquire-concurrency", type=int, default=64)
    p.add_argument("--mem-n", type=int, default=50, help="daemons per set in part 1")
    p.add_argument("--baseline-ref", default=BASELINE_REF)
    p.add_argument(
        "--baseline-launch",
        choices=("module", "compiled"),
        default="module",
        help="start the baseline as the local backend did before the idle-memory work "
        "(python3 -m execd from source) or after it (-S -m execd, byte-compiled copy)",
    )
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-trainer", action="store_true")
    p.add_argument("--profile", action="store_true", help="cProfile the exec phase")
    p.add_argument("--min-free-mib", type=int, default=4096, help="refuse to start below")
    args = p.parse_args()

    doc: dict[str, Any] = {"args": vars(args), "cpus": os.cpu_count()}
    if not args.skip_memory:
        doc["memory"] = memory_part(args.mem_n, args.baseline_ref, args.baseline_launch)
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
    from broker.backends.local import LocalBackend

    marker = LocalBackend.mark_root_of(state)
    try:
        out = asyncio.run(trainer_part(args, stack.redis_url, marker))
        deadline = time.monotonic() + 300
        while our_execds(marker) and time.monotonic() < deadline:
            time.sleep(1.0)  # releases are deleted by the workers
        out["execds_left_after_release"] = len(our_execds(marker))
        out["mem_available_after_mib"] = mem_available_mib()
    finally:
        root.dispose()
        pidfile = state / "redis" / "redis.pid"
        redis_pid = int(pidfile.read_text().strip()) if pidfile.exists() else 0
        cleanup()
        atexit.unregister(cleanup)
        # Redis saves its data on SIGTERM and refuses to exit if it cannot: the state
        # dir goes only once it is gone (it would otherwise run on, orphaned).
        deadline = time.monotonic() + 30
        while redis_pid and Path(f"/proc/{redis_pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(state, ignore_errors=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
