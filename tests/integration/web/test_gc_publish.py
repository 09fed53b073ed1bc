"""A GC pass through the root publishes its summary where the admin UI and /metrics read
it (real PostgreSQL, Redis and the local backend)."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from broker.acquire.root import WORKER, Root
from broker.names import GC_LAST_KEY
from broker.settings import Settings
from web import stats

pytestmark = pytest.mark.integration


def test_the_beat_pass_is_published_and_read_back_by_the_ui(
    tmp_path: Path, database_url: str, redis_url: str
) -> None:
    settings = Settings(
        state_dir=tmp_path,
        database_url=database_url,
        redis_url=redis_url,
        installation_id=f"gcpub-{secrets.token_hex(3)}",
    )
    root = Root(settings, WORKER, actor="worker")
    try:
        done = root.gc.run_and_publish(actor=root.actor, by="beat")
        assert done.report.errors == [] and not done.report.skipped_locked
        published = json.loads(root.need_redis().get(GC_LAST_KEY))
        assert published == done.summary and published["by"] == "beat"
        assert stats.gc_last(root.redis()) == published
    finally:
        root.dispose()
