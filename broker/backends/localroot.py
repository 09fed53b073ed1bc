"""A local sandbox's root filesystem: the image's unpacked root plus its own writable layer.

How a sandbox is rooted (``SandboxRoot``):
- overlay (preferred): kernel overlayfs with the image's unpacked root (shared, never
  written) as the lower layer and ``<sandbox dir>/upper`` as the writable one. It is
  mounted inside a PRIVATE mount namespace that ``unshare`` opens just before bubblewrap
  starts (``sh -c 'mount ... && exec bwrap ...'``: the pid stays bwrap's), so the host
  never sees the mount, and it disappears with the sandbox's last process: nothing to
  unmount after a crash, and deleting the sandbox directory removes the layer.
- copy (fallback, when the kernel or the container refuses overlay mounts): a full copy
  of the unpacked root per sandbox. Whether overlay works is probed once per process.

bubblewrap then binds that root at ``/`` and adds only: execd (read-only), ``/proc``,
a minimal ``/dev``, a private ``/tmp``, the sandbox's workspace and, when the image has no
python3 of its own, the host interpreter that execd needs (``HostPython``).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from broker.errors import KubeUnavailable

PYTHON_CANDIDATES = ("usr/local/bin/python3", "usr/bin/python3", "bin/python3")
HOSTPY = "/sandman/hostpy"
RESOLV = "/etc/resolv.conf"
_MOUNT = 'mount -t overlay sandman-root -o "$1" "$2" && shift 2 && exec "$@"'


def _resolve_inside(root: Path, rel: str, depth: int = 0) -> Path | None:
    """``rel`` resolved as the sandbox will see it (symlinks relative to ``root``)."""
    if depth > 20:
        return None
    current = root
    for i, part in enumerate(rel.strip("/").split("/")):
        current = current / part
        if current.is_symlink():
            target = os.readlink(current)
            base = "" if target.startswith("/") else str(current.parent.relative_to(root))
            rest = "/".join(rel.strip("/").split("/")[i + 1 :])
            joined = os.path.normpath("/" + "/".join(p for p in (base, target, rest) if p))
            return _resolve_inside(root, joined, depth + 1)  # normpath of "/..." stays under /
        if not current.exists():
            return None
    return current


def image_python(rootfs: Path) -> str | None:
    """The image's own python3 (sandbox path), if it has one execd can run on."""
    for rel in PYTHON_CANDIDATES:
        found = _resolve_inside(rootfs, rel)
        if found is not None and found.is_file() and os.access(found, os.X_OK):
            return "/" + rel
    return None


@dataclass(frozen=True)
class HostPython:
    """The host's interpreter, carried into an image that has none: the binary, its
    standard library and exactly the shared libraries ``ldd`` lists, bound read-only under
    /sandman/hostpy and started through the host's own dynamic loader (the image's libc
    may be another, or absent). Nothing else of the host comes with it."""

    binary: str
    stdlib: str
    libs: tuple[tuple[str, str], ...]  # (soname, host file)
    loader: str

    def binds(self) -> list[str]:
        argv = ["--ro-bind", self.binary, f"{HOSTPY}/bin/python3"]
        argv += ["--ro-bind", self.stdlib, f"{HOSTPY}/lib/{Path(self.stdlib).name}"]
        for soname, lib in (*self.libs, (Path(self.loader).name, self.loader)):
            argv += ["--ro-bind", lib, f"{HOSTPY}/lib/{soname}"]
        return [*argv, "--setenv", "PYTHONHOME", HOSTPY]

    def command(self) -> list[str]:
        loader = f"{HOSTPY}/lib/{Path(self.loader).name}"
        return [loader, "--library-path", f"{HOSTPY}/lib", f"{HOSTPY}/bin/python3"]


