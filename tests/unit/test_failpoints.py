"""Failpoints: empty is a no-op, a typo is refused at start, an armed point exits."""

from __future__ import annotations

import subprocess
import sys

import pytest

from broker import failpoints
from broker.errors import ConfigError
from broker.settings import Settings

pytestmark = pytest.mark.unit


def test_unarmed_points_do_nothing() -> None:
    assert failpoints.armed("") is failpoints.off
    assert failpoints.armed(" , ") is failpoints.off
    for name in failpoints.POINTS:
        failpoints.off(name)


def test_an_unknown_name_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="after-sandbox-strat"):
        failpoints.armed("after-intent,after-sandbox-strat")


def test_an_armed_point_ends_the_process_there_and_only_there() -> None:
    code = (
        "from broker import failpoints\n"
        "hit = failpoints.armed('after-sandbox-start')\n"
        "hit('after-intent')\n"
        "print('passed the unarmed point', flush=True)\n"
        "hit('after-sandbox-start')\n"
        "print('never printed')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == failpoints.EXIT_CODE
    assert done.stdout == "passed the unarmed point\n"


def test_settings_read_the_variable() -> None:
    settings = Settings.from_env({"SANDMAN_FAILPOINT": "after-intent"})
    assert settings.failpoint == "after-intent"
