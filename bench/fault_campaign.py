"""Ownership fault campaign: N randomised trials on kwok nodes through the fault proxy.

    .venv/bin/python bench/fault_campaign.py --trials 1000 --concurrency 4

Needs the local cluster (deploy/localcluster/up.sh) or SANDMAN_TEST_KUBECONFIG, and the
embedded services (sandman services up). Exits non-zero when any invariant is violated.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import kubeconfig_path
from bench.harness.campaign import main_json, run_campaign
from broker.ledger.migrate import upgrade
from broker.local.services import ensure_services
from broker.settings import Settings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    settings = Settings.from_env()
    kubeconfig = kubeconfig_path()
    urls = ensure_services(settings)
    name = f"sandman_campaign_{secrets.token_hex(4)}"
    admin = urls.database_url.replace("+psycopg", "").rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    database_url = urls.database_url.rsplit("/", 1)[0] + "/" + name
    upgrade(database_url)

    def progress(done: int, total: int) -> None:
        if done % max(1, total // 50) == 0 or done == total:
            print(f"\r  trials {done}/{total}", end="", file=sys.stderr, flush=True)

    result = run_campaign(
        kubeconfig=kubeconfig,
        database_url=database_url,
        trials=args.trials,
        concurrency=args.concurrency,
        seed=args.seed,
        state_dir=settings.state_dir,
        progress=progress,
    )
    print(file=sys.stderr)
    print(result.summary())
    if args.json:
        args.json.write_text(main_json(result))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
