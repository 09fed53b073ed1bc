"""The network of a local sandbox: a namespace of its own, and egress only as its job says.

Every local sandbox runs in its own network namespace (bubblewrap ``--unshare-net``):
inside there is a loopback of its own and nothing else, so code in one sandbox reaches
neither another sandbox's execd nor any loopback service of the host (the broker's Redis
and PostgreSQL). execd still serves the trainer on 127.0.0.1:<port> of the HOST: the
backend binds that socket in the host's namespace and execd inherits it
(``--listen-fd``); connections come in through it, nothing goes out through it.

Egress, per job (the guard is a file per job, written by ``ensure_egress_guard`` before
any denied sandbox of the job exists, as the kube backend's NetworkPolicy is):
- ``deny``: nothing more, the namespace has only its loopback;
- ``allow``: an uplink, slirp4netns (user-mode TCP/IP: the sandbox's packets become
  ordinary sockets of the helper on the host), started with ``--disable-host-loopback``
  so that 10.0.2.2 does not lead to the host's 127.0.0.0/8;
- a CIDR allow-list: the uplink plus an iptables OUTPUT policy inside the sandbox's
  namespace (loopback and the listed networks accepted, all else dropped), installed
  before execd starts. The sandbox has no capabilities, so nothing in it can change it.

The uplink is a helper process per sandbox. It dies with the sandbox: its ``--exit-fd``
is a pipe whose only write ends are held by bubblewrap (``--sync-fd``), so the kernel
wakes it when the last sandbox process is gone, whoever killed it. And it is found like
the sandbox: its argv[0] carries the sandbox's marker (``localprocs``), so the scan, the
delete, the GC and ``sandman audit`` see it.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import select
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from broker.backends import localprocs
from broker.errors import GuardMissing, KubeUnavailable

# slirp4netns's fixed user-mode network (--configure): the sandbox is 10.0.2.100 on tap0.
SLIRP_DNS = "10.0.2.3"
SLIRP_TAP = "tap0"
# How long an uplink may take to configure the namespace (it takes ~20 ms).
READY_S = 10.0
_JOB_RE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class Egress:
    """What a sandbox may reach beyond its own loopback."""

    uplink: bool  # an outbound path at all (slirp4netns)
    allow: tuple[str, ...] = ()  # if non-empty: only these networks (iptables)

    @property
    def filtered(self) -> bool:
        return bool(self.allow)


NO_EGRESS = Egress(uplink=False)
OPEN_EGRESS = Egress(uplink=True)


def networks(allow: list[str]) -> tuple[str, ...]:
    """The allow-list as normalised IPv4 networks; GuardMissing for one that is not (the
    uplink has no IPv6, so an IPv6 entry would be a promise the sandbox cannot keep)."""
    out = []
    for item in allow:
        try:
            net = ipaddress.ip_network(str(item).strip(), strict=False)
        except ValueError as exc:
            raise GuardMissing(f"egress allow-list entry {item!r} is not a network") from exc
        if net.version != 4:
            raise GuardMissing(f"egress allow-list entry {item}: the local backend has no IPv6")
        out.append(str(net))
    return tuple(sorted(set(out)))


class Guards:
    """Per-job egress guards of one state dir: ``<root>/.egress/<namespace>.<job>.json``."""

    def __init__(self, root: Path) -> None:
        self.folder = root / ".egress"

    def _path(self, namespace: str, job: str) -> Path:
        return self.folder / f"{_JOB_RE.sub('_', namespace)}.{_JOB_RE.sub('_', job)}.json"

    def ensure(self, namespace: str, job: str, allow: list[str]) -> None:
        """Record the job's denied-egress policy; GuardMissing if this host cannot keep it."""
        nets = networks(allow)
        if nets and shutil.which("iptables-restore") is None:
            raise GuardMissing("egress allow-lists need iptables: apt-get install iptables")
        if nets and shutil.which("slirp4netns") is None:
            raise GuardMissing("egress allow-lists need slirp4netns: apt-get install slirp4netns")
        if nets and os.geteuid() != 0:
            raise GuardMissing("egress allow-lists need root (iptables in the sandbox's netns)")
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(namespace, job)
        # Per thread, not per process: a worker's threads record one job's guard at once.
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({"allow": list(nets)}))
        tmp.replace(path)

    def has(self, namespace: str, job: str) -> bool:
        return self._path(namespace, job).exists()

    def egress(self, namespace: str, job: str, *, denied: bool) -> Egress:
        """What a sandbox of this job gets: everything unless denied; if denied, its
        guard's allow-list, and nothing at all when the guard is missing or unreadable
        (fail closed)."""
        if not denied:
            return OPEN_EGRESS
        try:
            data = json.loads(self._path(namespace, job).read_text())
            allow = tuple(str(n) for n in data.get("allow") or [])
        except (OSError, ValueError, AttributeError):
            return NO_EGRESS
        return Egress(uplink=True, allow=allow) if allow else NO_EGRESS


