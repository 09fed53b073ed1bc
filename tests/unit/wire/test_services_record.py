"""The state dir's services record: URLs and the ports the state dir owns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from broker.errors import ConfigError
from broker.settings import Settings
from broker.wire.services import known_urls, recorded_port, urls_file

pytestmark = pytest.mark.unit


def _write(settings: Settings, text: str) -> None:
    urls_file(settings).parent.mkdir(parents=True, exist_ok=True)
    urls_file(settings).write_text(text)


def test_recorded_ports_are_read_and_anything_else_is_no_port(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path)
    assert recorded_port(settings, "postgres") == 0  # no record yet
    _write(settings, json.dumps({"redis_url": "redis://r/0", "ports": {"postgres": 40001}}))
    assert recorded_port(settings, "postgres") == 40001
    assert recorded_port(settings, "redis") == 0
    assert known_urls(settings).redis_url == "redis://r/0"  # one record for both
    for garbage in (
        '{"ports": {"postgres": "40001"}}',
        '{"ports": {"postgres": 70000}}',
        '{"ports": [1]}',
        "[]",
        "{not json",
    ):
        _write(settings, garbage)
        assert recorded_port(settings, "postgres") == 0, garbage


def test_embedded_ports_default_to_chosen_per_state_dir_and_must_be_ports() -> None:
    assert Settings().embedded_pg_port == Settings().embedded_redis_port == 0
    assert Settings.from_env({"SANDMAN_EMBEDDED_PG_PORT": "15461"}).embedded_pg_port == 15461
    with pytest.raises(ConfigError, match="SANDMAN_EMBEDDED_REDIS_PORT"):
        Settings(embedded_redis_port=70000)
