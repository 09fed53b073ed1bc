"""Every worker process sweeps the idle deadlines as the earliest one comes due, and at
least once every ``Settings.idle_sweep_s`` (1 s).

A thread, not a beat task: reclaim latency must not wait behind a queue (the pool queue
also runs GC passes and refills), and a sweep with nothing due is one Redis call. Several
workers sweeping at once share the work safely: each claims the entries it judges
(``broker.acquire.idle``); one of them at a time also runs the reconcile.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery.signals import worker_ready, worker_shutdown

from broker.settings import Settings
from workers.runtime import broker

log = logging.getLogger(__name__)
_stop = threading.Event()


def _run(every_s: float) -> None:
    next_reconcile, sleep_s = 0.0, every_s
    while not _stop.wait(sleep_s):
        sleep_s = every_s
        try:
            idle = broker().idle
            report = idle.sweep()
            if time.monotonic() >= next_reconcile:
                idle.reconcile()
                next_reconcile = time.monotonic() + 5.0
            sleep_s = report.sleep_s(time.time(), every_s)
        except Exception:
            log.exception("idle sweep failed; next one in %ss", every_s)


def _start(**_: Any) -> None:
    every_s = Settings.from_env().idle_sweep_s
    if every_s > 0:
        threading.Thread(target=_run, args=(every_s,), name="sandman-idle", daemon=True).start()


def _stop_sweeping(**_: Any) -> None:
    _stop.set()


worker_ready.connect(_start, weak=False)
worker_shutdown.connect(_stop_sweeping, weak=False)
