"""fork(8) of a SWE-style sandbox on the local backend with a warm pool, against the two
ways a trainer gets 8 such sandboxes without snapshots (issue #17).

    SANDMAN_STATE_DIR=/some/own/dir .venv/bin/python bench/fork.py [--trials 5] [--mb 50]
        [--stream]   # restores stream their blobs over HTTP (SANDMAN_SNAPSHOT_LOCAL_COPY=0)
        [--backend kubernetes]   # pods on the local cluster's real node (its kubeconfig:
                                 # SANDMAN_TEST_KUBECONFIG), in a namespace of its own

The source: a warm sandbox of the SWE task image (its git repository at /repo), where the
"agent" generates ``--mb`` MB of files into the repository (seeded, incompressible) and
then applies a 1 MB diff (100 text files of 10 KB), and leaves cwd and an export behind.
Per trial, each from the call to 8 ready sandboxes holding that state:

  fork(8)             sb.fork(8, paths=["/repo"]): snapshot + 8 warm acquires restored
  cold + commands     8 cold acquires (a job without a pool), each re-running the commands
  warm + diff         8 warm acquires, each re-applying the 1 MB diff by hand (write_file):
                      NOT the generated files, so it is the cheaper, not the equal, state

Also: the snapshot alone and its throughput (MB listed / its time: from the second trial
on its blobs are stored already, so that is listing and hashing), restore throughput
(MB written into all 8 forks / the fork's time after its snapshot, acquires included),
store bytes per fork after deduplication (the store's growth per trial / 8; trials
regenerate the same seeded content, so from the second trial on a snapshot adds only its
manifest), and the ratio of fork(8) to each baseline measured in the same run.

The floor of a restore, measured in the same trial on the same bytes: 8 processes, each
reading every blob of the snapshot from the store and writing it to a file of its own,
``copy+sha256`` hashing as it goes (the data work a verified restore cannot skip) and
``copy`` without the hash (``shutil.copyfile``: in-kernel). A restore that "costs little
more than the bytes it writes" is one whose fork time after the snapshot is close to it.
Runs its own stack in SANDMAN_STATE_DIR (embedded services, real Celery workers,
bubblewrap sandboxes). One run; a benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import kubeconfig_path, save, stop_services, summary

IMAGE = "localhost/sandman-swe-task:v1"
CPU_M, MEM = 250, 512 << 20
KUBE_CPU_M = 100  # the cluster's real node has 2 CPUs to schedule 9 warm pods + 8 more
REAL_NODE = {"sandman.io/node-kind": "real"}
N = 8
DIFF_FILES, DIFF_BYTES = 100, 10 * 1024


def generate_command(mb: int) -> str:
    """The agent's heavy command: ``mb`` MB of seeded random files in the repository."""
    return (
        "python3 - <<'EOF'\n"
        "import os, random\n"
        "r = random.Random(17)\n"
        "os.makedirs('/repo/generated', exist_ok=True)\n"
        f"for i in range({mb * 4}):\n"
        "    with open('/repo/generated/blob%04d.bin' % i, 'wb') as f:\n"
        "        f.write(r.randbytes(256 * 1024))\n"
        "EOF"
    )


def diff_files() -> dict[str, bytes]:
    """The agent's 1 MB diff: 100 source files of 10 KB each."""
    return {
        f"/repo/agent/mod{i:03d}.py": (f"# module {i}\n" + "x = 1\n" * DIFF_BYTES)[
            :DIFF_BYTES
        ].encode()
        for i in range(DIFF_FILES)
    }


def copy_blobs(blobs: list[str], into: str, verify: bool) -> float:
    """One fork's worth of data work on its own: every blob copied into a fresh directory
    (hashed on the way when ``verify``); the seconds it took."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=into) as out:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        for i, blob in enumerate(blobs):
            dest = os.path.join(out, str(i))
            if not verify:
                shutil.copyfile(blob, dest)
                continue
            digest = hashlib.sha256()
            with open(blob, "rb", buffering=0) as src, open(dest, "wb", buffering=0) as dst:
                while n := src.readinto(buf):
                    digest.update(view[:n])
                    dst.write(view[:n])
            assert digest.hexdigest() == os.path.basename(blob)
        return time.perf_counter() - t0


def copy_floor(pool: ProcessPoolExecutor, blobs: list[str], into: Path, verify: bool) -> float:
    """N forks' data work in N processes at once: the wall time of all of them."""
    t0 = time.perf_counter()
    list(pool.map(copy_blobs, [blobs] * N, [str(into)] * N, [verify] * N))
    return time.perf_counter() - t0


def make_namespace(name: str) -> None:
    """The bench's own namespace on the cluster, with its default ServiceAccount."""
    from kubernetes import client as k8s

    from broker.backends.kube.api import load_api_client

    core = k8s.CoreV1Api(load_api_client(kubeconfig_path()))
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name)))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            core.read_namespaced_service_account("default", name)
            return
        except k8s.ApiException:
            time.sleep(0.5)
    raise RuntimeError(f"namespace {name} has no default ServiceAccount after 60 s")


