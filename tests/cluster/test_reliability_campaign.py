"""A short system fault campaign on the local cluster (the long one: bench/system_campaign.py).

Own stack (embedded PostgreSQL and Redis on free ports, Celery workers and beat as
subprocesses), trainers as subprocesses on kwok nodes, every fault kind injected at least
once, and every invariant must read 0. See bench/harness/syscampaign.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.harness.syscampaign import Config, run
from bench.harness.sysstack import KUBE_FAULT_KINDS

pytestmark = pytest.mark.cluster


def test_short_system_campaign_keeps_every_invariant(kubeconfig_path: str, tmp_path: Path):
    cfg = Config(
        kubeconfig=kubeconfig_path,
        state_dir=tmp_path / "campaign",
        # the kube fault kinds, each at least once: crash_at_failpoint restarts a worker twice
        # (armed, then normal), so the round needs about 25 s more than the other eight.
        duration_s=80.0,
        trainers=3,
        seed=7,
        fault_gap_s=(1.0, 2.5),
    )
    cfg.state_dir.mkdir()
    result = run(cfg, progress=print)
    print(result.summary())
    assert result.ok, result.summary()
    # every kind that applies to kwok pods (flood_execd needs a live execd: local only)
    assert set(result.faults) == set(KUBE_FAULT_KINDS), result.summary()
    assert result.answers["lease"] > 0, result.summary()
