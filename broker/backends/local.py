"""The local backend: sandboxes as execd processes under bubblewrap, for laptops and CI.

Isolation chosen, and why:
- own PID, IPC, UTS (and cgroup, where allowed) namespaces; all capabilities dropped;
- the sandbox is rooted in its task image: the image comes from the local image store
  (``broker.images``, ``sandman image import``), is unpacked once per digest, and each
  sandbox gets its own writable layer over it (``broker.backends.localroot``). Nothing of
  the host is visible but the repository's execd (read-only, /sandman/execd), /proc, a
  minimal /dev, a private /tmp, the workspace and, for an image without python3, the
  host interpreter execd runs on. An image missing from the store is ``ImageNotFound``
  from ``resolve_image``, before any ledger row or process exists.
- a network namespace of its own (``broker.backends.localnet``): nothing in a sandbox
  reaches another sandbox's execd or the host's loopback services. execd serves the
  trainer through a socket the backend binds on 127.0.0.1:<port> of the HOST and passes
  down (``--listen-fd``). Egress follows the job: none when denied, slirp4netns (without
  the host's loopback) when allowed, slirp4netns plus an iptables policy inside the
  sandbox's namespace for a CIDR allow-list.
- CPU and memory are recorded, not enforced (no cgroup delegation on a laptop).

"Pods" survive broker and worker restarts: the process is started in its own session.
Like a pod, a sandbox is findable from durable state written BEFORE it starts, whatever
became of its creator: its record (``state_dir/local-pods/<name>.json``: labels, nonce,
port; fsynced) and the marker on its command line (installation, namespace, name, nonce;
``broker.backends.localprocs``). ``list_*`` report what the kernel shows running (plus
records without a process, as Pending or Failed pods); ``delete`` kills by name and
nonce and confirms by the same scan; the port lock names its sandbox and goes with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from broker import failpoints
from broker.backends import localnet, localprocs, localpyc
from broker.backends.base import (
    EXECD_LAUNCH,
    INBOX,
    LABEL_INSTALLATION,
    LABEL_NONCE,
    MANAGED_BY,
    PodInfo,
    PodSpec,
    PrePullInfo,
    PrePullSpec,
)
from broker.backends.localports import PortLocks
from broker.backends.localroot import SandboxRoot, host_python, image_python, overlay_works
from broker.errors import ImageInvalid, ImageNotFound, KubeConflict, KubeUnavailable
from broker.images import refs
from broker.images.registry import RegistryClient
from broker.images.store import ImageStore
from broker.settings import Settings

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
_SKIP_TOP = frozenset({"proc", "dev", "tmp", "sys", "run", "workspace", "sandman", "lost+found"})
# How long a delete waits for SIGKILLed sandbox processes to vanish from /proc before it
# reports the delete as not confirmed (the provider keeps it pending; the GC retries).
KILL_CONFIRM_S = 10.0
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


def _write_durably(path: Path, meta: dict[str, Any], *, exclusive: bool) -> None:
    """Write ``meta`` as JSON and fsync it and its folder: on disk before anything that
    depends on it happens (a sandbox starts). ``exclusive``: fail if ``path`` exists
    (FileExistsError); otherwise replace it atomically."""
    target = path if exclusive else path.with_suffix(".tmp")
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(target, flags, 0o600)
    try:
        os.write(fd, json.dumps(meta).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    if not exclusive:
        target.replace(path)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


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


class _Fds:
    """The descriptors between the backend and one starting sandbox, and who keeps which.

    The child (bwrap, then execd) gets: the listening socket (``--listen-fd``), the info
    pipe's write end, the token pipe, the block pipe's read end and, with an uplink, the
    sync pipe's write end. The backend keeps: the info pipe's read end, the block pipe's
    write end (written once the uplink is up) and the sync pipe's read end (handed to the
    uplink as its exit-fd). -1: not open."""

    def __init__(self, listener: int) -> None:
        self.listener = listener
        self.info = self.info_read = self.token = -1
        self.block = self.block_write = self.sync = self.sync_read = -1

    def open(self, token: str, *, uplink: bool) -> None:
        self.info_read, self.info = os.pipe()
        self.token = _token_pipe(token)
        self.block, self.block_write = os.pipe()
        if uplink:
            self.sync_read, self.sync = os.pipe()

    def child_ends(self) -> tuple[int, ...]:
        ends = (self.listener, self.info, self.token, self.block, self.sync)
        return tuple(fd for fd in ends if fd >= 0)

    def take_info(self) -> int:
        fd, self.info_read = self.info_read, -1
        return fd

    def close_child_ends(self) -> None:
        for attr in ("info", "token", "block", "sync"):
            self._close(attr)

    def close_parent_ends(self) -> None:
        for attr in ("info_read", "block_write", "sync_read"):
            self._close(attr)

    def _close(self, attr: str) -> None:
        fd = getattr(self, attr)
        if fd >= 0:
            setattr(self, attr, -1)
            with contextlib.suppress(OSError):
                os.close(fd)


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
        self.failpoint = failpoints.armed(settings.failpoint)
        self.mark_root = self.mark_root_of(settings.state_dir)
        self.ports = PortLocks(self.root / ".ports", self._orphaned)
        self.images = ImageStore.at_cache(settings.cache_dir)
        self.registry = RegistryClient.from_setting(settings.registries)
        # sandbox name -> seconds its create spent fetching the image (read once by
        # pull_record in this same process, right after the create)
        self._pulls: dict[str, float] = {}
        # pre-pulls this process made (the store keeps the image; this only lets the
        # reconciler see them held instead of pacing a pull again every pass)
        self._held: dict[str, PrePullInfo] = {}
        self.host_root = host_root
        self.guards = localnet.Guards(self.root)

    @staticmethod
    def mark_root_of(state_dir: Path) -> Path:
        """The prefix of this state dir's sandbox markers; resolved, so that it reads the
        same in every process whatever its cwd or the symlinks on the way."""
        return (Path(state_dir) / "local-pods").resolve()

    def resolve_image(self, image: str, digest: str | None) -> str | None:
        """The local store's digest for ``image``; an image the store lacks but a
        configured registry serves resolves there (HEAD) and is pulled by the create, as
        a node pulls; anything else is ImageNotFound before any row exists."""
        if self.host_root:
            return None
        ref = refs.pinned(image, digest) if digest else image
        try:
            return self.images.resolve(ref)
        except ImageNotFound:
            if not self.registry.serves(ref):
                raise
            return self.registry.resolve(ref)

    def ensure_prepull(self, namespace: str, want: PrePullSpec) -> str:
        """The one "node" is this machine: pull into the store and unpack, ahead."""
        try:
            digest = self.images.resolve(want.image)
        except ImageNotFound:
            if not self.registry.serves(want.image):
                raise
            digest = self.images.pull(self.registry, want.image).digest
        self.images.rootfs(digest)
        name = f"local-{want.job}-{digest}"
        self._held[name] = PrePullInfo(name, want.job, want.image, desired=1, ready=1)
        return name

    def prepulls(self, namespace: str) -> list[PrePullInfo]:
        return sorted(self._held.values(), key=lambda p: p.name)

    def remove_prepull(self, namespace: str, info: PrePullInfo) -> None:
        """Forgets it; the image stays in the store until ``sandman image rm``."""
        self._held.pop(info.name, None)

    def pull_record(self, info: PodInfo) -> PodInfo:
        seconds = self._pulls.pop(info.name, None)
        return dataclasses.replace(
            info,
            pulled=seconds is not None,
            image_pull_s=seconds if seconds is not None else info.image_pull_s,
        )

    # -- guards: the job's egress policy, read by each of its sandboxes' create ---------

    def ensure_job_owner(self, namespace: str, job: str) -> None:
        return None

    def ensure_egress_guard(self, namespace: str, job: str, allow: list[str]) -> None:
        """Record the job's policy (GuardMissing if this host cannot enforce it): every
        sandbox has its own netns, so denial is no uplink, an allow-list is enforced by
        iptables inside the sandbox's namespace (``localnet``)."""
        self.guards.ensure(namespace, job, allow)

    def has_egress_guard(self, namespace: str, job: str) -> bool:
        return self.guards.has(namespace, job)

    # -- pods --------------------------------------------------------------------------

    def _meta_path(self, name: str) -> Path:
        return self.root / f"{name}.json"

    def _workspace(self, name: str) -> Path:
        return self.root / name / "workspace"

    def _inbox(self, name: str) -> Path:
        return self.root / name / "inbox"

    def blob_inbox(self, name: str) -> Path | None:
        """Where a restore hard-links the blobs sandbox ``name`` needs: bound read-only
        at ``INBOX`` inside it (no capability to remount it writable, and a hard link
        cannot cross mounts), so the sandbox reads those blobs and nothing else of the
        store, and can write none of them. Removed with the sandbox."""
        inbox = self._inbox(name)
        return inbox if inbox.is_dir() else None

    def _unpacked(self, spec: PodSpec) -> tuple[Path, list[str]] | None:
        """The image's unpacked root and its ``Env``, resolved ONCE (a tag re-imported
        meanwhile cannot mix two digests), unpacked now if this is its first use (None
        on the benchmark-only host root). Called before the record exists: a first
        unpack takes seconds, and a record without a process all that time would look
        settled to a delete."""
        if self.host_root:
            return None
        try:
            digest = self.images.resolve(spec.image)
        except ImageNotFound:
            if not self.registry.serves(spec.image):
                raise
            started = time.monotonic()
            digest = self.images.pull(self.registry, spec.image).digest
            self.images.rootfs(digest)
            self._pulls[spec.name] = time.monotonic() - started
        rootfs = self.images.rootfs(digest)
        return rootfs, [str(item) for item in self.images.config(digest).get("Env") or []]

    def _unpacked_or_typed(self, spec: PodSpec) -> tuple[Path, list[str]] | None:
        """``_unpacked`` with its failures typed: the image's own (ImageNotFound,
        ImageInvalid, also for a config or manifest that does not parse), or the host's
        (KubeUnavailable: a full disk, a failed unpack)."""
        try:
            return self._unpacked(spec)
        except (ImageNotFound, ImageInvalid):
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ImageInvalid(f"image {spec.image}: {exc}") from exc
        except OSError as exc:
            raise KubeUnavailable(f"cannot unpack image {spec.image}: {exc}") from exc

    def _sandbox_root(self, spec: PodSpec, rootfs: Path) -> SandboxRoot:
        """The sandbox's own writable layer over the unpacked image."""
        root = SandboxRoot(rootfs, self.root / spec.name, overlay=overlay_works(self.root))
        root.prepare()
        return root

    def _image_argv(
        self, spec: PodSpec, mark: str, root: SandboxRoot, image_env: list[str]
    ) -> tuple[list[str], list[str]]:
        """bwrap's first arguments on an image root, and the python that runs execd."""
        assert self.bwrap is not None
        # The marker comes first (localprocs reads the first one), before any option the
        # image or the request's env adds.
        argv = [self.bwrap, *localprocs.marker_args(mark)]
        argv += ["--bind", str(root.merged), "/", "--dev", "/dev", "--proc", "/proc"]
        argv += root.network_files(spec.name[:63], localnet.SLIRP_DNS)
        python = image_python(root.rootfs)
        if python is None:
            hosted = host_python()
            argv += hosted.binds()
            command = hosted.command()
        else:
            command = [python]
        for item in image_env:
            key, sep, value = item.partition("=")
            if sep and key:
                argv += ["--setenv", key, value]
        return argv, command

    def _argv(
        self,
        spec: PodSpec,
        mark: str,
        fds: _Fds,
        workspace: Path,
        *,
        root: SandboxRoot | None = None,
        image_env: list[str] | None = None,
    ) -> list[str]:
        if self.bwrap is None:
            raise KubeUnavailable("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
        if root is not None:
            argv, python = self._image_argv(spec, mark, root, image_env or [])
        else:
            argv, python = self._host_root_argv(mark), [self.python]
        workdir = _workdir(spec.workdir, nested=root is not None)
        argv += ["--tmpfs", "/tmp"]  # noqa: S108 (a private tmpfs inside the sandbox)
        if root is None or not (root.rootfs / workdir.lstrip("/")).is_dir():
            # A workdir the image has (a task's repository) is the image's, in the
            # sandbox's own layer; any other gets an empty workspace of its own.
            argv += ["--bind", str(workspace), workdir]
        argv += [
            "--ro-bind",
            str(self._execd_copy() or self.execd_dir),
            localpyc.SOURCE_MOUNT,
            "--ro-bind",
            str(self._inbox(spec.name)),
            INBOX,
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-net",
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
            str(fds.info),
            # Waits for the uplink (or nothing) before it starts execd.
            "--block-fd",
            str(fds.block),
        ]
        if fds.sync >= 0:  # held open by bwrap, closed for execd: the uplink's exit-fd
            argv += ["--sync-fd", str(fds.sync)]
        for key, value in spec.env.items():
            argv += ["--setenv", key, value]
        argv += ["--", *python, *EXECD_LAUNCH]
        argv += [
            "--listen-fd",
            str(fds.listener),
            "--workdir",
            workdir,
        ]
        return argv

    def _execd_copy(self) -> Path | None:
        """execd with its bytecode for this backend's interpreter (see localpyc): made on
        the first create after an edit of its sources, then found by its key."""
        return localpyc.compiled_copy(self.root, [self.python], self.execd_dir)

    def _host_root_argv(self, mark: str) -> list[str]:
        """The benchmark-only host root: a fresh tmpfs with every top-level host directory
        bound read-only into it, the state dir and $HOME hidden."""
        assert self.bwrap is not None
        argv = [self.bwrap, *localprocs.marker_args(mark)]
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
        """Start the sandbox, its whole identity made durable BEFORE the process exists.

        Order: the marker (validated), a port lock naming the sandbox (with the listening
        socket bound to the port, for execd), the record (``<name>.json``: labels, nonce,
        port, marker; O_EXCL, fsynced), and only then the process, marked on its command
        line. A creator killed at any point leaves nothing that ``list_*`` and ``delete``
        cannot find: before the record, at most a port lock that names a sandbox with no
        record (freed when found stale); after it, a record and perhaps a process, both
        carrying the nonce; after the uplink started, a helper carrying the marker too,
        which exits by itself with the sandbox. The pid written after the start is a
        cache for ``get``, never the way a sandbox is found.
        """
        mark = localprocs.marker(
            self.mark_root, spec.installation, spec.namespace, spec.name, spec.nonce
        )
        meta_path = self._meta_path(spec.name)
        if meta_path.exists():  # O_EXCL below decides; this spares a port claim
            raise KubeConflict(f"local pod {spec.name} exists", status=409)
        egress = self.guards.egress(spec.namespace, spec.job, denied=spec.egress_denied)
        if egress.uplink and shutil.which("slirp4netns") is None:
            raise KubeUnavailable("egress needs slirp4netns here: apt-get install slirp4netns")
        unpacked = self._unpacked_or_typed(spec)  # nothing exists yet if this refuses
        port, listener = self.ports.claim(spec.name)
        meta: dict[str, Any] = {
            "name": spec.name,
            "namespace": spec.namespace,
            "labels": spec.labels(),
            "created_at": dt.datetime.now(dt.UTC).isoformat(),
            "mark": mark,
            "port": port,
            "pid": None,
            "cpu_m": spec.cpu_m,
            "memory_b": spec.memory_b,
            "image": spec.image,
            "egress": (list(egress.allow) or "open") if egress.uplink else "none",
        }
        try:  # O_EXCL: the name is the idempotency key, exactly like a pod name.
            _write_durably(meta_path, meta, exclusive=True)
        except FileExistsError as exc:
            listener.close()
            self.ports.release(port, spec.name)
            raise KubeConflict(f"local pod {spec.name} exists", status=409) from exc
        except OSError as exc:
            listener.close()
            self.ports.release(port, spec.name)
            raise KubeUnavailable(f"cannot record local pod {spec.name}: {exc}") from exc
        fds = _Fds(listener=listener.fileno())
        log = None
        try:
            # Under the record's lock, which a delete holds too: a delete that ran since
            # the record was written (a trainer giving up, the GC) has forgotten it, and
            # nothing may start then; once started, the marker is on the process.
            with self._record_lock(spec.name):
                if not meta_path.exists():
                    raise KubeUnavailable(f"local pod {spec.name} was deleted before it started")
                workspace = self._workspace(spec.name)
                workspace.mkdir(parents=True, exist_ok=True)
                self._inbox(spec.name).mkdir(mode=0o700, exist_ok=True)
                root = None if unpacked is None else self._sandbox_root(spec, unpacked[0])
                image_env = None if unpacked is None else unpacked[1]
                log = (self.root / spec.name / "execd.log").open("ab")
                fds.open(spec.token, uplink=egress.uplink)
                argv = self._argv(spec, mark, fds, workspace, root=root, image_env=image_env)
                proc = subprocess.Popen(
                    root.wrap(argv) if root is not None else argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                    pass_fds=fds.child_ends(),
                    # The token travels in a pipe that execd reads to EOF and closes: not
                    # on the command line (`ps` shows it to every local user), and not in
                    # the environment, which bubblewrap's init (PID 1 in the sandbox)
                    # would keep in its /proc/1/environ for every command to read.
                    env={
                        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                        "LANG": "C.UTF-8",
                        "SANDMAN_EXECD_TOKEN_FD": str(fds.token),
                    },
                )
        except BaseException as exc:  # nothing started: forget all of it, then say why
            fds.close_parent_ends()
            self._forget(spec.name, meta)
            if isinstance(exc, (OSError, ValueError, subprocess.CalledProcessError)):
                raise KubeUnavailable(f"cannot start bwrap: {exc}") from exc
            raise
        finally:
            fds.close_child_ends()
            listener.close()  # execd holds it now (or nothing does)
            if log is not None:
                log.close()
        with _children_lock:
            _children[proc.pid] = proc
        _reap_exited()
        self.failpoint("after-sandbox-start")
        try:
            child = self._read_info(fds.take_info())
        except BaseException:
            fds.close_parent_ends()  # bwrap goes on; the provider's failure path deletes it
            raise
        self._connect(spec, mark, fds, child, egress)
        meta.update(pid=proc.pid, child_pid=child)
        # A cache (without it `get` scans instead), written under the record's lock and
        # only while the record exists: a delete that won the race (a GC settling a
        # create it thought dead) is not undone; its process is then listed from its
        # marker and removed as a late pod.
        with self._record_lock(spec.name), contextlib.suppress(OSError):
            if meta_path.exists():
                _write_durably(meta_path, meta, exclusive=False)
        return self._info(meta)

    def _connect(
        self, spec: PodSpec, mark: str, fds: _Fds, child: int | None, egress: localnet.Egress
    ) -> None:
        """Give the started sandbox its egress (an uplink, an allow-list), then let
        bubblewrap start execd. bwrap waits for this on ``--block-fd``; a creator killed
        meanwhile closes that pipe, and execd starts with no uplink (egress fails
        closed; the GC reclaims the sandbox of a dead creator as any other)."""
        try:
            if egress.uplink:
                if child is None:
                    raise KubeUnavailable(f"local pod {spec.name}: bwrap reported no child pid")
                uplink_log = os.open(
                    self.root / spec.name / "uplink.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND
                )
                try:
                    uplink = localnet.start_uplink(child, fds.sync_read, mark, uplink_log)
                finally:
                    os.close(uplink_log)
                with _children_lock:  # reaped like the sandbox, once it exits with it
                    _children[uplink.pid] = uplink
                self.failpoint("after-uplink-start")
                if egress.filtered:
                    localnet.install_allowlist(child, egress.allow)
        except BaseException as exc:
            with contextlib.suppress(Exception):  # killed while still blocked
                self.delete(spec.namespace, spec.name, spec.nonce)
            fds.close_parent_ends()
            if isinstance(exc, (OSError, subprocess.SubprocessError)):
                raise KubeUnavailable(f"local pod {spec.name}: no uplink: {exc}") from exc
            raise
        localnet.release(fds.block_write)
        fds.close_parent_ends()

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

    def _mark_of(self, meta: dict[str, Any]) -> str:
        return str(
            meta.get("mark")
            or localprocs.marker(
                self.mark_root,
                meta["labels"].get(LABEL_INSTALLATION, "-"),
                meta["namespace"],
                meta["name"],
                meta["labels"].get(LABEL_NONCE, "-"),
            )
        )

    def _processes(self, name: str, nonce: str | None = None) -> list[localprocs.SandboxProcess]:
        return [
            p
            for p in localprocs.scan(self.mark_root)
            if p.name == name and (nonce is None or p.nonce == nonce)
        ]

    def _running(self, meta: dict[str, Any]) -> bool:
        """The recorded pid, if it still carries the sandbox's marker (cheap: the ready
        poll asks this every 20 ms); else a scan, for a sandbox whose creator died before
        it could record the pid."""
        mark = self._mark_of(meta)
        pid = meta.get("pid")
        if pid is not None and localprocs.is_marked(int(pid), mark):
            return True
        return bool(self._processes(meta["name"], meta["labels"].get(LABEL_NONCE)))

    def _info(
        self, meta: dict[str, Any], *, probe: bool = True, running: bool | None = None
    ) -> PodInfo:
        alive = self._running(meta) if running is None else running
        port = meta.get("port")
        # A record without a recorded pid or a process: a create between its record and
        # its start (Pending, like a pod not yet scheduled), or one whose creator died
        # there, which the GC settles by the row's lease.
        pending = not alive and meta.get("pid") is None
        ready = alive and port is not None and probe and _healthz(int(port))
        phase = "Running" if alive else ("Pending" if pending else "Failed")
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
        """Kill every process marked with this name AND nonce, confirm by a scan that none
        is left, then drop the workspace, the port lock and (last) the record.

        The record stays until the processes are confirmed gone, so a failed or
        interrupted delete leaves the sandbox findable for the retry. Concurrent deletes
        of one sandbox (a release and a GC pass) take turns on the record's lock."""
        with self._record_lock(name) as lock:
            meta = self._load(name)
            if meta is not None and meta["labels"].get(LABEL_NONCE) != nonce:
                return False  # replaced under the same name: not the pod the caller owns
            ours = self._processes(name)
            if meta is None and ours and not any(p.nonce == nonce for p in ours):
                return False  # a process of that name with another nonce: not ours
            ours = [p for p in ours if p.nonce == nonce]
            deadline = time.monotonic() + KILL_CONFIRM_S
            while ours:
                localprocs.kill(ours)
                self._reap(meta.get("pid") if meta else None)
                _reap_exited()
                if time.monotonic() >= deadline:
                    raise KubeUnavailable(
                        f"local pod {name}: {len(ours)} processes still alive after SIGKILL"
                    )
                time.sleep(0.02)
                ours = self._processes(name, nonce)
            _reap_exited()  # the uplink, if this process started it
            self._forget(name, meta)
            lock.unlink(missing_ok=True)
        return True

    def _forget(self, name: str, meta: dict[str, Any] | None) -> None:
        """Drop what a sandbox with no process left: workspace, port locks, record."""
        shutil.rmtree(self.root / name, ignore_errors=True)
        for port in self.ports.held_by(name):
            self.ports.release(port, name)
        self._meta_path(name).unlink(missing_ok=True)

    @contextlib.contextmanager
    def _record_lock(self, name: str) -> Iterator[Path]:
        """An exclusive flock on ``.locks/<name>``, yielding its path. A delete removes the
        file while holding it, so a waiter re-checks that the file it locked is still the
        one at the path (else it locks the new one): one file per live sandbox, no pile."""
        locks = self.root / ".locks"
        locks.mkdir(exist_ok=True)
        path = locks / name
        while True:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        try:
            yield path
        finally:
            os.close(fd)

    def _orphaned(self, name: str) -> bool:
        """No record and no process: what a port lock names after its claimer died."""
        return not self._meta_path(name).exists() and not self._processes(name)

    @staticmethod
    def _reap(pid: int | None) -> None:
        with _children_lock:
            proc = _children.pop(pid, None) if pid else None
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2)

    def _listed(self, namespace: str) -> list[PodInfo]:
        """What runs (the scan), joined with the records for labels; plus records whose
        process is gone (Failed) or not started (Pending), as pods that still exist.

        A running sandbox whose record is missing (or names another nonce) is listed from
        its marker alone: installation, name and nonce are enough for the GC to decide."""
        procs: dict[str, localprocs.SandboxProcess] = {}
        for proc in localprocs.scan(self.mark_root):
            if proc.namespace == namespace:
                procs.setdefault(proc.name, proc)
        out = []
        for path in sorted(self.root.glob("*.json")):
            meta = self._load(path.stem)
            if meta is None or meta.get("namespace") != namespace:
                continue
            found = procs.get(meta["name"])
            if found is not None and found.nonce == meta["labels"].get(LABEL_NONCE):
                del procs[meta["name"]]
                out.append(self._info(meta, probe=False, running=True))
            else:
                out.append(self._info(meta, probe=False, running=False))
        for proc in procs.values():
            out.append(
                PodInfo(
                    name=proc.name,
                    namespace=proc.namespace,
                    labels={
                        LABEL_INSTALLATION: proc.installation,
                        LABEL_NONCE: proc.nonce,
                        MANAGED_BY: "sandman-broker",
                    },
                    phase="Running",
                    ready=False,
                    ip="127.0.0.1",
                    node=socket.gethostname(),
                    reason="NoRecord",
                )
            )
        return out

    def list_installation(self, namespace: str, installation: str) -> list[PodInfo]:
        return [p for p in self._listed(namespace) if p.installation == installation]

    def list_all_labelled(self, namespace: str) -> list[PodInfo]:
        return self._listed(namespace)

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