def drop_namespace(name: str) -> None:
    from kubernetes import client as k8s

    from broker.backends.kube.api import load_api_client

    k8s.CoreV1Api(load_api_client(kubeconfig_path())).delete_namespace(name, grace_period_seconds=0)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--mb", type=int, default=50)
    parser.add_argument("--stream", action="store_true", help="restores stream over HTTP")
    parser.add_argument("--backend", choices=("local", "kubernetes"), default="local")
    args = parser.parse_args()
    kube = args.backend == "kubernetes"
    cpu_m = KUBE_CPU_M if kube else CPU_M
    namespace = f"bench-fork-{secrets.token_hex(3)}"
    if kube:
        os.environ.update(
            SANDMAN_BACKEND="kubernetes",
            SANDMAN_KUBECONFIG=kubeconfig_path(),
            SANDMAN_NAMESPACE=namespace,
        )
        make_namespace(namespace)
    if args.stream:
        os.environ["SANDMAN_SNAPSHOT_LOCAL_COPY"] = "0"
    os.environ.setdefault("SANDMAN_CREATE_RATE", "1000")
    os.environ.setdefault("SANDMAN_CREATE_BURST", "1000")

    from sqlalchemy import select

    from broker.client.sync import Sandbox, SandboxClient
    from broker.errors import SandmanError
    from broker.ledger import store
    from broker.ledger.db import make_engine, make_session_factory
    from broker.ledger.models import Sandbox as Row
    from broker.local.stack import Stack, running_stack
    from broker.names import Queue, Task
    from broker.pools.store import WarmStore, pool_key
    from broker.settings import Settings
    from broker.snapshots.store import FsBlobStore, manifest_blobs

    settings = Settings.from_env()
    if running_stack(settings):
        print("a `sandman up` is running on this state dir; stop it first", file=sys.stderr)
        return 2
    stack = Stack(settings)
    print("starting the stack ...", flush=True)
    stack.start(web=False, echo=False)
    sessions = make_session_factory(make_engine(stack.database_url))
    client = SandboxClient(stack.redis_url, owner="bench-fork", heartbeat_s=3600)
    tag = secrets.token_hex(2)
    warm_job, cold_job = f"bench-fork-warm-{tag}", f"bench-fork-cold-{tag}"
    pool = {"image": IMAGE, "cpu_m": cpu_m, "memory_b": MEM, "size": N + 1}
    placed: dict[str, Any] = (
        {"node_selector": REAL_NODE, "readiness_budget_s": 180.0} if kube else {}
    )
    with sessions.begin() as session:
        store.ensure_job(session, warm_job, warm_pools=[{**pool, "idle_timeout_s": 3600}], **placed)
        store.ensure_job(session, cold_job, **placed)
    key = pool_key(IMAGE, None, None, cpu_m, MEM)
    warm = WarmStore(client.redis)
    spec: dict[str, Any] = {"image": IMAGE, "cpu": f"{cpu_m}m", "memory": MEM, "timeout": 300}
    store_dir = settings.state_dir / "snapshots"
    diff = diff_files()
    commands = generate_command(args.mb)

    def fill() -> None:
        client.send(Task.POOL_UPKEEP, [], Queue.POOL)
        deadline = time.monotonic() + 300
        while warm.size(warm_job, key) < N + 1 and time.monotonic() < deadline:
            time.sleep(0.2)

    def drained() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            with sessions() as session:
                left = session.scalars(
                    select(Row.id).where(
                        Row.job == cold_job, Row.state.in_(("creating", "ready", "releasing"))
                    )
                ).all()
            if not left:
                return
            time.sleep(0.5)

    def agent(sb: Sandbox) -> None:
        assert sb.exec(commands, timeout=600).exit_code == 0
        for path, data in diff.items():
            sb.write_file(path, data)
        assert sb.exec("cd /repo/agent && export AGENT_STEP=7").ok

    def in_threads(fn: Any) -> list[Any]:
        out: list[Any] = [None] * N

        def one(i: int) -> None:
            try:
                out[i] = fn()
            except Exception as exc:
                out[i] = exc

        threads = [threading.Thread(target=one, args=(i,)) for i in range(N)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    results: dict[str, list[float]] = {
        "fork8": [], "snapshot": [], "cold_plus_commands": [], "warm_plus_diff": [],
        "floor_copy_sha256": [], "floor_copy": [],
    }  # fmt: skip
    copiers = ProcessPoolExecutor(N, mp_context=get_context("spawn"))
    list(copiers.map(abs, range(N)))  # the processes are started before anything is timed
    scratch = settings.state_dir / "bench-floor"
    scratch.mkdir(exist_ok=True)
    stored_per_fork: list[float] = []
    restore_mbps: list[float] = []
    snapshot_mbps: list[float] = []
    failures = 0
    try:
        for trial in range(args.trials):
            # fork(8) from the warm pool
            fill()
            source = client.open(job=warm_job, **spec)
            agent(source)
            before = dir_bytes(store_dir) if store_dir.exists() else 0
            t0 = time.perf_counter()
            snap = source.snapshot(paths=["/repo"])
            t_snap = time.perf_counter() - t0
            forks = client.restore_many(N, snap, job=warm_job, **spec)
            t_fork = time.perf_counter() - t0
            ok = [f for f in forks if isinstance(f, Sandbox)]
            failures += sum(1 for f in forks if isinstance(f, SandmanError))
            assert ok and ok[0].exec("echo $AGENT_STEP; pwd").stdout == "7\n/repo/agent\n"
            results["fork8"].append(t_fork)
            results["snapshot"].append(t_snap)
            stored_per_fork.append((dir_bytes(store_dir) - before) / N)
            restore_mbps.append(snap.size * N / (t_fork - t_snap) / 1e6)
            snapshot_mbps.append(snap.size / t_snap / 1e6)
            print(
                f"trial {trial}: fork(8) {t_fork:.2f}s (snapshot {t_snap:.2f}s, "
                f"{snap.size / 1e6:.1f} MB listed, {snap.stored / 1e6:.1f} MB new), "
                f"warm hits {sum(1 for f in ok if f.lease.warm)}/{N}",
                flush=True,
            )
            for f in ok:
                f.release()
            source.release()
            # the floor: the same bytes copied N times with and without SHA-256
            blobs_of = FsBlobStore(store_dir)
            snap_blobs = sorted(manifest_blobs(blobs_of.manifest(snap.id) or {}))
            listed = [str(blobs_of.local_path(sha)) for sha in snap_blobs]
            results["floor_copy_sha256"].append(copy_floor(copiers, listed, scratch, True))
            results["floor_copy"].append(copy_floor(copiers, listed, scratch, False))
            # 8 cold acquires, each re-running the agent's commands
            drained()
            t0 = time.perf_counter()
            cold = in_threads(lambda: client.open(job=cold_job, **spec))
            got = [c for c in cold if isinstance(c, Sandbox)]
            in_threads_done = [threading.Thread(target=agent, args=(c,)) for c in got]
            for t in in_threads_done:
                t.start()
            for t in in_threads_done:
                t.join()
            results["cold_plus_commands"].append(time.perf_counter() - t0)
            for c in got:
                c.release()
            drained()
            # 8 warm acquires, each re-applying the diff by hand
            fill()
            t0 = time.perf_counter()
            hot = in_threads(lambda: client.open(job=warm_job, **spec))
            got = [c for c in hot if isinstance(c, Sandbox)]

            def apply(sb: Sandbox) -> None:
                for path, data in diff.items():
                    sb.write_file(path, data)

            ts = [threading.Thread(target=apply, args=(c,)) for c in got]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            results["warm_plus_diff"].append(time.perf_counter() - t0)
            for c in got:
                c.release()
            print(
                f"trial {trial}: cold+commands {results['cold_plus_commands'][-1]:.2f}s, "
                f"warm+diff {results['warm_plus_diff'][-1]:.2f}s, floor copy+sha256 "
                f"{results['floor_copy_sha256'][-1]:.2f}s, copy {results['floor_copy'][-1]:.2f}s, "
                f"load {os.getloadavg()[0]:.0f}",
                flush=True,
            )
        doc = {
            "trials": args.trials,
            "generated_mb": args.mb,
            "diff_bytes": DIFF_FILES * DIFF_BYTES,
            "n": N,
            "backend": args.backend,
            "cpu_m": cpu_m,
            "restores": "streamed" if args.stream or kube else "local copy",
            "failed_forks": failures,
            **{name: summary(values) for name, values in results.items()},
            "restore_mb_per_s": summary(restore_mbps),
            "snapshot_mb_per_s": summary(snapshot_mbps),
            "store_bytes_per_fork": stored_per_fork,
        }
        for base in ("cold_plus_commands", "warm_plus_diff", "floor_copy_sha256"):
            doc[f"fork8_over_{base}"] = doc["fork8"]["p50"] / doc[base]["p50"]
        print()
        for name in results:
            s = doc[name]
            print(f"{name:20} p50 {s['p50']:.2f}s  p90 {s['p90']:.2f}s  (n={s['n']})")
        for name in ("snapshot", "restore"):
            s = doc[f"{name}_mb_per_s"]
            print(f"{name + ' throughput':20} p50 {s['p50']:.0f} MB/s  p90 {s['p90']:.0f} MB/s")
        print(f"store bytes per fork {[round(b) for b in stored_per_fork]}")
        for base in ("cold_plus_commands", "warm_plus_diff", "floor_copy_sha256"):
            print(f"fork8 p50 / {base} p50 = {doc[f'fork8_over_{base}']:.2f}")
        save("fork", doc)
    finally:
        copiers.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
        client.close()
        stack.stop(echo=lambda _: None)
        stop_services(settings)  # the stack leaves the embedded services running
        if kube:
            drop_namespace(namespace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
