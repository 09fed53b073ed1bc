"""Pre-pull: the images a job will start are on its nodes before its first create.

A create that must pull is the paper's largest cold-start cost (17.4 s median against
4.1 s with the image on the node). Every job's warm-pool images and the images it
declares hot (``sandman job create --hot-image``) are resolved to their digest and pulled
ahead by the backend (a DaemonSet per job and image on Kubernetes, held so the kubelet's
image GC keeps it; a store pull on the local backend), then kept while the job wants
them and removed once it no longer does.

Paced like creates: a new pre-pull takes a token from the job's pacer (its pods start
pulls on every matching node at once; the node's runtime shares one pull per image).
Run by the pool-upkeep beat; a pass never waits for pulls to finish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker.backends.base import Backend, PrePullSpec
from broker.errors import (
    ImageInvalid,
    ImageNotFound,
    KubeError,
    RegistryUnavailable,
)
from broker.images import refs
from broker.ledger.models import Job
from broker.pacing import Limits, Pacer
from broker.pools.store import parse_pools
from broker.settings import Settings

log = logging.getLogger(__name__)
PACE_WAIT_S = 1.0  # a new pre-pull waits at most this long for a token, else next pass


@dataclass(eq=False)
class PrePull:
    settings: Settings
    sessions: sessionmaker[Session]
    backend: Backend
    pacer: Pacer | None
    limits: Callable[[Job], Limits]

    def wanted(self) -> tuple[list[tuple[PrePullSpec, Job]], int]:
        """Every (job, pinned image) to hold, and how many images did not resolve."""
        out: list[tuple[PrePullSpec, Job]] = []
        unresolved = 0
        with self.sessions() as session:
            jobs = list(session.scalars(select(Job)))
            for job in jobs:
                session.expunge(job)
        for job in sorted(jobs, key=lambda j: j.name):
            if (job.node_selector or {}).get("type") == "kwok":
                continue  # simulated nodes run no image
            images: set[tuple[str, str | None]] = {(i, None) for i in job.hot_images or []}
            images |= {(p.image, p.image_digest) for p in parse_pools(job.warm_pools)}
            for image, digest in sorted(images, key=lambda x: (x[0], x[1] or "")):
                try:
                    resolved = self.backend.resolve_image(image, digest)
                except (ImageNotFound, ImageInvalid, RegistryUnavailable) as exc:
                    log.warning("pre-pull of %s for job %s: %s", image, job.name, exc)
                    unresolved += 1
                    continue
                pinned = refs.pinned(image, resolved) if resolved else image
                wanted = PrePullSpec(
                    job.name, pinned, dict(job.node_selector or {}), list(job.tolerations or [])
                )
                out.append((wanted, job))
        return out, unresolved

    def reconcile(self) -> dict[str, int]:
        namespace = self.settings.namespace
        wanted, unresolved = self.wanted()
        counts = {"held": 0, "created": 0, "removed": 0, "unresolved": unresolved, "failed": 0}
        have = {(p.job, p.image): p for p in self.backend.prepulls(namespace)}
        for item, job in wanted:
            if (item.job, item.image) in have:
                counts["held"] += 1
                continue
            if not self._paced(job):
                continue
            try:
                self.backend.ensure_prepull(namespace, item)
                counts["created"] += 1
            except (KubeError, ImageNotFound, ImageInvalid, RegistryUnavailable, OSError) as exc:
                log.warning("pre-pull of %s for job %s failed: %s", item.image, item.job, exc)
                counts["failed"] += 1
        keep = {(w.job, w.image) for w, _ in wanted}
        for key, info in have.items():
            if key not in keep:
                try:
                    self.backend.remove_prepull(namespace, info)
                    counts["removed"] += 1
                except KubeError as exc:
                    log.warning("removing pre-pull %s failed: %s", info.name, exc)
        return counts

    def _paced(self, job: Job) -> bool:
        """A create token for a new pre-pull, if one is due within PACE_WAIT_S; else the
        next pass asks again. Never a long wait: the pass runs on the pool queue, and
        trims and refills must not queue behind a pre-pull."""
        if self.pacer is None:
            return True
        wait = self.pacer.reserve(self.limits(job), max_wait=PACE_WAIT_S)
        if wait is None:
            return False
        if wait > 0:
            time.sleep(wait)
        return True
