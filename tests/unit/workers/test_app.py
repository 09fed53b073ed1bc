"""The Celery app's configuration starts nothing: URLs come from settings or the file
``sandman services up`` records; with neither, a clear ConfigError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from broker.errors import ConfigError
from broker.local.services import urls_file
from broker.settings import Settings
from workers.app import celery_config

pytestmark = pytest.mark.unit


def test_no_redis_url_is_a_config_error_not_a_started_service(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sandman services up"):
        celery_config(Settings(state_dir=tmp_path))
    assert not (tmp_path / "redis").exists()


def test_the_recorded_embedded_redis_is_used(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path)
    urls_file(settings).parent.mkdir(parents=True)
    urls_file(settings).write_text(json.dumps({"redis_url": "redis://127.0.0.1:1/0"}))
    config = celery_config(settings)
    assert config["broker_url"] == "redis://127.0.0.1:1/0"
    assert config["accept_content"] == ["json"]
    explicit = celery_config(Settings(state_dir=tmp_path, redis_url="redis://elsewhere:6379/2"))
    assert explicit["broker_url"] == "redis://elsewhere:6379/2"