@functools.cache
def host_python() -> HostPython:
    exe = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    exe = os.path.realpath(exe)
    stdlib = subprocess.run(
        [exe, "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # The interpreter's libraries and those of its extension modules (ctypes needs libffi).
    objects = [exe, *map(str, Path(stdlib, "lib-dynload").glob("*.so"))]
    libs: dict[str, str] = {}
    loader = ""
    listing = subprocess.run(["ldd", *objects], capture_output=True, text=True, check=False).stdout
    for line in listing.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
            libs.setdefault(parts[0], os.path.realpath(parts[2]))
        elif parts and parts[0].startswith("/") and "ld-linux" in parts[0]:
            loader = parts[0]
    if not loader:
        raise KubeUnavailable(
            f"cannot find the dynamic loader of {exe} for an image without python"
        )
    return HostPython(exe, stdlib, tuple(sorted(libs.items())), loader)


_probe_lock = threading.Lock()


def overlay_works(scratch: Path) -> bool:
    """Probe (once per process and scratch dir) whether this process may mount overlayfs
    in a private mount namespace, with the upper layer on the file system sandboxes use.

    Serialised: workers run creates on threads, and two first creates probing at once
    must not remove each other's probe (a failed probe means the slow copy fallback for
    the rest of the process)."""
    with _probe_lock:
        return _overlay_probe(scratch)


@functools.cache
def _overlay_probe(scratch: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    scratch.mkdir(parents=True, exist_ok=True)
    probe = Path(tempfile.mkdtemp(prefix=".overlay-probe-", dir=scratch))
    dirs = {k: probe / k for k in ("lower", "upper", "work", "merged")}
    try:
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [
                *("unshare", "--mount", "--propagation", "private", "sh", "-c", _MOUNT, "probe"),
                _options(dirs["lower"], dirs["upper"], dirs["work"]),
                str(dirs["merged"]),
                "true",
            ],
            capture_output=True,
            check=False,
            timeout=30,
        )
        return result.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def _options(lower: Path, upper: Path, work: Path) -> str:
    return f"lowerdir={lower},upperdir={upper},workdir={work}"


@dataclass(frozen=True)
class SandboxRoot:
    """The root a sandbox runs on, prepared in its own directory (removed with it)."""

    rootfs: Path  # the image's shared unpacked root
    sandbox_dir: Path
    overlay: bool

    @property
    def merged(self) -> Path:
        return self.sandbox_dir / ("merged" if self.overlay else "rootfs")

    def prepare(self) -> None:
        if self.overlay:
            for name in ("upper", "work", "merged"):
                (self.sandbox_dir / name).mkdir(parents=True, exist_ok=True)
            return
        target = self.merged
        partial = target.with_name("rootfs.partial")
        shutil.rmtree(partial, ignore_errors=True)
        subprocess.run(
            ["cp", "-a", "--reflink=auto", f"{self.rootfs}/.", str(partial)],
            check=True,
            capture_output=True,
        )
        partial.rename(target)

    def network_files(self, hostname: str, nameserver: str) -> list[str]:
        """What a container runtime provides: an /etc/hosts naming localhost and the
        sandbox's hostname (images rarely ship one), and an /etc/resolv.conf naming
        ``nameserver`` (the uplink's DNS forwarder: the sandbox has its own network
        namespace, where the host's resolver, often on its loopback, is not reachable)."""
        hosts = self.sandbox_dir / "hosts"
        hosts.write_text(
            f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n127.0.1.1\t{hostname}\n"
        )
        resolv = self.sandbox_dir / "resolv.conf"
        resolv.write_text(f"nameserver {nameserver}\n")
        return ["--bind", str(hosts), "/etc/hosts", "--ro-bind", str(resolv), RESOLV]

    def wrap(self, bwrap_argv: list[str]) -> list[str]:
        """The command that starts ``bwrap_argv`` on this root (mounting it first)."""
        if not self.overlay:
            return bwrap_argv
        options = _options(self.rootfs, self.sandbox_dir / "upper", self.sandbox_dir / "work")
        return [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            _MOUNT,
            "sandman-root",
            options,
            str(self.merged),
            *bwrap_argv,
        ]
