"""The local backend: sandboxes as execd processes under bubblewrap, for laptops and CI.

Isolation chosen, and why:
- own PID, IPC, UTS (and cgroup, where allowed) namespaces; all capabilities dropped;
- the sandbox is rooted in its task image: the image comes from the local image store
  (``broker.images``, ``sandman image import``), is unpacked once per digest, and each
  sandbox gets its own writable layer over it (``broker.backends.localroot``). Nothing of
  the host is visible but the repository's execd (read-only, /sandman/execd), /proc, a
  minimal /dev, a private /tmp, the workspace and, for an image without python3, the
  host interpreter execd runs on. An image missing from the store is ``ImageNotFound``
  from ``check_image``, before any ledger row or process exists.
- NOT a network namespace: execd must stay reachable from the broker and trainers on
  127.0.0.1:<port> in the host netns, and an unshared netns would cut it off. So the
  local backend cannot deny egress; it reports no egress guard and the provider
  refuses egress-denied jobs here rather than pretending (GuardMissing).
- CPU and memory are recorded, not enforced (no cgroup delegation on a laptop).

"Pods" survive broker and worker restarts: the process is started in its own session,
and its labels, nonce, pid and port live in ``state_dir/local-pods/<name>.json``, so
get / list / delete-by-nonce and the GC find it again from any process.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from broker.backends.base import LABEL_INSTALLATION, LABEL_NONCE, PodInfo, PodSpec
from broker.backends.localroot import SandboxRoot, host_python, image_python, overlay_works
from broker.errors import GuardMissing, ImageInvalid, ImageNotFound, KubeConflict, KubeUnavailable
from broker.images.store import ImageStore
from broker.settings import Settings

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
_SKIP_TOP = frozenset({"proc", "dev", "tmp", "sys", "run", "workspace", "sandman", "lost+found"})
_children: dict[int, subprocess.Popen[bytes]] = {}
_children_lock = threading.Lock()


def _proc_start(pid: int) -> str | None:
    """The kernel start time of ``pid`` (guards against PID reuse), None if gone/zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _reap_exited() -> None:
    """Collect every child of this process whose sandbox was deleted elsewhere.

    The worker that creates a sandbox is its parent, but the release usually runs in
    another worker process, which kills it without being able to wait for it. Without
    this sweep (run at every create) the creating process would keep one Popen object
    and one zombie per sandbox it ever made: memory growth, and in the end no PIDs.
    """
    with _children_lock:
        done = [pid for pid, proc in _children.items() if proc.poll() is not None]
        for pid in done:
            del _children[pid]


# Below Linux's default ephemeral range (32768-60999): a port picked there could be taken
# as the source port of any outgoing connection between our pick and execd's bind (one
# sandbox in ~10,000 failed to start that way under the load run). Ports here are handed
# out only by this claim, and the claim is a lock file, so concurrent workers never share.
PORT_RANGE = (20000, 32000)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _healthz(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            head = sock.recv(64)
            return head.startswith(b"HTTP/1.") and head.split(b" ", 2)[1:2] == [b"200"]
    except OSError:
        return False


def _sandbox_python(hidden: list[Path]) -> tuple[str, str | None]:
    """A python3 that is visible inside the sandbox (execd needs only the stdlib).

    Prefer the system interpreter; otherwise use the broker's own, binding its prefix
    back in when it lives under a directory we hide (pyenv under $HOME, for example).
    """
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate, None
    real = os.path.realpath(sys.executable)
    if any(Path(real).is_relative_to(h) for h in hidden):
        return real, sys.base_prefix
    return real, None


def _workdir(requested: str, *, nested: bool) -> str:
    """The sandbox's working directory: an absolute path other than ``/`` (one level only
    on the host root, whose other top-level directories are the host's), else /workspace."""
    parts = [p for p in requested.split("/") if p]
    if not requested.startswith("/") or not parts or any(p in (".", "..") for p in parts):
        return "/workspace"
    if not nested and len(parts) > 1:
        return "/workspace"
    return "/" + "/".join(parts)


def _token_pipe(token: str) -> int:
    """A pipe's read end holding ``token`` and then EOF (the write end is closed already).

    A token is a few dozen bytes, far below the pipe buffer, so the write never blocks.
    """
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, token.encode())
    except OSError:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return read_end


