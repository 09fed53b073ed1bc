"""What the beat and the operators (admin UI, CLI) do in one call each: a GC pass with its
published summary, and an operator's release of one sandbox.

Why here and not in the callers: the beat task, the admin UI and ``sandman gc`` used to run
the GC and then write Redis (and the UI the audit log) themselves, each its own way. The
workers stay thin and the web never writes the ledger when both call this instead.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from broker.errors import InvalidRequest
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.names import GC_LAST_KEY
from broker.ownership.gc import GcReport, run_gc, summarize
from broker.ownership.provider import Provider


@dataclass(frozen=True)
class GcPass:
    report: GcReport
    summary: dict[str, object]  # what the admin UI and /metrics show (``gc.summarize``)


class GcRunner:
    """GC passes as some actor. ``provider`` gives the Provider acting as a name, ``redis``
    a client or None: a pass whose summary cannot be published still counts."""

    def __init__(
        self, provider: Callable[[str], Provider], redis: Callable[[], Any | None]
    ) -> None:
        self._provider = provider
        self._redis = redis

    def run(self, *, actor: str, dry_run: bool = False) -> GcReport:
        """One pass, nothing published (``sandman gc`` prints its report instead)."""
        return run_gc(self._provider(actor), dry_run=dry_run)

    def run_and_publish(
        self, *, actor: str, by: str | None = None, dry_run: bool = False, audit: bool = False
    ) -> GcPass:
        """One pass; its summary becomes the latest one in Redis unless another pass held
        the lock. ``audit`` also records the pass as an admin event (an operator ran it)."""
        provider = self._provider(actor)
        report = run_gc(provider, dry_run=dry_run)
        summary = summarize(report, by=by or actor)
        if audit:
            with provider.sessions.begin() as session:
                store.append_event(
                    session,
                    None,
                    kind="admin",
                    action="gc-pass",
                    outcome="dry-run" if dry_run else "ok",
                    actor=actor,
                    detail=summary,
                )
        redis = self._redis()
        if redis is not None and not report.skipped_locked:
            # The pass itself succeeded; losing only its summary (Redis down) is fine.
            with contextlib.suppress(Exception):
                redis.set(GC_LAST_KEY, json.dumps(summary))
        return GcPass(report, summary)


def release_by_operator(provider: Provider, sandbox_id: str) -> None:
    """An operator's release: audited as their request, then the provider's release with
    ``creator_gone`` (whoever acquired it no longer decides). The provider's actor is the
    operator, so every row it writes names them."""
    with provider.sessions.begin() as session:
        row = session.get(Sandbox, sandbox_id)
        if row is None:
            raise InvalidRequest(f"no sandbox {sandbox_id!r}")
        store.append_event(
            session,
            row,
            kind="admin",
            action="release",
            outcome="requested",
            actor=provider.actor,
            detail={"from_state": str(row.state)},
        )
    provider.release(sandbox_id, actor=provider.actor, reason="admin-release", creator_gone=True)
