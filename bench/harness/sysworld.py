"""Where a system campaign's sandboxes live, and an independent count of them.

``KubeWorld``: kwok pods on the local cluster, the broker talking to it through the fault
proxy, sentinel pods planted beside them. ``LocalWorld``: bubblewrap sandboxes on this
machine, each running the real execd. Each world answers "which sandboxes of this
campaign exist right now" WITHOUT the broker's backend code (the cluster read directly
rather than through the proxy; the kernel's process list read by a scan of our own), so
the campaign can check that ``sandman audit`` agrees with what really runs.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from bench.harness.sysstack import JOB, KUBE_FAULT_KINDS, LOCAL_FAULT_KINDS, Config, Stack

# Which worker reaches which failpoint: creates run on the acquire worker, releases and
# their deletes on the control worker.
CREATE_POINTS = (
    "after-intent",
    "after-creating-commit",
    "after-create-sent",
    "before-ready-commit",
)
RELEASE_POINTS = ("after-releasing-commit", "after-delete-sent")


def running_local_sandboxes(state_dir: Path) -> set[str]:
    """Pod names with a live bubblewrap process or egress uplink of this state dir, from
    the kernel's process list alone: every version of the local backend binds
    ``<state>/local-pods/<name>/workspace`` on bubblewrap's command line, and an uplink
    (slirp4netns) has ``SANDMAN_SANDBOX=<state>/local-pods/<inst>/<ns>/<name>/<nonce>`` as
    its argv[0] (zombies have no command line, so a dead sandbox its parent has not reaped
    yet does not count)."""
    base = os.fsencode(str(Path(state_dir).resolve() / "local-pods")) + b"/"
    helper = b"SANDMAN_SANDBOX=" + base
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args[0].startswith(helper) and len(args[0][len(helper) :].split(b"/")) == 4:
            found.add(os.fsdecode(args[0][len(helper) :].split(b"/")[2]))
            continue
        if not args[0].endswith(b"bwrap"):
            continue
        for arg in args:
            if arg.startswith(base) and arg.endswith(b"/workspace"):
                found.add(os.fsdecode(arg[len(base) : -len(b"/workspace")]))
    return found


class KubeWorld:
    """kwok pods on the local cluster, behind the fault proxy."""

    kinds_allowed: tuple[str, ...] | None = KUBE_FAULT_KINDS
    points = CREATE_POINTS + RELEASE_POINTS

    def __init__(self, cfg: Config, stack: Stack) -> None:
        from bench.harness.faultproxy import FaultProxy
        from broker.backends.kube.api import Kube, load_api_client

        self.cfg, self.stack = cfg, stack
        self.admin = Kube(load_api_client(cfg.kubeconfig))
        self.admin.ensure_namespace(stack.namespace)
        self.proxy: Any = FaultProxy.from_kubeconfig(cfg.kubeconfig, seed=cfg.seed).start()
        stack.proxy_kubeconfig = str(
            self.proxy.write_kubeconfig(cfg.state_dir / "proxy.kubeconfig")
        )
        self.sentinels: set[str] = set()

    def setup(self, sessions: Any) -> None:
        from bench.kwok import ensure_kwok_job, plant_sentinels

        with sessions.begin() as s:
            ensure_kwok_job(
                s, JOB, readiness_budget_s=self.cfg.readiness_budget_s, lease_s=self.cfg.lease_s
            )
        self.sentinels = set(
            plant_sentinels(
                self.admin, self.stack.namespace, self.stack.installation, self.cfg.sentinels
            )
        )

    def lost_sentinels(self) -> set[str]:
        """Planted sentinels no longer on the cluster (some carry another installation's
        label value, so every installation is listed)."""
        from broker.backends.kube.backend import KubeBackend

        pods = KubeBackend(self.admin, installation="-").list_all_labelled(self.stack.namespace)
        return self.sentinels - {p.name for p in pods}

    def backend(self) -> Any:
        """A backend for the final GC and audit: straight to the cluster, not the proxy."""
        from broker.backends.kube.backend import KubeBackend

        settings = self.stack.settings
        return KubeBackend.from_settings(
            settings.__class__(**{**settings.__dict__, "kubeconfig": self.cfg.kubeconfig})
        )

    def running(self) -> set[str]:
        from broker.backends.kube.backend import KubeBackend

        pods = KubeBackend(self.admin, installation="-").list_all_labelled(self.stack.namespace)
        return {p.name for p in pods if p.installation == self.stack.installation}

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            self.proxy.stop()
        with contextlib.suppress(Exception):
            self.admin.delete_namespace(self.stack.namespace)


class LocalWorld:
    """Bubblewrap sandboxes on this machine: no API server, so no proxy faults."""

    kinds_allowed: tuple[str, ...] | None = LOCAL_FAULT_KINDS
    points = (
        *CREATE_POINTS[:2],
        "after-sandbox-start",
        "after-uplink-start",
        *CREATE_POINTS[2:],
        *RELEASE_POINTS,
    )
    proxy = None
    sentinels: set[str] = set()

    def __init__(self, cfg: Config, stack: Stack) -> None:
        self.cfg, self.stack = cfg, stack

    def setup(self, sessions: Any) -> None:
        from broker.ledger import store

        with sessions.begin() as s:
            store.ensure_job(
                s, JOB, readiness_budget_s=self.cfg.readiness_budget_s, lease_s=self.cfg.lease_s
            )

    def lost_sentinels(self) -> set[str]:
        return set()

    def backend(self) -> Any:
        from broker.backends.local import LocalBackend

        return LocalBackend(self.stack.settings)

    def execd_ports(self) -> list[int]:
        """The host-side ports of the sandboxes' execd that run now (flood targets)."""
        from bench.harness.execdflood import live_execd_ports

        return live_execd_ports(Path(self.stack.settings.state_dir) / "local-pods")

    def running(self) -> set[str]:
        return running_local_sandboxes(self.cfg.state_dir)

    def teardown(self) -> None:
        """Whatever still runs of this campaign's sandboxes (a failed run) dies here."""
        from broker.local.reclaim import kill_all, marked_processes

        kill_all(marked_processes(self.cfg.state_dir))


def make_world(cfg: Config, stack: Stack) -> KubeWorld | LocalWorld:
    return LocalWorld(cfg, stack) if cfg.backend == "local" else KubeWorld(cfg, stack)
