"""execd benchmark: command round trips, file transfer, baseline speed and memory.

Run: ``.venv/bin/python bench/execd_bench.py`` (``--n 2000`` round trips by
default). Compares ``echo hi`` through

* execd over one keep-alive HTTP/1.1 connection (http.client),
* a raw persistent bash on a pipe inside this process (the floor), and
* SWE-ReX's ``swerex-remote`` (if installed: ``pip install swe-rex``),

and prints medians, p99 and ratios, then 1 MiB / 100 MiB file write+read
through execd, baseline and state-check times on a generated 10,000-file
tree, and the daemon's resident memory. A benchmark, not a test: nothing here
asserts.
"""

import argparse
import base64
import http.client
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import free_port, pct  # noqa: E402


def fmt(samples):
    return f"p50 {pct(samples, 50) * 1e3:8.3f} ms   p99 {pct(samples, 99) * 1e3:8.3f} ms"


def wait_port(port, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


class Execd:
    def __init__(self, python, workdir):
        self.token = secrets.token_hex(16)
        self.port = free_port()
        env = dict(os.environ, SANDMAN_EXECD_TOKEN=self.token)
        self.proc = subprocess.Popen(
            [
                python,
                "-m",
                "execd",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--workdir",
                str(workdir),
                "--max-body-bytes",
                str(300 * 1024 * 1024),
                "--log-level",
                "WARNING",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(str(workdir), "execd.log"), "wb"),  # noqa: SIM115
        )
        if not wait_port(self.port):
            raise SystemExit("execd did not start")
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        self.headers = {"Authorization": "Bearer " + self.token, "Content-Type": "application/json"}

    def post(self, path, doc):
        self.conn.request("POST", path, body=json.dumps(doc), headers=self.headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{path}: {resp.status} {data[:200]!r}")
        return json.loads(data)

    def get(self, path):
        self.conn.request("GET", path, headers=self.headers)
        resp = self.conn.getresponse()
        return json.loads(resp.read())

    def memory_kb(self):
        out = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS", "VmHWM")):
                    out[line.split(":")[0]] = int(line.split()[1])
        return out

    def stop(self):
        self.conn.close()
        self.proc.terminate()
        self.proc.wait(10)


def cpu_seconds(pid):
    """utime + stime of a process: unlike latency, not inflated by a busy machine."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_execd(d, n):
    for _ in range(50):
        d.post("/v1/exec", {"command": "echo hi"})
    info = d.get("/v1/info")
    pids = (d.proc.pid, info["session_pid"])
    cpu_before = [cpu_seconds(p) for p in pids]
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        r = d.post("/v1/exec", {"command": "echo hi"})
        samples.append(time.perf_counter() - t)
        assert r["stdout"] == "hi\n"
    d.cpu_per_call = [(cpu_seconds(p) - b) / n for p, b in zip(pids, cpu_before, strict=True)]
    return samples


def bench_raw_pipe(n):
    p = subprocess.Popen(
        ["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
    )
    out = p.stdout.fileno()

    def once():
        p.stdin.write(b"echo hi\n")
        got = b""
        while not got.endswith(b"hi\n"):
            got += os.read(out, 64)

    for _ in range(50):
        once()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        once()
        samples.append(time.perf_counter() - t)
    p.stdin.close()
    p.wait()
    return samples


def bench_swerex(n):
    exe = shutil.which("swerex-remote") or str(Path(sys.executable).parent / "swerex-remote")
    if not os.path.exists(exe):
        return None, "swerex-remote not installed (pip install swe-rex)"
    port, token = free_port(), secrets.token_hex(8)
    proc = subprocess.Popen(
        [exe, "--host", "127.0.0.1", "--port", str(port), "--auth-token", token],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        if not wait_port(port):
            return None, "swerex-remote did not start"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        headers = {"X-API-Key": token, "Content-Type": "application/json"}

        def post(path, doc):
            conn.request("POST", path, body=json.dumps(doc), headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"swerex {path}: {resp.status} {data[:200]!r}")
            return json.loads(data)

        post(
            "/create_session", {"session": "default", "session_type": "bash", "startup_timeout": 30}
        )
        action = {
            "command": "echo hi",
            "session": "default",
            "action_type": "bash",
            "check": "silent",
            "timeout": 30,
        }
        for _ in range(20):
            post("/run_in_session", action)
        samples = []
        for _ in range(n):
            t = time.perf_counter()
            r = post("/run_in_session", action)
            samples.append(time.perf_counter() - t)
            assert "hi" in r["output"], r
        return samples, None
    except Exception as exc:  # report and continue: the comparison is optional
        return None, f"swerex failed: {exc}"
    finally:
        proc.terminate()
        proc.wait(10)


def bench_files(d, tmp, size):
    data = os.urandom(size)
    path = str(tmp / f"file-{size}")
    body = base64.b64encode(data).decode()
    t = time.perf_counter()
    d.post("/v1/files/write", {"path": path, "content_b64": body})
    tw = time.perf_counter() - t
    t = time.perf_counter()
    r = d.post("/v1/files/read", {"path": path})
    tr = time.perf_counter() - t
    assert base64.b64decode(r["content_b64"]) == data
    return tw, tr


def make_tree(root, files=10000, size=4096):
    per_dir = 100
    for i in range(files):
        d = root / f"pkg{i // per_dir:03d}"
        if i % per_dir == 0:
            d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i % per_dir:03d}.py").write_bytes(os.urandom(size // 2).hex().encode())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--python", default=sys.executable, help="interpreter running execd")
    ap.add_argument("--n-swerex", type=int, default=200, help="swerex is slow: fewer calls")
    ap.add_argument("--skip-swerex", action="store_true")
    ap.add_argument("--debug", action="store_true", help="print the tail of the execd log")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="execd-bench-"))
    print(
        f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; "
        f"execd on {args.python}; {args.n} round trips ({args.n_swerex} for swerex)"
    )
    d = Execd(args.python, tmp)
    try:
        mem_idle = d.memory_kb()
        ex = bench_execd(d, args.n)
        raw = bench_raw_pipe(args.n)
        sw, why = (None, "skipped") if args.skip_swerex else bench_swerex(args.n_swerex)
        print("\n== echo hi round trip")
        print(f"  execd (HTTP keep-alive)  {fmt(ex)}")
        print(f"  raw bash pipe (floor)    {fmt(raw)}")
        if sw:
            print(f"  swerex-remote            {fmt(sw)}")
        else:
            print(f"  swerex-remote            not measured: {why}")
        print(
            f"  ratio execd / raw pipe   p50 {pct(ex, 50) / pct(raw, 50):6.1f}x   "
            f"p99 {pct(ex, 99) / pct(raw, 99):6.1f}x"
        )
        if sw:
            print(
                f"  ratio swerex / execd     p50 {pct(sw, 50) / pct(ex, 50):6.1f}x   "
                f"p99 {pct(sw, 99) / pct(ex, 99):6.1f}x"
            )
        print(
            f"  CPU per call             execd {d.cpu_per_call[0] * 1e6:6.0f} us   "
            f"bash {d.cpu_per_call[1] * 1e6:6.0f} us  (load-independent)"
        )
        print("\n== files through execd (write, then read back, base64 JSON)")
        for size in (1 << 20, 100 << 20):
            tw, tr = bench_files(d, tmp, size)
            print(f"  {size >> 20:4d} MiB   write {tw * 1e3:9.1f} ms   read {tr * 1e3:9.1f} ms")
        tree = tmp / "repo"
        make_tree(tree)
        b = d.post("/v1/baseline", {"root": str(tree)})
        times = []
        for _ in range(3):
            t = time.perf_counter()
            c = d.post("/v1/state-check", {})
            times.append(time.perf_counter() - t)
        print("\n== state on a 10,000-file tree (4 KiB files)")
        print(
            f"  baseline     {b['duration_s'] * 1e3:8.1f} ms ({b['files']} files, "
            f"{b['bytes'] >> 20} MiB hashed)"
        )
        print(
            f"  state-check  {statistics.median(times) * 1e3:8.1f} ms (median of 3, "
            f"clean={c['clean']})"
        )
        mem = d.memory_kb()
        print("\n== execd memory")
        print(
            f"  RSS idle {mem_idle['VmRSS'] / 1024:6.1f} MiB   after the runs "
            f"{mem['VmRSS'] / 1024:6.1f} MiB   peak {mem['VmHWM'] / 1024:6.1f} MiB "
            "(the peak includes the 100 MiB transfer)"
        )
    finally:
        d.stop()
        if args.debug:
            print("execd log:", (tmp / "execd.log").read_text(errors="replace")[-2000:])
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