class LocalBackend:
    """Backend protocol over bubblewrap processes; see the module docstring."""

    name = "local"

    def __init__(
        self, settings: Settings, *, execd_dir: Path | None = None, host_root: bool = False
    ) -> None:
        """``host_root`` runs sandboxes on the host's root, read-only, ignoring the image:
        the pre-image behaviour, kept ONLY so bench/local_images.py can measure it."""
        self.root = Path(settings.state_dir) / "local-pods"
        self.root.mkdir(parents=True, exist_ok=True)
        self.hidden = [Path(settings.state_dir), Path.home()]
        self.execd_dir = execd_dir or REPO_ROOT / "execd"
        self.python, self.python_prefix = _sandbox_python(self.hidden)
        self.bwrap = shutil.which("bwrap")
        self.images = ImageStore.at_cache(settings.cache_dir)
        self.host_root = host_root

    def check_image(self, image: str) -> None:
        """ImageNotFound unless ``image`` (a ref or a digest) is in the local store."""
        if not self.host_root:
            self.images.resolve(image)

    # -- guards: nothing cluster-side to install locally -------------------------------

    def ensure_job_owner(self, namespace: str, job: str) -> None:
        return None

    def ensure_egress_guard(self, namespace: str, job: str, allow: list[str]) -> None:
        raise GuardMissing("the local backend cannot deny egress (execd shares the host netns)")

    def has_egress_guard(self, namespace: str, job: str) -> bool:
        return False

    # -- pods --------------------------------------------------------------------------

    def _meta_path(self, name: str) -> Path:
        return self.root / f"{name}.json"

    def _workspace(self, name: str) -> Path:
        return self.root / name / "workspace"

    def _sandbox_root(self, spec: PodSpec) -> SandboxRoot | None:
        """Unpack the image if this is its first use, then lay the sandbox's own writable
        layer over it (None on the benchmark-only host root)."""
        if self.host_root:
            return None
        rootfs = self.images.rootfs(self.images.resolve(spec.image))
        root = SandboxRoot(rootfs, self.root / spec.name, overlay=overlay_works(self.root))
        root.prepare()
        return root

    def _image_argv(self, spec: PodSpec, root: SandboxRoot) -> tuple[list[str], list[str]]:
        """bwrap's first arguments on an image root, and the python that runs execd."""
        assert self.bwrap is not None
        argv = [self.bwrap, "--bind", str(root.merged), "/", "--dev", "/dev", "--proc", "/proc"]
        argv += root.network_files(spec.name[:63])
        python = image_python(root.rootfs)
        if python is None:
            hosted = host_python()
            argv += hosted.binds()
            command = hosted.command()
        else:
            command = [python]
        for item in self.images.config(self.images.resolve(spec.image)).get("Env") or []:
            key, sep, value = str(item).partition("=")
            if sep and key:
                argv += ["--setenv", key, value]
        return argv, command

    def _argv(
        self,
        spec: PodSpec,
        port: int,
        workspace: Path,
        info_fd: int,
        root: SandboxRoot | None = None,
    ) -> list[str]:
        if self.bwrap is None:
            raise KubeUnavailable("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
        if root is not None:
            argv, python = self._image_argv(spec, root)
        else:
            argv, python = self._host_root_argv(), [self.python]
        workdir = _workdir(spec.workdir, nested=root is not None)
        argv += ["--tmpfs", "/tmp"]  # noqa: S108 (a private tmpfs inside the sandbox)
        if root is None or not (root.rootfs / workdir.lstrip("/")).is_dir():
            # A workdir the image has (a task's repository) is the image's, in the
            # sandbox's own layer; any other gets an empty workspace of its own.
            argv += ["--bind", str(workspace), workdir]
        argv += [
            "--ro-bind",
            str(self.execd_dir),
            "/sandman/execd",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--hostname",
            spec.name[:63],
            "--cap-drop",
            "ALL",
            "--chdir",
            workdir,
            "--setenv",
            "HOME",
            workdir,
            "--setenv",
            "PYTHONPATH",
            "/sandman",
            "--info-fd",
            str(info_fd),
        ]
        for key, value in spec.env.items():
            argv += ["--setenv", key, value]
        argv += [
            "--",
            *python,
            "-m",
            "execd",
            "--listen",
            f"127.0.0.1:{port}",
            "--workdir",
            workdir,
        ]
        return argv

    def _host_root_argv(self) -> list[str]:
        """The benchmark-only host root: a fresh tmpfs with every top-level host directory
        bound read-only into it, the state dir and $HOME hidden."""
        assert self.bwrap is not None
        argv = [self.bwrap]
        for entry in sorted(os.listdir("/")):
            if entry in _SKIP_TOP or not os.path.isdir("/" + entry):
                continue
            if os.path.islink("/" + entry):
                argv += ["--symlink", os.readlink("/" + entry), "/" + entry]
            else:
                argv += ["--ro-bind", "/" + entry, "/" + entry]
        argv += ["--dev", "/dev", "--proc", "/proc"]
        for hidden in self.hidden:
            if hidden.exists() and hidden != Path("/"):
                argv += ["--tmpfs", str(hidden)]
        return argv

    def create(self, spec: PodSpec) -> PodInfo:
        meta_path = self._meta_path(spec.name)
        meta: dict[str, Any] = {
            "name": spec.name,
            "namespace": spec.namespace,
            "labels": spec.labels(),
            "created_at": dt.datetime.now(dt.UTC).isoformat(),
            "pid": None,
            "port": None,
            "cpu_m": spec.cpu_m,
            "memory_b": spec.memory_b,
            "image": spec.image,
        }
        try:  # O_EXCL: the name is the idempotency key, exactly like a pod name.
            fd = os.open(meta_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError as exc:
            raise KubeConflict(f"local pod {spec.name} exists", status=409) from exc
        with os.fdopen(fd, "w") as fh:
            json.dump(meta, fh)
        workspace = self._workspace(spec.name)
        workspace.mkdir(parents=True, exist_ok=True)
        port = self._claim_port()
        log = (self.root / spec.name / "execd.log").open("ab")
        read_fd, write_fd = os.pipe()
        token_fd = _token_pipe(spec.token)
        try:
            root = self._sandbox_root(spec)
            argv = self._argv(spec, port, workspace, write_fd, root)
            proc = subprocess.Popen(
                root.wrap(argv) if root is not None else argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                pass_fds=(write_fd, token_fd),
                # The token travels in a pipe that execd reads to EOF and closes: not on
                # the command line (`ps` shows it to every local user), and not in the
                # environment, which bubblewrap's init (PID 1 in the sandbox) would keep
                # in its /proc/1/environ for every command to read.
                env={
                    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                    "LANG": "C.UTF-8",
                    "SANDMAN_EXECD_TOKEN_FD": str(token_fd),
                },
            )
        except (OSError, KubeUnavailable, subprocess.CalledProcessError) as exc:
            self._abort_create(spec.name, read_fd, port)
            raise KubeUnavailable(f"cannot start bwrap: {exc}") from exc
        except (ImageNotFound, ImageInvalid):
            self._abort_create(spec.name, read_fd, port)
            raise
        finally:
            os.close(write_fd)
            os.close(token_fd)
            log.close()
        with _children_lock:
            _children[proc.pid] = proc
        _reap_exited()
        child = self._read_info(read_fd)
        meta.update(pid=proc.pid, start=_proc_start(proc.pid), child_pid=child, port=port)
        tmp = meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta))
        tmp.replace(meta_path)
        return self._info(meta)

    def _abort_create(self, name: str, read_fd: int, port: int) -> None:
        """Nothing was started: drop what create made so far (meta, sandbox dir, port)."""
        os.close(read_fd)
        shutil.rmtree(self.root / name, ignore_errors=True)
        self._meta_path(name).unlink(missing_ok=True)
        self._release_port(port)

    @staticmethod
    def _read_info(read_fd: int) -> int | None:
        """bwrap writes {"child-pid": N} on --info-fd: N is the PID-namespace init."""
        with os.fdopen(read_fd, "rb") as fh:
            data = fh.read()
        with contextlib.suppress(ValueError):
            pid = json.loads(data.decode()).get("child-pid")
            return int(pid) if pid else None
        return None

    def _load(self, name: str) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self._meta_path(name).read_text())
        except (OSError, ValueError):
            return None
        return data

    def _alive(self, meta: dict[str, Any]) -> bool:
        pid = meta.get("pid")
        return pid is not None and _proc_start(int(pid)) == meta.get("start")

    def _info(self, meta: dict[str, Any], *, probe: bool = True) -> PodInfo:
        alive = self._alive(meta)
        port = meta.get("port")
        pending = meta.get("pid") is None
        ready = alive and port is not None and probe and _healthz(int(port))
        phase = "Pending" if pending else ("Running" if alive else "Failed")
        return PodInfo(
            name=meta["name"],
            namespace=meta["namespace"],
            labels=dict(meta["labels"]),
            phase=phase,
            ready=bool(ready),
            ip="127.0.0.1",
            node=socket.gethostname(),
            deleting=bool(meta.get("deleting")),
            created_at=dt.datetime.fromisoformat(meta["created_at"]),
            address=f"127.0.0.1:{port}" if port else None,
            reason=None if alive or pending else "ProcessExited",
        )

    def get(self, namespace: str, name: str) -> PodInfo | None:
        meta = self._load(name)
        if meta is None or meta.get("namespace") != namespace:
            return None
        return self._info(meta)

    def delete(self, namespace: str, name: str, nonce: str) -> bool:
        meta = self._load(name)
        if meta is None:
            return True
        if meta["labels"].get(LABEL_NONCE) != nonce:
            return False  # replaced under the same name: not the pod the caller owns
        for key in ("child_pid", "pid"):
            pid = meta.get(key)
            if pid and (key == "child_pid" or self._alive(meta)):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)  # the PID-ns init: everything inside dies
        if meta.get("pid") and self._alive(meta):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(meta["pid"]), signal.SIGKILL)
        self._reap(meta.get("pid"))
        shutil.rmtree(self.root / name, ignore_errors=True)
        self._meta_path(name).unlink(missing_ok=True)
        if meta.get("port"):
            self._release_port(int(meta["port"]))
        return True

    def _claim_port(self) -> int:
        """A loopback port no other sandbox holds and nothing is bound to (see PORT_RANGE)."""
        locks = self.root / ".ports"
        locks.mkdir(parents=True, exist_ok=True)
        rng = random.SystemRandom()
        for _ in range(500):
            port = rng.randrange(*PORT_RANGE)
            try:
                os.close(os.open(locks / str(port), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                continue
            if _bindable(port):
                return port
            self._release_port(port)
        raise KubeUnavailable("no free loopback port for a local sandbox")

    def _release_port(self, port: int) -> None:
        (self.root / ".ports" / str(port)).unlink(missing_ok=True)

    @staticmethod
    def _reap(pid: int | None) -> None:
        with _children_lock:
            proc = _children.pop(pid, None) if pid else None
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2)

    def _all(self) -> list[dict[str, Any]]:
        out = []
        for path in sorted(self.root.glob("*.json")):
            meta = self._load(path.stem)
            if meta is not None:
                out.append(meta)
        return out

    def list_installation(self, namespace: str, installation: str) -> list[PodInfo]:
        return [
            self._info(m, probe=False)
            for m in self._all()
            if m.get("namespace") == namespace
            and m["labels"].get(LABEL_INSTALLATION) == installation
        ]

    def list_all_labelled(self, namespace: str) -> list[PodInfo]:
        return [self._info(m, probe=False) for m in self._all() if m.get("namespace") == namespace]

    def wait_gone(self, namespace: str, name: str, timeout_s: float) -> bool:
        """Poll (20 ms): a local sandbox is gone once its process and state are."""
        deadline = time.monotonic() + timeout_s
        while self.get(namespace, name) is not None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def watch_ready(self, namespace: str, names: set[str], timeout_s: float) -> Iterator[PodInfo]:
        """Poll (20 ms) until every named pod is ready or failed, or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        pending = set(names)
        while pending:
            for name in sorted(pending):
                info = self.get(namespace, name)
                if info is None:
                    continue
                if info.ready or info.terminal_failure:
                    pending.discard(name)
                    yield info
            if not pending or time.monotonic() >= deadline:
                return
            time.sleep(0.02)
