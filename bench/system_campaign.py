"""System fault campaign: the whole stack under random faults while trainers churn sandboxes.

    .venv/bin/python bench/system_campaign.py --duration 600 --trainers 6
    .venv/bin/python bench/system_campaign.py --backend local --duration 600 --trainers 4

The kubernetes backend needs the local cluster (deploy/localcluster/up.sh, or
SANDMAN_TEST_KUBECONFIG); the local one runs bubblewrap sandboxes on this machine. Starts
its own PostgreSQL, Redis, workers and beat in a temporary state dir on free ports; see
bench/harness/syscampaign.py for the faults and invariants. Exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import kubeconfig_path
from bench.harness.syscampaign import FAULT_KINDS, Config, run
from bench.harness.sysstack import LOCAL_FAULT_KINDS


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="workload seconds (600)")
    p.add_argument("--trainers", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gap", type=float, nargs=2, default=(2.0, 5.0), help="seconds between faults")
    p.add_argument("--backend", choices=("kubernetes", "local"), default="kubernetes")
    p.add_argument("--kinds", help="comma-separated fault kinds (default: all the backend has)")
    p.add_argument("--failpoints", default="", help="points crash_at_failpoint cycles through")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--keep", action="store_true", help="keep the state dir (logs) afterwards")
    args = p.parse_args()
    state = Path(tempfile.mkdtemp(prefix="sandman-syscampaign-"))
    kinds = args.kinds or ",".join(LOCAL_FAULT_KINDS if args.backend == "local" else FAULT_KINDS)
    cfg = Config(
        kubeconfig=kubeconfig_path() if args.backend == "kubernetes" else "",
        backend=args.backend,
        state_dir=state,
        duration_s=args.duration,
        trainers=args.trainers,
        seed=args.seed,
        fault_gap_s=tuple(args.gap),
        kinds=tuple(k for k in kinds.split(",") if k),
        failpoints=tuple(f for f in args.failpoints.split(",") if f),
    )
    t0 = time.monotonic()
    result = run(
        cfg,
        progress=lambda s: print(f"[{time.monotonic() - t0:6.1f}s] {s}", file=sys.stderr),
    )
    print(result.summary())
    print(f"logs: {state}" if args.keep or not result.ok else "")
    if args.json:
        args.json.write_text(result.to_json())
    if result.ok and not args.keep:
        import shutil

        shutil.rmtree(state, ignore_errors=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
