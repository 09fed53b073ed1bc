"""The test environment scrub keeps the run's own locations and drops everything else."""

import pytest

from tests.support.env import scrub

pytestmark = pytest.mark.unit


def test_scrub_drops_stray_sandman_variables_and_keeps_the_runs_own() -> None:
    environ = {
        "SANDMAN_BACKEND": "kubernetes",
        "SANDMAN_NAMESPACE": "prod",
        "SANDMAN_STATE_DIR": "/state",
        "SANDMAN_EMBEDDED_PG_PORT": "15444",
        "SANDMAN_TEST_KUBECONFIG": "/kc",
        "CI": "true",
        "HOME": "/home/u",
    }
    assert scrub(environ) == ["SANDMAN_BACKEND", "SANDMAN_NAMESPACE"]
    assert environ == {
        "SANDMAN_STATE_DIR": "/state",
        "SANDMAN_EMBEDDED_PG_PORT": "15444",
        "SANDMAN_TEST_KUBECONFIG": "/kc",
        "CI": "true",
        "HOME": "/home/u",
    }
