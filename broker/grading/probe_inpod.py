"""Run-condition probe, executed INSIDE the grading sandbox (stdlib only, Python 3.8+).

The grader sends this file's source through execd and runs it with the sandbox's
``python3`` in the same shell session the tests will use. It only observes and prints
one JSON object; deciding what contradicts the task's declaration happens in the broker
(``broker.grading.probe``). Every reading says where it came from, and a reading that
failed says why instead of guessing.

Egress is judged by a genuine answer from outside: a DNS answer for a public name AND a
TLS handshake whose certificate verifies for that name. A bare ``connect()`` proves
nothing: intercepting proxies accept TCP connections to any address.
"""

from __future__ import annotations

import datetime as dt
import json
import locale
import os
import socket
import ssl
import sys
import threading
import time
from typing import Any

UNLIMITED_V1 = 1 << 62


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_dirs(controller: str) -> tuple[str, list[str]]:
    """("v2"|"v1"|"none", candidate directories from this process's cgroup up to the root)."""
    lines = (_read("/proc/self/cgroup") or "").splitlines()
    v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if v2 and parts[0] == "0" and parts[1] == "":
            root, rel = "/sys/fs/cgroup", parts[2]
        elif not v2 and controller in parts[1].split(","):
            root = "/sys/fs/cgroup/" + ("cpu,cpuacct" if controller == "cpu" else controller)
            if not os.path.isdir(root):
                root = "/sys/fs/cgroup/" + controller
            rel = parts[2]
        else:
            continue
        dirs = []
        path = os.path.normpath(root + "/" + rel.lstrip("/"))
        if os.path.isdir(path):
            while path.startswith(root):
                dirs.append(path)
                if path == root:
                    break
                path = os.path.dirname(path)
        else:  # our cgroup path is outside the mounted subtree (container without cgroupns)
            dirs = [root]
        return ("v2" if v2 else "v1"), dirs
    return "none", []


def memory() -> dict[str, Any]:
    version, dirs = _cgroup_dirs("memory")
    name = "memory.max" if version == "v2" else "memory.limit_in_bytes"
    best: int | None = None
    sources = []
    for d in dirs:
        raw = _read(d + "/" + name)
        if raw is None:
            continue
        sources.append(d + "/" + name)
        if raw == "max" or (raw.isdigit() and int(raw) >= UNLIMITED_V1):
            continue
        if raw.isdigit():
            best = int(raw) if best is None else min(best, int(raw))
    if version == "none" or not sources:
        return {
            "readable": False,
            "error": "no cgroup memory controller visible",
            "cgroup": version,
        }
    return {
        "readable": True,
        "limit_b": best,
        "unlimited": best is None,
        "cgroup": version,
        "sources": sources,
    }


def cpu() -> dict[str, Any]:
    out: dict[str, Any] = {"cpu_count": os.cpu_count()}
    try:
        out["visible"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError) as exc:
        out["visible"] = None
        out["visible_error"] = str(exc)
    version, dirs = _cgroup_dirs("cpu")
    quota: float | None = None
    sources = []
    for d in dirs:
        if version == "v2":
            raw = _read(d + "/cpu.max")
            if raw is None:
                continue
            sources.append(d + "/cpu.max")
            q, _, period = raw.partition(" ")
            if q != "max" and q.isdigit() and period.isdigit() and int(period) > 0:
                value = int(q) / int(period)
                quota = value if quota is None else min(quota, value)
        else:
            q_raw, p_raw = _read(d + "/cpu.cfs_quota_us"), _read(d + "/cpu.cfs_period_us")
            if q_raw is None or p_raw is None:
                continue
            sources.append(d + "/cpu.cfs_quota_us")
            if q_raw.lstrip("-").isdigit() and int(q_raw) > 0 and p_raw.isdigit():
                value = int(q_raw) / int(p_raw)
                quota = value if quota is None else min(quota, value)
    out.update(quota_readable=bool(sources), quota_cpus=quota, cgroup=version, sources=sources)
    return out


