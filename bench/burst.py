"""Burst run: 1,000 acquires submitted within one second; the pacer must spread them.

    .venv/bin/python bench/burst.py [--n 1000] [--rate 50] [--burst 10]

Same full stack and kwok nodes as bench/scale.py (simulated readiness: kwok pods run no
execd). All acquires are built and enqueued at once (pipelined kombu publish batches); the
shared pacer admits them at ``rate`` creates/s after ``burst``. Checks: every request
gets a lease (none lost); no API errors (every create answered 201 at its first try);
the achieved create rate vs the configured one; the most creates in any 1-s window vs
``rate + burst``; the worst excess over ``rate*t + burst`` in any window. Then releases
everything and checks for leaks. Writes bench/out/burst.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import threading
import time
from typing import Any

from scale import OUT, Harness, achieved_rate, rate_series, summary


def windows(stamps: list[float], rate: float, burst: int) -> tuple[int, float]:
    s = sorted(stamps)
    worst, j = 0, 0
    for i in range(len(s)):
        while j < len(s) and s[j] - s[i] < 1.0:
            j += 1
        worst = max(worst, j - i)
    excess = max(
        (b - a + 1) - (rate * (s[b] - s[a]) + burst)
        for a in range(len(s))
        for b in range(a, min(len(s), a + 4 * burst + 200))
    )
    return worst, excess


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--burst", type=int, default=10)
    parser.add_argument("--max-concurrent", type=int, default=256)
    parser.add_argument("--waiters", type=int, default=128)
    parser.add_argument("--extra-acquire-workers", type=int, default=0)
    parser.add_argument("--extra-release-workers", type=int, default=0)
    parser.add_argument("--release-timeout", type=float, default=900)
    parser.add_argument("--keep-namespace", action="store_true")
    args = parser.parse_args()
    tag = f"burst-{dt.datetime.now(dt.UTC):%m%d%H%M}"
    h = Harness(args, tag)
    doc: dict[str, Any] = {"tag": tag, "args": vars(args), "readiness": "SIMULATED (kwok)"}
    try:
        # Built and enqueued inside the timed second: pipelined publishes (kombu batches).
        t0 = time.time()
        reqs = [h.request(timeout=900) for _ in range(args.n)]
        h.client.send_many("sandman.acquire", [[r] for r in reqs], "acquire")
        doc["submit_s"] = time.time() - t0
        print(f"{args.n} acquires enqueued in {doc['submit_s']:.3f}s", flush=True)
        held: list[Any] = []
        errors: list[str] = []
        lat: list[float] = []
        lock = threading.Lock()
        series: list[dict[str, Any]] = []
        tick = h.progress_printer("burst", series)
        it = iter(reqs)

        def waiter() -> None:
            while True:
                with lock:
                    req = next(it, None)
                if req is None:
                    return
                try:
                    sb = h.client._wait(req)
                except Exception as exc:
                    with lock:
                        errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                with lock:
                    held.append(sb)
                    lat.append(sb.acquire_s)

        threads = [threading.Thread(target=waiter, daemon=True) for _ in range(args.waiters)]
        for t in threads:
            t.start()
        mono0 = time.monotonic()
        while any(t.is_alive() for t in threads):
            tick(args.n, len(held), len(errors), mono0)
            time.sleep(0.5)
        doc["wall_s"] = time.time() - t0
        rows = h.ledger_rows()
        stamps = [r["creating_at"] for r in rows if r["creating_at"]]
        worst, excess = windows(stamps, args.rate, args.burst)
        outcomes = h.api_outcomes()
        doc.update(
            delivered=len(held),
            lost=args.n - len(held) - len(errors),
            errors=len(errors),
            error_samples=errors[:10],
            api_outcomes=outcomes,
            api_errors=sum(
                v for k, v in outcomes.items() if k not in ("create:created", "ready:observed")
            ),
            creates=len(stamps),
            configured_rate=args.rate,
            achieved_rate=achieved_rate(stamps, args.burst),
            span_s=max(stamps) - min(stamps) if stamps else 0.0,
            max_in_1s=worst,
            limit_1s=args.rate + args.burst,
            worst_excess=excess,
            create_rate_series=rate_series(stamps, t0, 1.0),
            client_acquire_s=summary(lat),
            create_to_ready_s=summary(
                [r["create_to_ready_s"] for r in rows if r["create_to_ready_s"] is not None]
            ),
            acquire_latency_s=summary(
                [r["acquire_latency_s"] for r in rows if r["acquire_latency_s"] is not None]
            ),
            usage=h.meter.totals(),
            progress=series,
        )
        print(
            f"delivered {len(held)}/{args.n}, lost {doc['lost']}, errors {len(errors)}, "
            f"API errors {doc['api_errors']}; achieved {doc['achieved_rate']:.2f}/s vs "
            f"{args.rate}/s; max in 1 s {worst} (limit {args.rate + args.burst:g}); "
            f"worst excess {excess:+.2f}",
            flush=True,
        )
        doc["release_wall_s"] = h.release_all(held, "release", [])
        doc["leaks_after"] = h.leaks()
        print(f"after teardown: {doc['leaks_after']}", flush=True)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "burst.json").write_text(json.dumps(doc, indent=1, default=str))
        print(f"wrote {OUT / 'burst.json'}", flush=True)
    finally:
        h.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
