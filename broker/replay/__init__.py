"""Trace replay: predict warm-hit rate, waits, creates and idle pod-hours of a pool policy.

``trace`` reads and writes the JSONL trace format and builds traces from the ledger;
``sim`` is the virtual-time simulator. Neither touches Redis, Kubernetes or workers, so an
operator can size pools from a trace on a laptop in seconds.
"""

from broker.replay.sim import Policy, Result, simulate
from broker.replay.trace import TraceEvent, read_trace, write_trace

__all__ = ["Policy", "Result", "TraceEvent", "read_trace", "simulate", "write_trace"]