def _resolve(host: str, port: int, timeout: float) -> tuple[list[str], str | None, float]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            box["addrs"] = list(dict.fromkeys(str(i[4][0]) for i in infos))
        except OSError as exc:
            box["error"] = f"{type(exc).__name__}: {exc}"

    started = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    took = time.monotonic() - started
    if t.is_alive():
        return [], f"no DNS answer within {timeout:.1f}s", took
    return box.get("addrs", []), box.get("error"), took


def egress(host: str, port: int, timeout: float) -> dict[str, Any]:
    out: dict[str, Any] = {"host": host, "port": port}
    addrs, error, took = _resolve(host, port, timeout)
    out["dns"] = {
        "answered": bool(addrs),
        "addresses": addrs[:4],
        "error": error,
        "seconds": round(took, 3),
    }
    if not addrs:
        out.update(state="denied", reason="no DNS answer")
        return out
    ctx = ssl.create_default_context()
    tls: dict[str, Any] = {"handshake": False, "attempts": []}
    for addr in addrs[:2]:
        started = time.monotonic()
        try:
            # Nested on purpose: parenthesized context managers need Python 3.10.
            with socket.create_connection((addr, port), timeout=timeout) as sock:  # noqa: SIM117
                with ctx.wrap_socket(sock, server_hostname=host) as tls_sock:
                    tls.update(handshake=True, address=addr, version=tls_sock.version())
                    break
        except ssl.SSLCertVerificationError as exc:
            tls["attempts"].append(
                {"address": addr, "error": f"certificate: {exc}", "verify_failed": True}
            )
        except (OSError, ssl.SSLError) as exc:
            tls["attempts"].append({"address": addr, "error": f"{type(exc).__name__}: {exc}"})
        tls["seconds"] = round(time.monotonic() - started, 3)
    out["tls"] = tls
    if tls["handshake"]:
        out.update(state="allowed", reason=f"verified TLS handshake with {host}")
    elif any(a.get("verify_failed") for a in tls["attempts"]):
        out.update(
            state="intercepted",
            reason=f"something answered TLS for {host} without a valid certificate",
        )
    else:
        out.update(state="denied", reason=f"DNS answered but no TLS handshake with {host}")
    return out


def timezone() -> dict[str, Any]:
    tz = os.environ.get("TZ")
    lt = time.localtime()
    out: dict[str, Any] = {"env": tz, "tzname": list(time.tzname), "utcoffset_s": lt.tm_gmtoff}
    if tz:
        name = tz.lstrip(":")
        out["zone_file"] = os.path.exists("/usr/share/zoneinfo/" + name) if name else None
        try:
            import zoneinfo  # novermin (Python 3.9+, ImportError handled)

            info = zoneinfo.ZoneInfo(name)
            offset = dt.datetime.now(info).utcoffset()
            out["expected_offset_s"] = int(offset.total_seconds()) if offset else 0
        except ImportError:
            out["expected_offset_s"] = None
        except Exception as exc:  # ZoneInfoNotFoundError, ValueError: zone data missing
            out["expected_offset_s"] = None
            out["zone_error"] = f"{type(exc).__name__}: {exc}"
    return out


def locale_info() -> dict[str, Any]:
    out: dict[str, Any] = {"LANG": os.environ.get("LANG"), "LC_ALL": os.environ.get("LC_ALL")}
    try:
        out["effective"] = locale.setlocale(locale.LC_ALL, "")
        out["available"] = True
    except locale.Error as exc:
        out["available"] = False
        out["error"] = str(exc)
    out["encoding"] = locale.getpreferredencoding(False)
    return out


def main(argv: list[str]) -> int:
    args = json.loads(argv[1]) if len(argv) > 1 else {}
    started = time.monotonic()
    report = {
        "python": sys.version.split()[0],
        "env": {k: os.environ.get(k) for k in ("PYTHONHASHSEED", "TZ", "LANG", "LC_ALL")},
        "hash_randomization": sys.flags.hash_randomization,
        "memory": memory(),
        "cpu": cpu(),
        "tz": timezone(),
        "locale": locale_info(),
        "egress": egress(
            args.get("egress_host", "example.com"),
            int(args.get("egress_port", 443)),
            float(args.get("egress_timeout_s", 3.0)),
        ),
    }
    report["seconds"] = round(time.monotonic() - started, 3)
    sys.stdout.write("SANDMAN-PROBE " + json.dumps(report, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