def ruleset(allow: tuple[str, ...]) -> str:
    """The iptables-restore input of an allow-list: loopback and ``allow`` out, all else
    refused (and dropped by the policy; forwarding too; input is left open, replies need
    it)."""
    lines = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD DROP [0:0]", ":OUTPUT DROP [0:0]"]
    lines.append("-A OUTPUT -o lo -j ACCEPT")
    lines += [f"-A OUTPUT -d {net} -j ACCEPT" for net in allow]
    # Refused at once rather than dropped: a denied connect fails fast, as on a cluster
    # whose NetworkPolicy engine rejects, instead of hanging for the TCP timeout.
    lines += ["-A OUTPUT -p tcp -j REJECT --reject-with tcp-reset", "-A OUTPUT -j REJECT"]
    return "\n".join([*lines, "COMMIT", ""])


def _wait_ready(proc: subprocess.Popen[bytes], ready_fd: int) -> None:
    deadline = time.monotonic() + READY_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KubeUnavailable(f"slirp4netns not ready after {READY_S:.0f}s")
        readable, _, _ = select.select([ready_fd], [], [], min(left, 0.5))
        if readable:
            if os.read(ready_fd, 1) == b"1":
                return
            raise KubeUnavailable(f"slirp4netns exited before it was ready (rc {proc.poll()})")
        if proc.poll() is not None:
            raise KubeUnavailable(f"slirp4netns exited before it was ready (rc {proc.returncode})")


def wait_loopback(child_pid: int) -> None:
    """Wait until bubblewrap has set up the loopback of ``child_pid``'s namespace.

    bubblewrap adds 127.0.0.1 to ``lo`` and then brings it up, in the sandbox's init,
    after it has reported the init's pid; slirp4netns brings ``lo`` up too, and if it
    wins that race the kernel adds 127.0.0.1 itself and bubblewrap's own add fails
    (``loopback: Failed RTM_NEWADDR``: the sandbox dies at start, about 1 in 25 under
    concurrent creates). The namespace's routing table (``/proc/<pid>/net/fib_trie``)
    lists 127.0.0.1 only once ``lo`` is addressed and up, i.e. once bubblewrap is done."""
    deadline = time.monotonic() + READY_S
    while True:
        try:
            if "127.0.0.1" in Path(f"/proc/{child_pid}/net/fib_trie").read_text():
                return
        except OSError as exc:
            raise KubeUnavailable(f"the sandbox's init {child_pid} is gone: {exc}") from exc
        if time.monotonic() >= deadline:
            raise KubeUnavailable(f"the sandbox's loopback is not up after {READY_S:.0f}s")
        time.sleep(0.002)


NS_GET_USERNS = 0xB701  # ioctl: the user namespace that owns a namespace


def _owner_userns(child_pid: int) -> int:
    """A descriptor of the user namespace owning ``child_pid``'s network namespace.

    Unprivileged, bubblewrap creates the network namespace in a user namespace of its
    own (not the one its init ends up in): slirp4netns must join that one to enter the
    network namespace. As root there is none to join (the host's own)."""
    netns = os.open(f"/proc/{child_pid}/ns/net", os.O_RDONLY)
    try:
        return int(fcntl.ioctl(netns, NS_GET_USERNS))
    finally:
        os.close(netns)


def start_uplink(child_pid: int, exit_fd: int, mark: str, log: int) -> subprocess.Popen[bytes]:
    """Start the slirp4netns of the sandbox whose namespace holds ``child_pid`` and wait
    until it has configured tap0. ``exit_fd`` is the read end of the sandbox's sync pipe:
    the helper exits when it reads EOF there. Its argv[0] is the sandbox's marker."""
    slirp = shutil.which("slirp4netns")
    if slirp is None:
        raise KubeUnavailable("egress needs slirp4netns: apt-get install slirp4netns")
    wait_loopback(child_pid)
    userns = -1 if os.geteuid() == 0 else _owner_userns(child_pid)
    extra = [f"--userns-path=/proc/self/fd/{userns}"] if userns >= 0 else []
    ready_r, ready_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [
                localprocs.helper_argv0(mark),
                "--configure",
                "--mtu=65520",
                "--disable-host-loopback",
                *extra,
                f"--exit-fd={exit_fd}",
                f"--ready-fd={ready_w}",
                str(child_pid),
                SLIRP_TAP,
            ],
            executable=slirp,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            pass_fds=(exit_fd, ready_w, *([userns] if userns >= 0 else [])),
        )
        os.close(ready_w)
        ready_w = -1
        try:
            _wait_ready(proc, ready_r)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        return proc
    finally:
        for fd in (ready_r, ready_w, userns):
            if fd >= 0:
                os.close(fd)


def install_allowlist(child_pid: int, allow: tuple[str, ...]) -> None:
    """Load ``ruleset(allow)`` into the namespace of ``child_pid`` (before execd starts)."""
    nsenter = shutil.which("nsenter")
    restore = shutil.which("iptables-restore")
    if nsenter is None or restore is None:
        raise GuardMissing("egress allow-lists need nsenter and iptables-restore")
    try:
        subprocess.run(
            [nsenter, f"--net=/proc/{child_pid}/ns/net", restore],
            input=ruleset(allow).encode(),
            capture_output=True,
            check=True,
            timeout=READY_S,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        raise KubeUnavailable(
            f"cannot load the egress allow-list: {exc} {detail.decode(errors='replace')}"
        ) from exc


def release(block_fd: int) -> None:
    """Let bubblewrap go on to start execd (it waits on ``--block-fd``)."""
    with contextlib.suppress(OSError):
        os.write(block_fd, b"1")
