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
import queue
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import achieved_rate, pacing_windows, rate_series, save, summary
from bench.kube_stack import Harness, column, stack_arguments
from broker.names import Queue, Task


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000)
    stack_arguments(parser, rate=50.0, burst=10, waiters=128, release_timeout=900)
    args = parser.parse_args()
    tag = f"burst-{dt.datetime.now(dt.UTC):%m%d%H%M}"
    doc: dict[str, Any] = {"tag": tag, "args": vars(args), "readiness": "SIMULATED (kwok)"}
    with Harness(args, tag) as h:
        # Built and enqueued inside the timed second: pipelined publishes (kombu batches).
        t0 = time.time()
        reqs = [h.request(timeout=900) for _ in range(args.n)]
        h.client.send_many(Task.ACQUIRE, [[r] for r in reqs], Queue.ACQUIRE)
        doc["submit_s"] = time.time() - t0
        print(f"{args.n} acquires enqueued in {doc['submit_s']:.3f}s", flush=True)
        todo: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        for req in reqs:
            todo.put(req)
        got = h.collect(todo, args.waiters)
        for _ in got.threads:
            todo.put(None)
        series: list[dict[str, Any]] = []
        h.wait_collected(got, args.n, time.monotonic(), h.progress_printer("burst", series))
        held, errors = got.held, got.errors
        doc["wall_s"] = time.time() - t0
        rows = h.ledger_rows()
        stamps = column(rows, "creating_at")
        worst, excess = pacing_windows(stamps, args.rate, args.burst)
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
            client_acquire_s=summary(got.latency_s),
            create_to_ready_s=summary(column(rows, "create_to_ready_s")),
            acquire_latency_s=summary(column(rows, "acquire_latency_s")),
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
        h.release_and_check(held, doc)
        save("burst", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
